"""``XnnpackPartitioner``: tags the nodes XNNPACK's runtime takes, per the table :data:`.ops.OPS`.

A node is taken when its op has a rule whose check passes (fp32 tensors, static
weights, supported attributes), and each static operand a rule needs (filter,
bias, BatchNorm statistics) is used only by nodes XNNPACK takes, so the weight
moves into the partition rather than arriving as a runtime input.  Constants
shared by two partitions are duplicated (each payload owns its weights; the
program stores equal bytes once).  Mutated buffers stay in the top-level program.
A partition with more than 4096 inputs and outputs (the runtime's limit) is
dropped.  A partition never returns one of its inputs unchanged: preprocess adds
a Copy node where an output would alias an input.  A recurrent cell's gate
split (:mod:`.recurrent`) stays outside: it runs faster as one portable kernel.

Quantized programs: the plan of :mod:`.qplan` (built once per program) says which
groups compute quantized; q/dq ops are taken by their rules in :data:`.ops.OPS`
(per-tensor q/dq always, dynamic parts with their gemm, weight dqs as static data).
A quantized weight XNNPACK would compute wrong (non-zero weight zero points, group
sizes not a multiple of 32, 8-bit groups, per-tensor weights under a dynamic
activation) is refused with a :class:`PartitionError` naming the node.
"""

from __future__ import annotations

import operator
from typing import Iterable

import torch
from torch.export import ExportedProgram

from ...delegation import CompileSpec
from ...errors import PartitionError
from ...partition import TAG, OpSupportPartitioner, PartitionResult
from . import payload as P
from .ops import check_node, rule_of
from .qplan import plan_quantization
from .recurrent import is_gate_split
from .values import Context

BACKEND_ID = "XnnpackBackend"


class XnnpackPartitioner(OpSupportPartitioner):
    """Partitions a program for ``XnnpackBackend`` (fp32)."""

    def __init__(
        self,
        *,
        compile_specs: Iterable[CompileSpec] = (),
        backend_id: str = BACKEND_ID,
        fused_ops: Iterable[object] = (),
        **options,
    ) -> None:
        options.setdefault("duplicate_shared_constants", True)
        options.setdefault("take_mutated_buffers", False)
        super().__init__(backend_id, self.is_supported, compile_specs=compile_specs, **options)
        self._ctx: Context | None = None
        #: Opt-in fused ops (:mod:`.fused`): FusedOps or their names.
        self.fused_ops = tuple(_fused_op(f) for f in fused_ops)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        self._ctx = Context(exported_program)
        self._ctx.qplan = plan_quantization(exported_program.graph, self._ctx)
        for node, reason in self._ctx.qplan.refusals.items():
            raise PartitionError(f"node {node.name!r} ({node.target}): XNNPACK cannot lower it quantized: {reason}")
        try:
            result = super().partition(exported_program)
        finally:
            self._ctx = None
        _drop_oversized(result)
        return result

    def is_supported(self, node: torch.fx.Node) -> bool:
        """Whether XNNPACK takes ``node`` (called by the capability partitioner for each node)."""
        return self.unsupported_reason(node) is None

    def unsupported_reason(self, node: torch.fx.Node) -> str | None:
        ctx = self._ctx
        if node.op != "call_function":
            return "not an operator call"
        if node.target is operator.getitem:
            source, index = node.args
            if not isinstance(source, torch.fx.Node) or check_node(source, ctx) is not None:
                return "getitem of an unsupported node"
            if is_gate_split(source):
                return "getitem of a recurrent gate split"
            return None
        if is_gate_split(node):
            return "a recurrent cell's gate split runs faster outside (see .recurrent)"
        reason = check_node(node, ctx)
        if reason:
            return reason
        for position in rule_of(node.target).static_operands:  # must be static data owned by the partition
            arg = node.args[position] if position < len(node.args) else None
            if arg is not None and not self._owned(arg):
                return f"static operand {arg.name!r} is also used by nodes XNNPACK does not take"
        return None

    def _owned(self, arg: torch.fx.Node) -> bool:
        """Every user of the static ``arg`` (and of what it is folded from) is taken by XNNPACK."""
        if any(u.op != "call_function" or check_node(u, self._ctx) is not None for u in arg.users):
            return False
        return arg.op == "placeholder" or self._owned(arg.args[0])


def _fused_op(item: object):
    from . import fused

    if not isinstance(item, str):
        return item
    for candidate in fused.FUSED_OPS:
        if candidate.name == item:
            return candidate
    raise ValueError(f"unknown fused op {item!r}; the xnnpack backend has {[f.name for f in fused.FUSED_OPS]}")


def _drop_oversized(result: PartitionResult) -> None:
    """Untag partitions whose inputs + outputs exceed the runtime's limit."""
    graph = result.tagged_exported_program.graph
    members: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        tag = node.meta.get(TAG)
        if tag is not None:
            members.setdefault(tag, []).append(node)
    for tag, nodes in members.items():
        inside = set(nodes)
        inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside}
        outputs = {n for n in nodes if any(u not in inside for u in n.users)}
        if len(inputs) + len(outputs) > P.MAX_EXTERNS:
            for n in nodes:
                n.meta.pop(TAG, None)
            result.partition_tags.pop(tag, None)
