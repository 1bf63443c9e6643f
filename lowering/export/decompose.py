"""Stage 1's fast path, decomposition: each non-core op traced alone and spliced in.

An op that the default table (``torch.export.default_decompositions()``, what
``run_decompositions()`` uses) or its CompositeImplicitAutograd kernel
decomposes is traced alone with ``make_fx`` on FakeTensors built from its
inputs' ``meta["val"]``, and the small graph replaces the node.  Tracing one
op costs a few milliseconds; a retrace of the whole program >= 0.15 s.

So is an ATen op the stock runtime has no kernel for when torch has a decomposition
of it (:func:`lowering.stock_ops.stock_decomposition`, e.g. ``linalg_vector_norm``,
which ``_weight_norm``'s CompositeImplicitAutograd kernel calls); the slow path
(:func:`lowering.export.fallback.slow_core_aten`) does the same in a second retrace.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Mapping

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from ..quant_ops import QUANT_NAMESPACES
from ..stock_ops.table import stock_decomposition, stock_decompositions
from .cleanups import ASSERT_OPS, replace_view_ops_with_copies
from .fallback import Fallback
from .kept import KEPT


@functools.cache
def decomposition_tables() -> tuple[dict, dict]:
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

    overrides, _ = decomposition_tables()
    return frozenset(op for op, fn in overrides.items() if fn is _special_op_to_preserve_cia)


def decompose_to_core(graph: torch.fx.Graph, fake_mode: Any, table: Mapping,
                      kept: Callable[[torch.fx.Node], bool] | None = None) -> int:
    """Decompose, one node at a time, every op that is not core ATen; returns the count.

    A node is kept when its op is neither in ``table`` nor has a
    CompositeImplicitAutograd kernel (other than the preserved ones), and is
    core ATen or an assert.  Otherwise the op alone is traced by ``make_fx`` on
    FakeTensors of its inputs (under no_grad, as ``run_decompositions`` does),
    with ``table`` applied recursively, and the small graph replaces the node.
    Anything else raises ``Fallback``.  A node ``kept`` accepts (a partitioner's
    :class:`~lowering.export.kept.KeptOps`) stays whole, marked ``meta[KEPT]``.

    Before::

        %linear = aten.linear.default(%x, %p_w, %p_b)

    After::

        %permute = aten.permute.default(%p_w, [1, 0])
        %addmm = aten.addmm.default(%p_b, %x, %permute)
    """
    preserved = _preserved_ops()
    symbols: dict[Any, torch.fx.Node] = {}
    count = 0
    for node in list(graph.nodes):
        if node.op == "placeholder" or not isinstance(node.meta.get("val"), torch.SymInt):
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue  # getitem, auto_functionalized_v2 (functionalize_mutations')
        elif _symbolic_scalar(node):
            symbols.setdefault(node.meta["val"].node.expr, node)
            continue
        op = node.target
        if kept is not None and kept(node):
            node.meta[KEPT] = True
            continue
        if _needs_decomposition(op, table, preserved) or stock_decomposition(op) is not None:
            _splice(graph, node, _trace_for_stock_runtime(node, fake_mode, table), preserved, table, symbols)
            count += 1
        elif not _keeps(op):
            raise Fallback(f"op {op} at {node.name!r} is neither core ATen nor decomposable")
    return count


def _symbolic_scalar(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a SymInt the edge form keeps: a dynamic size
    (``sym_size.int``) or a tensor's value (``item``, made ``_local_scalar_dense``, its
    CompositeImplicitAutograd decomposition, in place: the same unbacked symbol).
    Decompositions that need the value read this node; anything else computing one
    raises ``Fallback``."""
    if node.op != "call_function":
        raise Fallback(f"symbolic value of {node.op} node {node.name!r}")
    if node.target is torch.ops.aten.item.default:
        node.target = torch.ops.aten._local_scalar_dense.default
    if node.target not in (torch.ops.aten.sym_size.int, torch.ops.aten._local_scalar_dense.default):
        raise Fallback(f"symbolic value computed by {node.target} at {node.name!r}")
    return True


def decompose_nodes(graph: torch.fx.Graph, nodes: list[torch.fx.Node], fake_mode: Any, table: Mapping) -> None:
    """Decompose each of ``nodes`` (whatever its op) as :func:`decompose_to_core` would."""
    preserved = _preserved_ops()
    symbols = {n.meta["val"].node.expr: n for n in graph.nodes
               if n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)}
    for node in nodes:
        _splice(graph, node, _trace_for_stock_runtime(node, fake_mode, table), preserved, table, symbols)


def decompose_kept(program: ExportedProgram, still_kept: Callable[[torch.fx.Node], bool]) -> int:
    """Decompose, in place, the kept nodes ``still_kept`` rejects (e.g. those no partition took).

    Each is traced alone on its inputs' FakeTensors, as stage 1's fast path does, and its view
    ops become copies; returns how many were decomposed.
    """
    from torch._guards import detect_fake_mode
    from torch.export._trace import _ignore_backend_decomps
    from torch.export.exported_program import _override_composite_implicit_decomp

    graph = program.graph_module.graph
    nodes = [n for n in graph.nodes if n.meta.get(KEPT) and n.op == "call_function"
             and n.target is not operator.getitem and not still_kept(n)]
    if not nodes:
        return 0
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    overrides, table = decomposition_tables()
    with _ignore_backend_decomps(), _override_composite_implicit_decomp(overrides):
        decompose_nodes(graph, nodes, fake_mode, table)
    replace_view_ops_with_copies(graph)
    graph.eliminate_dead_code()
    graph.lint()
    program.graph_module.recompile()
    return len(nodes)


def _needs_decomposition(op: torch._ops.OpOverload, table: Mapping, preserved: set) -> bool:
    from torch._export.utils import _is_cia_op

    return op in table or (_is_cia_op(op) and op not in preserved)


def _trace_for_stock_runtime(node: torch.fx.Node, fake_mode: Any, table: Mapping) -> torch.fx.GraphModule:
    """:func:`_trace_op`, again with the stock decompositions when the op or what it
    decomposes into lacks a stock kernel (``_weight_norm`` -> ``linalg_vector_norm``)."""
    if stock_decomposition(node.target) is None:
        traced = _trace_op(node, fake_mode, table)
        if not any(stock_decomposition(n.target) for n in traced.graph.nodes if n.op == "call_function"):
            return traced
    return _trace_op(node, fake_mode, {**stock_decompositions(), **table})


def _keeps(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` may stay in an edge graph (before view ops become copies)."""
    if op in ASSERT_OPS:
        return True
    if op._schema.is_mutable:
        return False
    if op.namespace in QUANT_NAMESPACES:  # a quantized program's q/dq ops: what the backends match
        return True
    if op.namespace not in ("aten", "prims"):  # a custom op (llama::custom_sdpa): as run_decompositions leaves it
        return True
    # ``*_copy`` views are the edge form already (a program re-exported from an edge graph,
    # as the quantize stage does).
    return torch.Tag.core in op.tags or torch.Tag.view_copy in op.tags or op in _preserved_ops()


def _trace_op(node: torch.fx.Node, fake_mode: Any, table: Mapping) -> torch.fx.GraphModule:
    """``make_fx`` of ``node.target`` alone on FakeTensors of its inputs' meta values."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Node)]
    fakes = [leaves[i].meta["val"] for i in positions]
    if not all(isinstance(f, (torch.Tensor, torch.SymInt)) for f in fakes):
        raise Fallback(f"non-tensor node input of {node.target} at {node.name!r}")

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
        fakes = [f.detach() if isinstance(f, torch.Tensor) and f.requires_grad else f for f in fakes]
        return make_fx(call, decomposition_table=table)(*fakes)


def _splice(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    traced: torch.fx.GraphModule,
    preserved: set,
    table: Mapping,
    symbols: Mapping[Any, torch.fx.Node],
) -> None:
    """Put ``traced``'s nodes in place of ``node``; its users read the traced outputs.

    New nodes inherit ``node``'s meta (module stack, stack trace, ...) with
    their own ``val``.  A tuple-returning ``node`` must only be read through
    ``getitem``; those getitems are replaced by the matching outputs.  A traced
    node computing a SymInt (a dynamic size: ``sym_size.int(%arg0_1, 1)``) is not copied:
    its users read the node of ``symbols`` (``{sympy expression: node}``) computing the same.
    """
    inputs = [leaf for leaf in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(leaf, torch.fx.Node)]
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", KEPT)}
    result = None
    with graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op == "placeholder":
                continue
            if sub.op == "output":
                result = torch.fx.node.map_arg(sub.args[0], lambda n: env[n])
                break
            if isinstance(sub.meta.get("val"), torch.SymInt):
                known = symbols.get(sub.meta["val"].node.expr)
                if known is None:
                    raise Fallback(f"decomposition of {node.target} computes {sub.meta['val']}")
                env[sub] = known
                continue
            if sub.op != "call_function" or not (
                sub.target is operator.getitem or isinstance(sub.target, torch._ops.OpOverload)
            ):
                raise Fallback(f"decomposition of {node.target} has a {sub.op} node ({sub.target})")
            if sub.target is not operator.getitem and (
                _needs_decomposition(sub.target, table, preserved) or not _keeps(sub.target)
            ):
                raise Fallback(f"decomposition of {node.target} emits {sub.target}")
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
        raise Fallback(f"decomposition of {node.target} at {node.name!r} returns {type(result).__name__}")
    for user in list(node.users):
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            raise Fallback(f"{node.name!r} returns several values and {user.name!r} reads them whole")
        value = result[user.args[1]]
        if not isinstance(value, torch.fx.Node):
            raise Fallback(f"output {user.args[1]} of {node.target} is not a tensor")
        user.replace_all_uses_with(value)
        user.graph.erase_node(user)
