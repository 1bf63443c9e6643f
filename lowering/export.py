"""Stage 1 — export.

``torch.export.export`` of a module (or ``torch.export.load`` of a ``.pt2``),
then decomposition to the core ATen operator set in the form ExecuTorch's
portable kernels accept (the *edge form*):

- core ATen ops only, decomposed with torch's default table
  (``torch.export.default_decompositions()``, what ``run_decompositions()`` uses);
- functional: no in-place ops; a buffer updated in place is a
  ``BUFFER_MUTATION`` output of the graph signature;
- view ops replaced by their ``*_copy`` variants, so that every tensor owns its
  memory and can be planned;
- runtime asserts removed;
- every node has a ``meta["val"]`` (FakeTensor) that the memory planner and the
  emitter read shapes, dtypes and strides from.

Two ways to get there, same result:

- the **fast path** (:func:`fast_core_aten`) rewrites only the nodes that need it:
  an in-place op on a buffer or on an unaliased intermediate becomes its
  functional variant; each op that the default table (or its
  CompositeImplicitAutograd kernel) decomposes is traced alone with ``make_fx``
  on FakeTensors built from its inputs' ``meta["val"]`` and the small graph is
  spliced in its place.  A retrace of the whole program costs >= 0.15 s even on
  a 5-node graph; tracing one op costs a few milliseconds.
- the **slow path**, ``ExportedProgram.run_decompositions()`` (a full retrace
  with functionalization), for whatever the fast path does not handle:
  higher-order ops, symbolic shapes, get_attr / call_module nodes, mutations
  through views or of user inputs / parameters / constants, ops the fast path
  does not know, a decomposition that itself mutates or makes constants.

After either path, two cheap clean-ups: parameters, buffers and constants no
node uses are removed, and (``fold_constants=True``) view-copies of parameters
and constants (e.g. a Linear's transposed weight) are folded into new lifted
constants so that they neither run nor occupy the arena at runtime.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import operator
import os
from typing import Any, Mapping, Sequence

import torch
from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import (
    get_view_copy_of_view_op,
)
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils import _pytree as pytree

from .errors import ExportError
from .dynamic import DynamicShapeError, check_bounded, complete_dynamic_shapes, sym_scalars_to_tensors

log = logging.getLogger(__name__)

#: Use the fast path (local decomposition) when it applies; else always retrace.
FAST_PATH = True

#: Default of ``fold_constants`` in :func:`export`, :func:`load` and :func:`to_edge`.
FOLD_CONSTANTS = True

#: ``graph_module.meta`` key telling which path produced an edge program:
#: ``"fast"`` or ``"slow: <reason the fast path was not taken>"``.
PATH_META = "lowerflow_stage1"

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

#: Kinds of lifted inputs whose value is fixed at export time.
_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.CONSTANT_TENSOR)

#: Lifted inputs that :func:`remove_unused_constants` may drop.
_REMOVABLE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class _Fallback(Exception):
    """The fast path does not handle this program; the message says why."""


# ------------------------------------------------------------------ entry points


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    name: str | None = None,
    fast: bool | None = None,
    fold_constants: bool | None = None,
) -> ExportedProgram:
    """Export ``model`` on ``example_inputs`` and bring it to the edge form.

    ``dynamic_shapes`` is torch.export's argument; by name, arguments left out
    are static.  Every ``torch.export.Dim`` needs a max (the runtime reserves
    memory for it), or :class:`ExportError` names the input and dim.
    ``name`` is used in error messages (defaults to the model's class name).
    ``fast`` / ``fold_constants`` default to :data:`FAST_PATH` / :data:`FOLD_CONSTANTS`.
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
        dynamic_shapes = complete_dynamic_shapes(model, len(example_inputs), dynamic_shapes)
        exported = torch.export.export(
            model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as exc:  # torch raises many unrelated types here
        raise ExportError(f"model {label!r}: {_export_failure(model, example_inputs, exc)}") from exc
    return to_edge(exported, name=label, fast=fast, fold_constants=fold_constants)


def _export_failure(model: torch.nn.Module, example_inputs: Sequence[Any], exc: Exception) -> str:
    """Why torch.export failed, in one line: if the model fails in eager on its example
    inputs too (a wrong input shape or dtype), say that, with eager's own message
    (clearer than the fake-tensor one); otherwise torch.export's reason."""
    try:
        with torch.no_grad():
            copy.deepcopy(model)(*example_inputs)
    except Exception as eager:
        shapes = ", ".join(
            f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor)
            else type(x).__name__
            for x in example_inputs
        )
        return (
            f"the model fails on its example inputs ({shapes}) in eager mode too: "
            f"{type(eager).__name__}: {_first_line(eager)}"
        )
    if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
        return (
            "the model branches on tensor values (data-dependent control flow), which torch.export "
            "cannot trace; use torch.cond or make the branch depend on shapes only "
            f"({type(exc).__name__}: {_first_line(exc)})"
        )
    return f"torch.export.export failed: {type(exc).__name__}: {_first_line(exc)}"


def load(
    source: str | os.PathLike | bytes | io.IOBase,
    *,
    name: str | None = None,
    fast: bool | None = None,
    fold_constants: bool | None = None,
) -> ExportedProgram:
    """Load a ``.pt2`` saved by ``torch.export.save`` and bring it to the edge form."""
    label = name or (str(source) if isinstance(source, (str, os.PathLike)) else "<pt2 bytes>")
    try:
        if isinstance(source, (bytes, bytearray)):
            source = io.BytesIO(source)
        exported = torch.export.load(source)
    except Exception as exc:
        raise ExportError(f"model {label!r}: cannot load .pt2: {_first_line(exc)}") from exc
    return to_edge(exported, name=label, fast=fast, fold_constants=fold_constants)


def to_edge(
    exported: ExportedProgram,
    *,
    name: str = "<program>",
    fast: bool | None = None,
    fold_constants: bool | None = None,
) -> ExportedProgram:
    """Decompose to core ATen, rewrite view ops, drop asserts and unused constants.

    ``exported`` itself is left unchanged.

    Before (training IR from ``torch.export.export``)::

        %linear = aten.linear.default(%x, %p_w, %p_b)
        %v = aten.view.default(%linear, [4, 8])
        %_ = aten._assert_tensor_metadata.default(%x, ...)

    After::

        %permute = aten.permute_copy.default(%p_w, [1, 0])
        %addmm = aten.addmm.default(%p_b, %x, %permute)
        %v = aten.view_copy.default(%addmm, [4, 8])

    With ``fold_constants`` the ``permute_copy`` of the parameter becomes a
    lifted constant (see :func:`fold_constant_views`).
    """
    fast = FAST_PATH if fast is None else fast
    fold_constants = FOLD_CONSTANTS if fold_constants is None else fold_constants
    program, path = None, "slow: fast path disabled"
    if fast:
        try:
            program, path = fast_core_aten(exported), "fast"
        except _Fallback as why:
            path = f"slow: {why}"
            log.debug("model %r: stage 1 falls back to run_decompositions(): %s", name, why)
        except Exception as exc:  # a bug of the fast path must not fail the export
            path = f"slow: fast path failed: {type(exc).__name__}: {_first_line(exc)}"
            log.warning("model %r: %s", name, path)
    if program is None:
        program = _slow_core_aten(exported, name)
    program = _finish_edge(program, fold_constants=fold_constants, name=name)
    from .control_flow import check_control_flow

    check_control_flow(program, name)
    program.graph_module.meta[PATH_META] = path
    try:
        check_bounded(program)
    except DynamicShapeError as exc:
        raise ExportError(f"model {name!r}: {exc}") from None
    return program


def _slow_core_aten(exported: ExportedProgram, name: str) -> ExportedProgram:
    """``run_decompositions()`` (a full retrace), then views to copies and no asserts."""
    try:
        decomposed = exported.run_decompositions()
    except Exception as exc:
        raise ExportError(
            f"model {name!r}: decomposition to core ATen failed: {_first_line(exc)}"
        ) from exc
    graph = decomposed.graph_module.graph
    replace_view_ops_with_copies(graph)
    remove_asserts(graph)
    _clean_control_flow_submodules(decomposed)
    graph.lint()
    decomposed.graph_module.recompile()
    return decomposed


def _clean_control_flow_submodules(program: ExportedProgram) -> int:
    """The same clean-ups inside the branches / bodies of cond and map (decomposition
    already applies there): view ops become copies, asserts go.

    Before (``true_graph_0``): ``%permute = aten.permute.default(%p_a_weight, [1, 0])``
    After: ``%permute = aten.permute_copy.default(%p_a_weight, [1, 0])``
    """
    from .control_flow import for_each_submodule_graph

    def clean(module: torch.fx.GraphModule) -> None:
        replace_view_ops_with_copies(module.graph)
        remove_asserts(module.graph)

    return for_each_submodule_graph(program.graph_module, clean)


def _finish_edge(program: ExportedProgram, *, fold_constants: bool, name: str) -> ExportedProgram:
    """Fold constant views (optional), drop unused lifted inputs, recompile if changed."""
    graph = program.graph_module.graph
    changed = sym_scalars_to_tensors(graph)
    if fold_constants:
        try:
            changed += fold_constant_views(program)
        except Exception as exc:
            raise ExportError(f"model {name!r}: constant folding failed: {_first_line(exc)}") from exc
    changed += remove_unused_constants(program)
    if changed:  # a recompile costs ~25 ms on the LSTM's 700 nodes
        graph.lint()
        program.graph_module.recompile()
    return program


# --------------------------------------------------------------------- fast path


@functools.cache
def _decomposition_tables() -> tuple[dict, dict]:
    """``(cia_overrides, python_table)``: how ``run_decompositions()`` splits the default table.

    Every CompositeImplicitAutograd (CIA) op decomposes through its own CIA
    kernel (the natural dispatch when tracing below autograd) except the few
    the default table gives a different rule: those go to ``cia_overrides`` (a
    decomposition, or torch's "preserve" marker for ``PRESERVED_ATEN_CIA_OPS``
    not in the table).  All other entries are applied by ``make_fx``.
    The table does not depend on the model, so it is built once.
    """
    from torch._decomp import _core_aten_decompositions_post_autograd
    from torch._export.utils import _is_preservable_cia_op, _special_op_to_preserve_cia
    from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

    table = dict(_core_aten_decompositions_post_autograd())
    overrides = {op: table.pop(op) for op in list(table) if _is_preservable_cia_op(op)}
    for op in PRESERVED_ATEN_CIA_OPS:
        overrides.setdefault(op, _special_op_to_preserve_cia)
    return overrides, table


@functools.cache
def _preserved_ops() -> frozenset:
    """CIA ops the default table keeps (``upsample_*.vec``)."""
    from torch._export.utils import _special_op_to_preserve_cia

    overrides, _ = _decomposition_tables()
    return frozenset(op for op, fn in overrides.items() if fn is _special_op_to_preserve_cia)


def fast_core_aten(exported: ExportedProgram) -> ExportedProgram:
    """The core-ATen edge program of ``exported`` without a full retrace.

    Raises ``_Fallback`` (with the reason) when the program needs the slow path.
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
        raise _Fallback("no fake mode on the placeholders")
    graph = _copy_graph(exported.graph)
    input_specs = list(exported.graph_signature.input_specs)
    output_specs = list(exported.graph_signature.output_specs)

    rewrite_tensor_constant_ops(graph)
    output_specs = functionalize_mutations(graph, input_specs, output_specs, fake_mode)
    overrides, table = _decomposition_tables()
    # As in run_decompositions: no mkldnn / nnpack / cudnn specific
    # decompositions (e.g. of lstm), the default table's CIA rules (9 ops, ~1 ms).
    with _ignore_backend_decomps(), _override_composite_implicit_decomp(overrides):
        decompose_to_core(graph, fake_mode, table)
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
                raise _Fallback(f"node {old.name!r} cannot keep its name")
            new.name = new.target = old.name
            copy._graph_namespace._rename_object(new, old.name)
    return copy


def _check_fast_path_applies(exported: ExportedProgram) -> None:
    """Raise ``_Fallback`` for programs the fast path does not handle."""
    sig = exported.graph_signature
    if sig.backward_signature is not None:
        raise _Fallback("joint (training) graph")
    if exported.range_constraints:
        raise _Fallback("symbolic shapes (range constraints)")
    kinds = [s.kind for s in sig.input_specs]
    if any(k not in (InputKind.USER_INPUT, *_REMOVABLE_KINDS) for k in kinds):
        raise _Fallback("inputs other than user inputs, parameters, buffers and tensor constants")
    if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION) for s in sig.output_specs):
        raise _Fallback("outputs other than user outputs and buffer mutations")
    for node in exported.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            raise _Fallback(f"{node.op} node {node.name!r} (higher-order op or submodule)")
        if node.op == "call_function" and not (
            isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
        ):
            raise _Fallback(f"node {node.name!r} calls {node.target} (not an ATen op)")
        if node.op == "output" or (node.op == "call_function" and node.target in _ASSERT_OPS):
            continue
        if node.meta.get("val") is None or not _static_value(node.meta["val"]):
            raise _Fallback(f"node {node.name!r} has a symbolic or missing meta['val']")


def _static_value(val: Any) -> bool:
    """Whether ``val`` is a FakeTensor (or a tree of them) with static shapes."""
    from torch._subclasses.fake_tensor import FakeTensor

    leaves = pytree.tree_leaves(val)
    if not leaves:
        return val is not None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, FakeTensor):
                return False
            if any(not isinstance(s, int) for s in (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
                return False
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
    return True


# --------------------------------------------------------------- functionalize


def rewrite_tensor_constant_ops(graph: torch.fx.Graph) -> int:
    """What functionalization makes of ``torch.tensor(...)`` in ``forward``; returns the count.

    ``lift_fresh_copy`` becomes ``clone``; ``detach_`` (only changes autograd
    metadata, and the edge form has none) is dropped.

    Before::

        %lift_fresh_copy = aten.lift_fresh_copy.default(%c_lifted_tensor_0)
        %detach_ = aten.detach_.default(%lift_fresh_copy)
        %mul = aten.mul.Tensor(%x, %detach_)

    After::

        %lift_fresh_copy = aten.clone.default(%c_lifted_tensor_0)
        %mul = aten.mul.Tensor(%x, %lift_fresh_copy)
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.lift_fresh_copy.default:
            node.target = torch.ops.aten.clone.default
            count += 1
        elif node.target is torch.ops.aten.detach_.default and isinstance(node.args[0], torch.fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            count += 1
    return count



def functionalize_mutations(
    graph: torch.fx.Graph,
    input_specs: list[InputSpec],
    output_specs: list[OutputSpec],
    fake_mode: Any,
) -> list[OutputSpec]:
    """Replace in-place ops by their functional variants; returns the new output specs.

    Handles an in-place op whose mutated argument (``self``) is a buffer
    placeholder or the result of a functional, non-aliasing op, when nothing
    aliases that tensor (no view of it anywhere).  Later uses of the tensor
    read the new value; a buffer's last value becomes a ``BUFFER_MUTATION``
    output (first, in input order, as functionalization orders them).
    Anything else raises ``_Fallback``.

    Before::

        %add_ = aten.add_.Tensor(%b_acc, %sum_1)
        %add = aten.add.Tensor(%mul, %add_)
        return (add,)                                # USER_OUTPUT

    After::

        %add_1 = aten.add.Tensor(%b_acc, %sum_1)
        %add = aten.add.Tensor(%mul, %add_1)
        return (add_1, add)                          # BUFFER_MUTATION 'acc', USER_OUTPUT
    """
    kind_of = {s.arg.name: s for s in input_specs if isinstance(s.arg, TensorArgument)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    root_of: dict[torch.fx.Node, torch.fx.Node] = {}
    last_value: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        functional = _functional_variant(node.target)
        mutated = node.args[0] if node.args else None
        if functional is None or not isinstance(mutated, torch.fx.Node):
            raise _Fallback(f"in-place op {node.target} at {node.name!r}")
        root = root_of.get(mutated, mutated)
        if root.op == "placeholder":
            spec = kind_of.get(root.name)
            if spec is None or spec.kind != InputKind.BUFFER:
                raise _Fallback(f"{node.target} at {node.name!r} mutates a non-buffer input")
        elif not _is_functional_call(mutated):
            raise _Fallback(f"{node.target} at {node.name!r} mutates the output of {mutated.target}")
        if any(_is_aliasing_call(u) for u in mutated.users if u is not node):
            raise _Fallback(f"{node.target} at {node.name!r} mutates a tensor that has views")
        with graph.inserting_before(node):
            new = graph.create_node("call_function", functional, node.args, node.kwargs, name=functional._opname)
        new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        with fake_mode:
            new.meta["val"] = functional(*_vals(node.args), **_vals(node.kwargs))
        order[new] = order[node]
        for user in list(mutated.users):
            if user is not node and user is not new and order[user] > order[node]:
                user.replace_input_with(mutated, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        root_of[new] = root
        if root.op == "placeholder":
            last_value[root] = new
    if not last_value:
        return output_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mutated_buffers = [p for p in placeholders if p in last_value]
    out = graph.output_node()
    values = list(out.args[0])
    out.args = ((*[last_value[p] for p in mutated_buffers], *values),)
    mutation_specs = [
        OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(last_value[p].name), kind_of[p.name].target)
        for p in mutated_buffers
    ]
    return [*mutation_specs, *output_specs]


def remove_buffer_copies(graph: torch.fx.Graph, output_specs: list[OutputSpec]) -> int:
    """A buffer's new value that is a same-shape, same-dtype ``copy`` of ``src`` is ``src``.

    ``buf.copy_(src)`` functionalizes to ``copy(buf, src)``; ``run_decompositions``
    drops that copy (``_remove_unnecessary_copy_op_pass``), so the fast path
    does too.  Returns the count.

    Before::

        %copy = aten.copy.default(%b_c, %select)
        return (copy, ...)                       # BUFFER_MUTATION 'c'

    After::

        return (select, ...)                     # BUFFER_MUTATION 'c'
    """
    out = graph.output_node()
    values = list(out.args[0])
    count = 0
    for spec, value in zip(output_specs, values):
        if spec.kind != OutputKind.BUFFER_MUTATION or not isinstance(value, torch.fx.Node):
            continue
        if value.op != "call_function" or value.target is not torch.ops.aten.copy.default:
            continue
        dst, src = value.args[0], value.args[1]
        if not isinstance(src, torch.fx.Node) or value.kwargs.get("non_blocking"):
            continue
        a, b = dst.meta.get("val"), src.meta.get("val")
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            continue
        value.replace_all_uses_with(src)
        graph.erase_node(value)
        count += 1
    return count


def _functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``: same arguments, only ``self`` written."""
    schema = op._schema
    if not schema.name.startswith("aten::") or not schema.name.endswith("_"):
        return None
    args = schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in args[1:]):
        return None
    packet = getattr(torch.ops.aten, schema.name[len("aten::") : -1], None)
    if packet is None:
        return None
    functional = getattr(packet, schema.overload_name or "default", None)
    if functional is None or functional._schema.is_mutable:
        return None
    theirs = functional._schema.arguments
    if [(a.name, str(a.type)) for a in theirs] != [(a.name, str(a.type)) for a in args]:
        return None
    return functional


def _is_aliasing_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns (or may return) an alias of an input."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _is_functional_call(node: torch.fx.Node) -> bool:
    """A call of an ATen op that neither mutates nor aliases (or a getitem of one)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_functional_call(node.args[0])
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and not node.target._schema.is_mutable
        and not _is_aliasing_call(node)
    )


def _vals(tree: Any) -> Any:
    return torch.fx.node.map_arg(tree, lambda n: n.meta["val"])


# ------------------------------------------------------------------- decompose


def decompose_to_core(graph: torch.fx.Graph, fake_mode: Any, table: Mapping) -> int:
    """Decompose, one node at a time, every op that is not core ATen; returns the count.

    A node is kept when its op is neither in ``table`` nor has a
    CompositeImplicitAutograd kernel (other than the preserved ones), and is
    core ATen or an assert.  Otherwise the op alone is traced by ``make_fx`` on
    FakeTensors of its inputs (under no_grad, as ``run_decompositions`` does),
    with ``table`` applied recursively, and the small graph replaces the node.
    Anything else raises ``_Fallback``.

    Before::

        %linear = aten.linear.default(%x, %p_w, %p_b)

    After::

        %permute = aten.permute.default(%p_w, [1, 0])
        %addmm = aten.addmm.default(%p_b, %x, %permute)
    """
    preserved = _preserved_ops()
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        op = node.target
        if _needs_decomposition(op, table, preserved):
            _splice(graph, node, _trace_op(node, fake_mode, table), preserved, table)
            count += 1
        elif not _keeps(op):
            raise _Fallback(f"op {op} at {node.name!r} is neither core ATen nor decomposable")
    return count


def _needs_decomposition(op: torch._ops.OpOverload, table: Mapping, preserved: set) -> bool:
    from torch._export.utils import _is_cia_op

    return op in table or (_is_cia_op(op) and op not in preserved)


def _keeps(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` may stay in an edge graph (before view ops become copies)."""
    if op in _ASSERT_OPS:
        return True
    if op._schema.is_mutable:
        return False
    return torch.Tag.core in op.tags or op in _preserved_ops()


def _trace_op(node: torch.fx.Node, fake_mode: Any, table: Mapping) -> torch.fx.GraphModule:
    """``make_fx`` of ``node.target`` alone on FakeTensors of its inputs' meta values."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Node)]
    fakes = [leaves[i].meta["val"] for i in positions]
    if not all(isinstance(f, torch.Tensor) for f in fakes):
        raise _Fallback(f"non-tensor node input of {node.target} at {node.name!r}")

    def call(*tensors):
        filled = list(leaves)
        for i, tensor in zip(positions, tensors):
            filled[i] = tensor
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    # The Python dispatcher makes the Python CIA kernels (e.g. of matmul,
    # batch_norm, lstm) apply, as they do in run_decompositions' retrace.
    # Parameters' meta values require grad; the retrace's functional tensors
    # do not, and some decompositions (matmul's folding) depend on it.
    # Only the traced graph is read, never run: a lazy GraphModule skips the
    # Python code generation (~1.5 ms per trace).
    with fake_mode, torch.no_grad(), enable_python_dispatcher(), _use_lazy_graph_module(True):
        fakes = [f.detach() if f.requires_grad else f for f in fakes]
        return make_fx(call, decomposition_table=table)(*fakes)


def _splice(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    traced: torch.fx.GraphModule,
    preserved: set,
    table: Mapping,
) -> None:
    """Put ``traced``'s nodes in place of ``node``; its users read the traced outputs.

    New nodes inherit ``node``'s meta (module stack, stack trace, ...) with
    their own ``val``.  A tuple-returning ``node`` must only be read through
    ``getitem``; those getitems are replaced by the matching outputs.
    """
    inputs = [leaf for leaf in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(leaf, torch.fx.Node)]
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    result = None
    with graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op == "placeholder":
                continue
            if sub.op == "output":
                result = torch.fx.node.map_arg(sub.args[0], lambda n: env[n])
                break
            if sub.op != "call_function" or not (
                sub.target is operator.getitem or isinstance(sub.target, torch._ops.OpOverload)
            ):
                raise _Fallback(f"decomposition of {node.target} has a {sub.op} node ({sub.target})")
            if sub.target is not operator.getitem and (
                _needs_decomposition(sub.target, table, preserved) or not _keeps(sub.target)
            ):
                raise _Fallback(f"decomposition of {node.target} emits {sub.target}")
            new = graph.node_copy(sub, lambda n: env[n])
            new.meta = {**inherited, **{k: sub.meta[k] for k in ("val", "tensor_meta") if k in sub.meta}}
            env[sub] = new
    _replace_uses(node, result)
    graph.erase_node(node)


def _replace_uses(node: torch.fx.Node, result: Any) -> None:
    """Make ``node``'s users read ``result`` (a node, or a tuple/list of them)."""
    if isinstance(result, torch.fx.Node):
        node.replace_all_uses_with(result)
        return
    if not isinstance(result, (tuple, list)):
        raise _Fallback(f"decomposition of {node.target} at {node.name!r} returns {type(result).__name__}")
    for user in list(node.users):
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            raise _Fallback(f"{node.name!r} returns several values and {user.name!r} reads them whole")
        value = result[user.args[1]]
        if not isinstance(value, torch.fx.Node):
            raise _Fallback(f"output {user.args[1]} of {node.target} is not a tensor")
        user.replace_all_uses_with(value)
        user.graph.erase_node(user)


def _check_edge_outputs(graph: torch.fx.Graph) -> None:
    """Every graph output is computed by a node (the slow path never returns an input)."""
    for value in pytree.tree_leaves(graph.output_node().args[0]):
        if isinstance(value, torch.fx.Node) and value.op == "placeholder":
            raise _Fallback(f"output {value.name!r} is an input after decomposition")


def _renamed_output_specs(graph: torch.fx.Graph, specs: list[OutputSpec]) -> list[OutputSpec]:
    """Output specs naming the nodes now returned (decomposition replaced some)."""
    values = list(graph.output_node().args[0])
    if len(values) != len(specs):
        raise _Fallback("output count does not match the graph signature")
    renamed = []
    for spec, value in zip(specs, values):
        if isinstance(spec.arg, TensorArgument):
            if not isinstance(value, torch.fx.Node):
                raise _Fallback("a tensor output is not a node")
            spec = OutputSpec(spec.kind, TensorArgument(value.name), spec.target)
        renamed.append(spec)
    return renamed


# ------------------------------------------------------------------ clean-ups


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
        if n.op == "call_function" and n.target in _ASSERT_OPS and not n.users
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
        if spec.kind in _REMOVABLE_KINDS and not node.users and spec.target not in written
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


def fold_constant_views(program: ExportedProgram) -> int:
    """Replace view-copies of parameters / tensor constants by new lifted constants.

    A ``*_copy`` view op (permute, view, transpose, squeeze, unsqueeze, select,
    slice, ...) whose tensor inputs are all parameters or tensor constants is
    evaluated now; its result (contiguous) becomes a ``CONSTANT_TENSOR`` input
    named ``_folded_<node>``.  Ops that would grow the data (``expand_copy``)
    and nodes the graph returns are left alone, and so is a view of a weight
    something else reads too (a tied weight: an embedding and its LM head):
    folding it would store the weight twice, growing the file by what the
    arena saves at most, so file + arena would not shrink.  The same view of the same
    weight (e.g. an LSTM's transposed weight at every time step) is folded
    once.  Returns the count of nodes removed; a parameter nothing else reads
    is then removed by :func:`remove_unused_constants`.

    Before::

        %p_fc2_weight = placeholder                          # PARAMETER fc2.weight
        %permute_1 = aten.permute_copy.default(%p_fc2_weight, [1, 0])
        %addmm_1 = aten.addmm.default(%p_fc2_bias, %relu, %permute_1)

    After::

        %c__folded_permute_1 = placeholder                   # CONSTANT_TENSOR _folded_permute_1
        %addmm_1 = aten.addmm.default(%p_fc2_bias, %relu, %c__folded_permute_1)
    """
    from torch._guards import detect_fake_mode

    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, specs))
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    names = {n.name for n in graph.nodes}
    targets = {s.target for s in specs} | set(program.state_dict) | set(program.constants)
    folded: dict[tuple, torch.fx.Node] = {}  # the same view of the same weight once
    count = 0
    for node in list(graph.nodes):
        if not _foldable(node, spec_of):
            continue
        key = (node.target, repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: spec_of[a].target)))
        if key in folded:
            node.replace_all_uses_with(folded[key])
            graph.erase_node(node)
            count += 1
            continue
        real = _constant_value(program, node, spec_of)
        target = _fresh(f"_folded_{node.name}", targets)
        placeholder_name = _fresh(f"c{target}", names)
        anchor = _first_user_input(graph, spec_of)
        with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(
            [n for n in graph.nodes if n.op == "placeholder"][-1]
        ):
            new = graph.placeholder(placeholder_name)
        new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        new.meta["val"] = fake_mode.from_tensor(real, static_shapes=True) if fake_mode else real
        spec = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(new.name), target)
        ordered = [n for n in graph.nodes if n.op == "placeholder"]
        specs.insert(ordered.index(new), spec)
        spec_of[new] = spec
        program.constants[target] = real
        folded[key] = new
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


def _foldable(node: torch.fx.Node, spec_of: Mapping[torch.fx.Node, InputSpec]) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.view_copy not in node.target.tags or node.target is torch.ops.aten.expand_copy.default:
        return False
    inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    if not inputs or any(a.op != "placeholder" or spec_of[a].kind not in _CONSTANT_KINDS for a in inputs):
        return False
    if any(user.op == "output" for user in node.users):
        return False
    if any(not _same_view(user, node) for a in inputs for user in a.users):
        return False  # the weight stays (it has other readers): folding would store it twice
    out, ins = node.meta.get("val"), [a.meta.get("val") for a in inputs]
    if not isinstance(out, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in ins):
        return False
    return out.numel() <= sum(v.numel() for v in ins)


def _same_view(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a`` computes the same view as ``b`` (then both fold into one constant)."""
    return a is b or (a.target is b.target and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs)


def _constant_value(program: ExportedProgram, node: torch.fx.Node, spec_of) -> torch.Tensor:
    """Run ``node`` on the real parameter / constant tensors; a dense copy."""

    def real(arg: torch.fx.Node) -> torch.Tensor:
        target = spec_of[arg].target
        table = program.constants if target in program.constants else program.state_dict
        return table[target].detach()

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), real)
    with torch.no_grad():
        return node.target(*args, **kwargs).contiguous().clone()


def _first_user_input(graph: torch.fx.Graph, spec_of) -> torch.fx.Node | None:
    for n in graph.nodes:
        if n.op == "placeholder" and spec_of[n].kind == InputKind.USER_INPUT:
            return n
    return None


def _fresh(name: str, taken: set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
