"""Stage 1's fast path: the edge form without a full retrace.

:func:`fast_core_aten` rewrites only the nodes that need it: an in-place op on
a buffer or on an unaliased intermediate becomes its functional variant
(:mod:`lowering.export.functionalize`; a custom op writing a buffer becomes
``auto_functionalized_v2``); each op that the default table (or its
CompositeImplicitAutograd kernel) decomposes is traced alone and spliced in
its place (:mod:`lowering.export.decompose`); then the clean-ups
(:mod:`lowering.export.cleanups`).  Shapes may be symbolic (a dynamic dim): the
decompositions read their sizes from the graph's ``sym_size`` nodes.  A program it does not handle raises
:class:`~lowering.export.fallback.Fallback` (:func:`_check_fast_path_applies`
says which, up front).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils import _pytree as pytree

from .cleanups import ASSERT_OPS, REMOVABLE_KINDS, remove_asserts, replace_view_ops_with_copies
from .decompose import decompose_to_core, decomposition_tables
from .fallback import Fallback
from .functionalize import (
    functionalize_mutations,
    is_aliasing_call,
    remove_buffer_copies,
    rewrite_tensor_constant_ops,
)


def fast_core_aten(exported: ExportedProgram, kept: Any = None) -> ExportedProgram:
    """The core-ATen edge program of ``exported`` without a full retrace (the nodes of
    ``kept``, a :class:`~lowering.export.kept.KeptOps`, left whole).

    Raises ``Fallback`` (with the reason) when the program needs the slow path.
    ``exported`` is not modified: the graph is copied first (nodes only; meta
    values are shared, tensors are not copied).
    """
    from torch._export.verifier import Verifier
    from torch._guards import detect_fake_mode
    from torch.export._trace import _ignore_backend_decomps
    from torch.export.exported_program import _override_composite_implicit_decomp

    _check_fast_path_applies(exported)
    fake_mode = detect_fake_mode(
        [n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder"]
    )
    if fake_mode is None:
        raise Fallback("no fake mode on the placeholders")
    graph = _copy_graph(exported.graph)
    input_specs = list(exported.graph_signature.input_specs)
    output_specs = list(exported.graph_signature.output_specs)

    rewrite_tensor_constant_ops(graph)
    output_specs = functionalize_mutations(graph, input_specs, output_specs, fake_mode)
    overrides, table = decomposition_tables()
    # As in run_decompositions: no mkldnn / nnpack / cudnn specific
    # decompositions (e.g. of lstm), the default table's CIA rules (9 ops, ~1 ms).
    with _ignore_backend_decomps(), _override_composite_implicit_decomp(overrides):
        decompose_to_core(graph, fake_mode, table, kept)
    remove_buffer_copies(graph, output_specs)
    replace_view_ops_with_copies(graph)
    remove_asserts(graph)
    graph.eliminate_dead_code()
    _check_edge_outputs(graph)
    output_specs = _renamed_output_specs(graph, output_specs)
    graph.lint()
    program = ExportedProgram(
        root=exported.graph_module,  # only for attributes the graph reads (none)
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict=dict(exported.state_dict),
        range_constraints=dict(exported.range_constraints),
        module_call_graph=list(exported.module_call_graph),
        example_inputs=exported.example_inputs,
        constants=dict(exported.constants),
        verifiers=[Verifier],
    )
    return program


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``'s nodes (meta dicts copied, values shared) with the same names.

    ``graph_copy`` renames a node whose name shadows a Python builtin (export
    names a placeholder ``input``); the graph signature names the original,
    so the original name is restored, as ``run_decompositions`` does.
    """
    copy = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    copy.output(copy.graph_copy(graph, val_map))
    copy.output_node().meta = dict(graph.output_node().meta)
    for old, new in val_map.items():
        if new.name != old.name:
            if old.op != "placeholder":
                raise Fallback(f"node {old.name!r} cannot keep its name")
            new.name = new.target = old.name
            copy._graph_namespace._rename_object(new, old.name)
    return copy


def _check_fast_path_applies(exported: ExportedProgram) -> None:
    """Raise ``Fallback`` for programs the fast path does not handle."""
    sig = exported.graph_signature
    if sig.backward_signature is not None:
        raise Fallback("joint (training) graph")
    kinds = [s.kind for s in sig.input_specs]
    if any(k not in (InputKind.USER_INPUT, *REMOVABLE_KINDS) for k in kinds):
        raise Fallback("inputs other than user inputs, parameters, buffers and tensor constants")
    if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION) for s in sig.output_specs):
        raise Fallback("outputs other than user outputs and buffer mutations")
    symbolic = bool(exported.range_constraints)
    for node in exported.graph.nodes:
        if symbolic and _view_of_written(node):
            raise Fallback(f"symbolic shapes and a view of {node.name!r}, written in place")
        if node.op in ("get_attr", "call_module"):
            raise Fallback(f"{node.op} node {node.name!r} (higher-order op or submodule)")
        if node.op == "call_function" and not (
            isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
        ):
            raise Fallback(f"node {node.name!r} calls {node.target} (not an ATen op)")
        if node.op == "output" or (node.op == "call_function" and node.target in ASSERT_OPS):
            continue
        if node.meta.get("val") is None or not _fake_value(node.meta["val"]):
            raise Fallback(f"node {node.name!r} has no FakeTensor meta['val']")


def _view_of_written(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes a tensor in place and a view reads its result.  With symbolic
    shapes the slow path's functionalization puts such a view where it is read, not where
    it was taken; the fast path would keep it in place (another node order, other bytes)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target._schema.is_mutable and any(is_aliasing_call(u) for u in node.users)


def _fake_value(val: Any) -> bool:
    """Whether ``val`` is a FakeTensor, a SymInt, or a tree of them; a size may be symbolic
    (a dynamic dim: a SymInt the graph computes, e.g. with ``sym_size``, and decompositions
    read it there, :func:`lowering.export.decompose.decompose_to_core`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    leaves = pytree.tree_leaves(val)
    if not leaves:
        return val is not None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, FakeTensor):
                return False
        elif isinstance(leaf, (torch.SymFloat, torch.SymBool)):
            return False
    return True


def _check_edge_outputs(graph: torch.fx.Graph) -> None:
    """Every graph output is computed by a node (the slow path never returns an input)."""
    for value in pytree.tree_leaves(graph.output_node().args[0]):
        if isinstance(value, torch.fx.Node) and value.op == "placeholder":
            raise Fallback(f"output {value.name!r} is an input after decomposition")


def _renamed_output_specs(graph: torch.fx.Graph, specs: list[OutputSpec]) -> list[OutputSpec]:
    """Output specs naming the nodes now returned (decomposition replaced some)."""
    values = list(graph.output_node().args[0])
    if len(values) != len(specs):
        raise Fallback("output count does not match the graph signature")
    renamed = []
    for spec, value in zip(specs, values):
        if isinstance(spec.arg, TensorArgument):
            if not isinstance(value, torch.fx.Node):
                raise Fallback("a tensor output is not a node")
            spec = OutputSpec(spec.kind, TensorArgument(value.name), spec.target)
        renamed.append(spec)
    return renamed
