"""Stage 1's control-flow case: which ``torch.cond`` / ``torch.map`` lowerflow can lower.

:func:`check_control_flow` refuses the rest after the edge form is made,
naming the node and the model; :func:`clean_control_flow_submodules` applies
the edge clean-ups inside the branches and bodies (the slow path's: the fast
path never sees control flow).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

from ..control_flow_graph import COND, for_each_submodule_graph, is_control_flow, submodules_of
from ..errors import ExportError
from .cleanups import remove_asserts, replace_view_ops_with_copies


def check_control_flow(program: ExportedProgram, name: str) -> None:
    """Refuse control flow lowerflow cannot lower, naming the node and the model.

    Supported: ``torch.cond`` with a one-element bool tensor predicate and
    tensor outputs, and ``torch.map`` over one tensor with one tensor output;
    either may be nested in a branch or body of the other.  Raises
    :class:`~lowering.errors.ExportError`.
    """
    _check_graph(program.graph_module, name, inside=None)


def _check_graph(gm: torch.fx.GraphModule, name: str, inside: str | None) -> None:
    unsupported = _unsupported_ops()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        where = f"model {name!r}, node {node.name!r}" + (f" (inside {inside!r})" if inside else "")
        if node.target in unsupported:
            raise ExportError(f"{where}: {unsupported[node.target]}")
        if not is_control_flow(node):
            continue
        outputs = node.meta.get("val")
        if not isinstance(outputs, (tuple, list)) or not all(isinstance(v, torch.Tensor) for v in outputs):
            raise ExportError(f"{where}: {node.target.__name__} must return tensors only")
        if node.target is COND:
            pred = node.args[0]
            if not isinstance(pred, torch.fx.Node) or not isinstance(pred.meta.get("val"), torch.Tensor):
                raise ExportError(f"{where}: the torch.cond predicate must be a tensor computed by the model")
            if pred.meta["val"].dtype != torch.bool or pred.meta["val"].numel() != 1:
                raise ExportError(f"{where}: the torch.cond predicate must be a one-element bool tensor")
        else:
            _, mapped, _ = node.args
            if len(mapped) != 1:
                raise ExportError(
                    f"{where}: torch.map over {len(mapped)} tensors is not supported (map over one tensor)"
                )
            if len(outputs) != 1:
                raise ExportError(
                    f"{where}: torch.map with {len(outputs)} outputs is not supported (the body must "
                    "return one tensor)"
                )
        for sub in submodules_of(gm, node):
            _check_graph(sub.module, name, inside=sub.attr if inside is None else f"{inside}/{sub.attr}")


def clean_control_flow_submodules(program: ExportedProgram) -> int:
    """The same clean-ups inside the branches / bodies of cond and map (decomposition
    already applies there): view ops become copies, asserts go.

    Before (``true_graph_0``): ``%permute = aten.permute.default(%p_a_weight, [1, 0])``
    After: ``%permute = aten.permute_copy.default(%p_a_weight, [1, 0])``
    """

    def clean(module: torch.fx.GraphModule) -> None:
        replace_view_ops_with_copies(module.graph)
        remove_asserts(module.graph)

    return for_each_submodule_graph(program.graph_module, clean)


def _unsupported_ops() -> dict[Any, str]:
    """Higher-order control-flow ops lowerflow refuses, with the reason."""
    hop = torch.ops.higher_order
    found = {}
    for name, why in (
        ("while_loop", "torch.while_loop is not supported (only torch.cond and torch.map)"),
        ("scan", "torch.scan is not supported (only torch.cond and torch.map)"),
        ("associative_scan", "associative_scan is not supported (only torch.cond and torch.map)"),
    ):
        op = getattr(hop, name, None)
        if op is not None:
            found[op] = why
    return found
