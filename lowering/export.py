"""Stage 1 — export.

``torch.export.export`` of a module (or ``torch.export.load`` of a ``.pt2``),
then decomposition to the core ATen operator set in the form ExecuTorch's
portable kernels accept: functional ops only, with view ops replaced by their
``*_copy`` variants so that every tensor owns its memory and can be planned.
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

import torch
from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import (
    get_view_copy_of_view_op,
)
from torch.export import ExportedProgram

from .errors import ExportError

#: Runtime-check ops that export inserts; they have no kernel in the portable
#: library and carry no data, so the edge form drops them.
_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.msg,
}

#: View ops whose aliasing-free replacement is not ``<name>_copy``.
_VIEW_REPLACEMENTS = {
    torch.ops.aten._unsafe_view.default: torch.ops.aten.view_copy.default,
}


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    name: str | None = None,
) -> ExportedProgram:
    """Export ``model`` on ``example_inputs`` and bring it to the edge form.

    ``name`` is used in error messages (defaults to the model's class name).
    """
    label = name or type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise ExportError(
            f"model {label!r}: expected a torch.nn.Module, got {type(model).__name__}"
        )
    if isinstance(example_inputs, torch.Tensor) or not isinstance(
        example_inputs, (tuple, list)
    ):
        raise ExportError(
            f"model {label!r}: example_inputs must be a tuple of inputs, "
            f"got {type(example_inputs).__name__}"
        )
    try:
        exported = torch.export.export(
            model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as exc:  # torch raises many unrelated types here
        raise ExportError(
            f"model {label!r}: torch.export.export failed: {type(exc).__name__}: "
            f"{_first_line(exc)}"
        ) from exc
    return to_edge(exported, name=label)


def load(source: str | os.PathLike | bytes | io.IOBase, *, name: str | None = None) -> ExportedProgram:
    """Load a ``.pt2`` saved by ``torch.export.save`` and bring it to the edge form."""
    label = name or (str(source) if isinstance(source, (str, os.PathLike)) else "<pt2 bytes>")
    try:
        if isinstance(source, (bytes, bytearray)):
            source = io.BytesIO(source)
        exported = torch.export.load(source)
    except Exception as exc:
        raise ExportError(f"model {label!r}: cannot load .pt2: {_first_line(exc)}") from exc
    return to_edge(exported, name=label)


def to_edge(exported: ExportedProgram, *, name: str = "<program>") -> ExportedProgram:
    """Decompose to core ATen, then rewrite view ops and drop asserts in place.

    Before (after core ATen decomposition)::

        %t = aten.t.default(%w)
        %v = aten.view.default(%x, [4, 8])
        %_ = aten._assert_tensor_metadata.default(%x, ...)

    After::

        %t = aten.permute_copy.default(%w, [1, 0])   # via decomposition of t
        %v = aten.view_copy.default(%x, [4, 8])
    """
    try:
        decomposed = exported.run_decompositions()
    except Exception as exc:
        raise ExportError(
            f"model {name!r}: decomposition to core ATen failed: {_first_line(exc)}"
        ) from exc
    graph = decomposed.graph_module.graph
    replace_view_ops_with_copies(graph)
    remove_asserts(graph)
    graph.lint()
    decomposed.graph_module.recompile()
    return decomposed


def replace_view_ops_with_copies(graph: torch.fx.Graph) -> int:
    """Retarget every aliasing view op to its ``*_copy`` variant; returns the count.

    Only ``node.target`` changes: the node keeps its args, meta and users, so no
    retrace is needed (a retrace costs >= 0.15 s even on tiny graphs).
    """
    count = 0
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        replacement = _VIEW_REPLACEMENTS.get(node.target)
        if replacement is None:
            try:
                replacement = get_view_copy_of_view_op(node.target._schema)
            except Exception as exc:
                raise ExportError(
                    f"view op {node.target} at node {node.name!r} has no *_copy variant"
                ) from exc
        if replacement is not None:
            node.target = replacement
            count += 1
    return count


def remove_asserts(graph: torch.fx.Graph) -> int:
    """Erase runtime-assert nodes that nothing uses; returns the count."""
    doomed = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target in _ASSERT_OPS and not n.users
    ]
    for node in reversed(doomed):
        graph.erase_node(node)
    return len(doomed)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
