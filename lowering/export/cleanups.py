"""The edge form's clean-ups, common to both paths of stage 1.

- :func:`replace_view_ops_with_copies`: every aliasing view op becomes its
  ``*_copy`` variant, so that every tensor owns its memory and can be planned;
- :func:`remove_asserts`: runtime-assert ops (no kernel in the portable
  library, no data) go;
- :func:`remove_unused_constants`: parameters, buffers and constants no node
  reads go;
- :func:`infer_symbolic_view_size`: a view's one symbolic size becomes ``-1``;
- :func:`cancel_inverse_permutes`: a permute undone by the next one goes.

Each rewrites a graph in place and returns how many nodes it changed.
"""

from __future__ import annotations

import torch
from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import (
    get_view_copy_of_view_op,
)
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ..errors import ExportError

#: Runtime-check ops that export inserts; they have no kernel in the portable
#: library and carry no data, so the edge form drops them.
ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.msg,
}

#: View ops whose aliasing-free replacement is not ``<name>_copy``.
_VIEW_REPLACEMENTS = {
    torch.ops.aten._unsafe_view.default: torch.ops.aten.view_copy.default,
}

#: Lifted inputs that :func:`remove_unused_constants` may drop.
REMOVABLE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def replace_view_ops_with_copies(graph: torch.fx.Graph) -> int:
    """Retarget every aliasing view op to its ``*_copy`` variant; returns the count.

    Only ``node.target`` changes: the node keeps its args, meta and users, so no
    retrace is needed (a retrace costs >= 0.15 s even on tiny graphs).

    Before: ``%v = aten.view.default(%x, [4, 8])``
    After:  ``%v = aten.view_copy.default(%x, [4, 8])``
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
    """Erase runtime-assert nodes that nothing uses; returns the count.

    Before: ``%_ = aten._assert_tensor_metadata.default(%x, ...)``
    After:  (nothing)
    """
    doomed = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target in ASSERT_OPS and not n.users
    ]
    for node in reversed(doomed):
        graph.erase_node(node)
    return len(doomed)


def remove_unused_constants(program: ExportedProgram) -> int:
    """Drop parameters, buffers and tensor constants that no node reads; returns the count.

    The placeholder, its input spec and (unless another spec still names the
    same target) its ``state_dict`` / ``constants`` entry go.  A buffer that is
    written (a ``BUFFER_MUTATION`` output) stays.

    Before::

        %b_bn1_num_batches_tracked = placeholder   # BUFFER, no users

    After: (no placeholder, no input spec, no state_dict entry)
    """
    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(specs):
        raise ExportError("placeholders do not match the graph signature's inputs")
    # A buffer the program writes (e.g. ``buf.copy_(x)``) stays even if never read.
    written = {s.target for s in program.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    doomed = [
        i
        for i, (node, spec) in enumerate(zip(placeholders, specs))
        if spec.kind in REMOVABLE_KINDS and not node.users and spec.target not in written
    ]
    if not doomed:
        return 0
    gone = {specs[i].target for i in doomed}
    for i in reversed(doomed):
        graph.erase_node(placeholders[i])
        del specs[i]
    still_used = {s.target for s in specs}
    for target in gone - still_used:
        program.state_dict.pop(target, None)
        program.constants.pop(target, None)
    return len(doomed)


def infer_symbolic_view_size(graph: torch.fx.Graph) -> int:
    """A ``view_copy`` to exactly one symbolic size gets ``-1`` there (inferred from the input,
    same result); returns the count.  The view then reads no symbolic value, so a backend can
    take it (XNNPACK's reshape infers one size), and the size nodes left unused go.

    Before: ``%view = aten.view_copy.default(%x, [1, %sym_size_int, -1, 32])``  (x: [1, s, 128])
    After:  ``%view = aten.view_copy.default(%x, [1, -1, 4, 32])``
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.view_copy.default:
            continue
        shape = node.meta["val"].shape
        # an inferred -1 whose size is static is that size (then the symbolic one can be -1)
        sizes = [shape[i] if isinstance(s, int) and s < 0 and isinstance(shape[i], int) else s
                 for i, s in enumerate(node.args[1])]
        symbolic = [i for i, s in enumerate(sizes) if isinstance(s, torch.fx.Node)]
        if len(symbolic) != 1 or any(isinstance(s, int) and s < 0 for s in sizes):
            continue
        source = symbolic[0]
        size_node = sizes[source]
        node.args = (node.args[0], [-1 if i == source else s for i, s in enumerate(sizes)], *node.args[2:])
        if not size_node.users and size_node.target in (torch.ops.aten.sym_size.int,):
            graph.erase_node(size_node)
        count += 1
    return count


def cancel_inverse_permutes(graph: torch.fx.Graph) -> int:
    """A ``permute_copy`` that undoes the ``permute_copy`` it reads is its source; returns the count
    (ExecuTorch's LLM export runs ``RemoveRedundantTransposes`` for the same pairs).

    Before: ``%t = permute_copy(%v, [0, 2, 1, 3])``   ``%u = permute_copy(%t, [0, 2, 1, 3])``   ``f(%u)``
    After:  ``f(%v)``  (``%t`` goes once nothing else reads it)

    A pair whose result is a graph output stays: an output never aliases another value.
    """
    permute = torch.ops.aten.permute_copy.default
    count = 0
    for node in list(graph.nodes):
        inner = node.args[0] if node.op == "call_function" and node.target is permute else None
        if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target is permute):
            continue
        rank = len(inner.args[1])
        first, second = [int(p) % rank for p in inner.args[1]], [int(p) % rank for p in node.args[1]]
        if [first[p] for p in second] != list(range(rank)) or any(u.op == "output" for u in node.users):
            continue
        node.replace_all_uses_with(inner.args[0])
        graph.erase_node(node)
        if not inner.users:
            graph.erase_node(inner)
        count += 1
    return count
