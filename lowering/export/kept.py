"""Ops a partitioner keeps from decomposition (ExecuTorch's ``ops_to_not_decompose``).

A backend may want an op whole that the edge form decomposes: Core ML converts
``aten.linear`` and ``aten.max_pool2d`` itself (it cannot take
``max_pool2d_with_indices`` with both outputs used), Vulkan ``hardswish``.  Its
partitioner says so (:meth:`lowering.partition.Partitioner.ops_to_not_decompose`,
asked on the program before decomposition); stage 1 then leaves those nodes whole
and marks them ``node.meta[KEPT]``; stage 2 decomposes the kept nodes no partition
took (:func:`lowering.export.decompose.decompose_kept`), so the rest of the program is the edge form the portable kernels run::

    exported            %linear = aten.linear(%x, %w, %b)
    stage 1 (kept)      %linear = aten.linear(%x, %w, %b)          {not_decomposed: True}
    stage 2, untagged   %permute_copy = aten.permute_copy(%w, [1, 0])
                        %addmm = aten.addmm(%b, %x, %permute_copy)

As in ExecuTorch, ops that mutate or alias their inputs are never kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.export import ExportedProgram

#: ``node.meta`` key of a node stage 1 left whole for a partitioner.
KEPT = "not_decomposed"

#: What a partitioner answers: (ops to keep, an optional per-node check), ExecuTorch's form.
KeepQuestion = Callable[[ExportedProgram], "tuple[list, Callable[[torch.fx.Node], bool] | None]"]


@dataclasses.dataclass(frozen=True)
class KeptOps:
    """The ops to keep whole, and which of their nodes (``check``: None, all of them)."""

    ops: frozenset
    check: Callable[[torch.fx.Node], bool] | None = None

    def __call__(self, node: torch.fx.Node) -> bool:
        return (node.op == "call_function" and node.target in self.ops
                and (self.check is None or bool(self.check(node))))


def kept_ops(keep: KeepQuestion | None, exported: ExportedProgram) -> KeptOps | None:
    """The answer of ``keep`` (a partitioner's ``ops_to_not_decompose``) on ``exported``,
    without the ops that cannot stay whole; None when nothing is kept."""
    if keep is None:
        return None
    ops, check = keep(exported)
    usable = frozenset(op for op in ops or () if keepable(op))
    return KeptOps(usable, check) if usable else None


def keepable(op: Any) -> bool:
    """An ATen overload that neither mutates nor aliases (what ExecuTorch lets a partitioner keep)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return False
    schema = op._schema
    return not schema.is_mutable and all(ret.alias_info is None for ret in schema.returns)


def mark_kept(graph: torch.fx.Graph, kept: KeptOps) -> int:
    """Mark the nodes ``kept`` keeps (after a decomposition that left their ops whole)."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in kept.ops:
            node.meta[KEPT] = True
            count += 1
    return count
