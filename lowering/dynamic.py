"""Dynamic shapes: symbolic dims, their upper bounds, and the JSON form of a spec.

A program exported with ``torch.export.Dim`` ranges has symbolic sizes
(``s0``, ``4*s0``) in its node values and the ranges of its symbols in
``ExportedProgram.range_constraints``::

    x: FakeTensor(size=(s0, 8))            range_constraints = {s0: VR[1, 16]}
    view_copy: FakeTensor(size=(4*s0,))    upper bound 64

ExecuTorch runs such a program with tensors whose shape is
``DYNAMIC_BOUND``: memory is reserved for the largest shape (every symbol at
its max) and the kernels resize their outputs within it.  This module gives
the stages what they need for that:

* :func:`upper_bound` / :func:`upper_bound_shape` — the largest value of a
  size expression over the symbols' ranges;
* :func:`check_bounded` — every symbol of a program has a finite max, or an
  error naming the input and dim that needs one;
* :func:`dynamic_dims` — the user inputs' symbolic dims with their ranges
  (what verify runs the program at);
* :func:`dynamic_shapes_to_json` / :func:`dynamic_shapes_from_json` — the
  JSON form of torch.export's ``dynamic_shapes`` argument, used by model
  specs, the manifest and the CLI, and covered by the cache keys.

The JSON form is keyed by forward argument name (a list by position works
too), then by dim index, each dim ``{"name": str, "min": int, "max": int}``::

    {"x": {"1": {"name": "seq", "min": 1, "max": 128}}, "input_pos": {"0": {"name": "seq", ...}}}

Dims with the same name are the same symbol (equal sizes at run time).
"""

from __future__ import annotations

import builtins
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from .errors import DynamicShapeError


#: Symbolic scalar ops -> the (operator name, overload) ExecuTorch's runtime
#: registers for them (``aten::sym_size.int`` and the ``executorch_prim``
#: ops of ``exir/passes/executorch_prim_ops_registry.py``).  Such a node is
#: a KernelCall whose args are its operands followed by its result value.
SYM_OPS: dict[Any, tuple[str, str]] = {
    torch.ops.aten.sym_size.int: ("aten::sym_size", "int"),
    torch.ops.aten.sym_numel.default: ("aten::sym_numel", ""),
    # a tensor's one element as a scalar (``t[0].item()``, e.g. a decoder's start position)
    torch.ops.aten._local_scalar_dense.default: ("aten::_local_scalar_dense", ""),
    operator.add: ("executorch_prim::add", "Scalar"),
    operator.sub: ("executorch_prim::sub", "Scalar"),
    operator.mul: ("executorch_prim::mul", "Scalar"),
    operator.floordiv: ("executorch_prim::floordiv", "Scalar"),
    operator.truediv: ("executorch_prim::truediv", "Scalar"),
    operator.mod: ("executorch_prim::mod", "Scalar"),
    operator.neg: ("executorch_prim::neg", "Scalar"),
    operator.eq: ("executorch_prim::eq", "Scalar"),
    operator.gt: ("executorch_prim::gt", "Scalar"),
    operator.lt: ("executorch_prim::lt", "Scalar"),
    operator.ge: ("executorch_prim::ge", "Scalar"),
    operator.le: ("executorch_prim::le", "Scalar"),
    builtins.round: ("executorch_prim::round", "Scalar"),
    math.ceil: ("executorch_prim::ceil", "Scalar"),
    math.trunc: ("executorch_prim::trunc", "Scalar"),
    torch.sym_float: ("executorch_prim::sym_float", "Scalar"),
    torch.sym_int: ("executorch_prim::sym_int", "Scalar"),
    torch.sym_max: ("executorch_prim::sym_max", "Scalar"),
    torch.sym_min: ("executorch_prim::sym_min", "Scalar"),
    torch.sym_not: ("executorch_prim::sym_not", "Scalar"),
    torch.sym_ite: ("executorch_prim::sym_ite", "Scalar"),
}


def is_sym_op(target: Any) -> bool:
    """Whether ``target`` computes a symbolic scalar (see :data:`SYM_OPS`)."""
    try:
        return target in SYM_OPS
    except TypeError:  # unhashable target
        return False


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a SymInt/SymFloat/SymBool that is not a known constant."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return not isinstance(value.node.expr, (sympy.Integer, sympy.Float)) and value.node.maybe_as_int() is None
    return False


def is_dynamic(val: Any) -> bool:
    """Whether a node value (a tensor or a tuple of them) has a symbolic size."""
    vals = val if isinstance(val, (tuple, list)) else [val]
    return any(isinstance(v, torch.Tensor) and any(is_symbolic(d) for d in v.shape) for v in vals)


def upper_bound(size: Any, ranges: Mapping[sympy.Symbol, ValueRanges] | None = None, *, what: str = "size") -> int:
    """The largest value of ``size`` (an int or a SymInt) over its symbols' ranges.

    ``ranges`` default to the symbols' ShapeEnv; pass an ExportedProgram's
    ``range_constraints`` to bound a program that was deserialized.
    """
    if isinstance(size, int):
        return size
    if not isinstance(size, torch.SymInt):
        raise DynamicShapeError(f"{what}: {size!r} is not an int")
    expr = size.node.expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    bound = _bound(expr, ranges, size)
    if bound is None or bound.upper in (int_oo, sympy.oo) or not bound.upper.is_finite:
        raise DynamicShapeError(
            f"{what} {expr} has no upper bound; give the torch.export.Dim of "
            f"{_symbol_sources(expr, size)} a max"
        )
    return int(bound.upper)


def _symbol_sources(expr: sympy.Expr, size: torch.SymInt) -> str:
    """``"s0 (x.size()[0])"``: the symbols of ``expr`` and the input sizes they stand for."""
    sources = getattr(getattr(size.node, "shape_env", None), "var_to_sources", {}) or {}
    names = []
    for symbol in sorted(expr.free_symbols, key=str):
        found = [source.name() if callable(source.name) else source.name
                 for source in sources.get(symbol, [])[:1]]
        names.append(f"{symbol} ({found[0]})" if found else str(symbol))
    return ", ".join(names)


def _bound(expr: sympy.Expr, ranges, size: torch.SymInt) -> ValueRanges | None:
    if ranges:
        known = {s: r for s, r in ranges.items() if s in expr.free_symbols}
        if len(known) == len(expr.free_symbols):
            return bound_sympy(expr, known)
    shape_env = getattr(size.node, "shape_env", None)
    return shape_env.bound_sympy(expr) if shape_env is not None else None


def upper_bound_shape(val: torch.Tensor, ranges=None, *, what: str = "value") -> list[int]:
    """``val``'s shape with every symbolic size at its upper bound."""
    return [upper_bound(d, ranges, what=f"{what} dim {i}") for i, d in enumerate(val.shape)]


@dataclass(frozen=True)
class DynamicDim:
    """One symbolic dim of a user input: ``inputs[input_index].shape[dim]`` is ``symbol``."""

    input_name: str
    input_index: int
    dim: int
    symbol: str
    min: int
    max: int


def dynamic_dims(ep: ExportedProgram) -> list[DynamicDim]:
    """The user inputs' dims that are a plain symbol, with the symbol's range.

    Raises :class:`DynamicShapeError` naming the input and dim whose range has no max.
    """
    dims = []
    ranges = ep.range_constraints
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for index, spec in enumerate(user):
        node = nodes.get(getattr(spec.arg, "name", None))
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if not is_symbolic(size):
                continue
            expr = size.node.expr
            what = f"input {spec.arg.name!r} dim {d} ({expr})"
            bound = ranges.get(expr) if isinstance(expr, sympy.Symbol) else None
            if bound is None:
                upper_bound(size, ranges, what=f"input {spec.arg.name!r} dim {d}")
                continue
            if bound.upper in (int_oo, sympy.oo) or not bound.upper.is_finite:
                raise DynamicShapeError(f"{what} has no upper bound; give its torch.export.Dim a max")
            dims.append(DynamicDim(spec.arg.name, index, d, str(expr), int(bound.lower), int(bound.upper)))
    return dims


def check_bounded(ep: ExportedProgram) -> None:
    """Every symbolic size in ``ep`` has a finite upper bound (inputs named first)."""
    dynamic_dims(ep)
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        for i, v in enumerate(val if isinstance(val, (tuple, list)) else [val]):
            if isinstance(v, torch.Tensor):
                upper_bound_shape(v, ep.range_constraints, what=f"node {node.name!r} output {i}")


# --------------------------------------------------------------------------- JSON form


def dynamic_shapes_to_json(dynamic_shapes: Any, *, what: str = "dynamic_shapes") -> Any:
    """torch.export's ``dynamic_shapes`` (Dim objects) -> the plain JSON form.

    Dicts stay dicts (keyed by argument name), tuples/lists become lists;
    a dim is ``{"name", "min", "max"}``.  Raises DynamicShapeError for a
    spec item that is not a Dim (``Dim.AUTO`` and derived dims are not
    supported: a spec must say each dim's range).
    """
    if dynamic_shapes is None:
        return None
    if isinstance(dynamic_shapes, Mapping):
        return {str(k): _per_input_to_json(v, f"{what}[{k!r}]") for k, v in dynamic_shapes.items()}
    if isinstance(dynamic_shapes, (tuple, list)):
        return [_per_input_to_json(v, f"{what}[{i}]") for i, v in enumerate(dynamic_shapes)]
    raise DynamicShapeError(f"{what}: expected a dict by argument name or a list by position, "
                            f"got {type(dynamic_shapes).__name__}")


def _per_input_to_json(spec: Any, what: str) -> Any:
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return {str(int(d)): _dim_to_json(dim, f"{what}[{d}]") for d, dim in sorted(spec.items())}
    if isinstance(spec, (tuple, list)):
        return {str(d): _dim_to_json(dim, f"{what}[{d}]") for d, dim in enumerate(spec) if dim is not None}
    raise DynamicShapeError(f"{what}: expected a dict of dim index -> Dim, got {type(spec).__name__}")


def _dim_to_json(dim: Any, what: str) -> dict[str, Any]:
    name = getattr(dim, "__name__", None)
    if name is None or not hasattr(dim, "min") or not hasattr(dim, "max") or hasattr(dim, "fn"):
        raise DynamicShapeError(f"{what}: expected a torch.export.Dim('name', min=..., max=...), got {dim!r}")
    upper = dim.max
    if upper is None or upper == int_oo or upper >= 2**62:
        raise DynamicShapeError(f"{what}: Dim {name!r} has no max; give it one (e.g. Dim({name!r}, max=128))")
    return {"name": str(name), "min": int(dim.min), "max": int(upper)}


def dynamic_shapes_from_json(doc: Any, *, what: str = "dynamic_shapes") -> Any:
    """The JSON form -> torch.export's ``dynamic_shapes`` argument (validated).

    Equal names give the same Dim; the same name with different ranges is an error.
    """
    if doc is None:
        return None
    dims: dict[str, Any] = {}
    if isinstance(doc, Mapping):
        return {str(k): _per_input_from_json(v, f"{what}[{k!r}]", dims) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return tuple(_per_input_from_json(v, f"{what}[{i}]", dims) for i, v in enumerate(doc))
    raise DynamicShapeError(f"{what}: expected a mapping by argument name or a list by position, "
                            f"got {type(doc).__name__}")


def _per_input_from_json(spec: Any, what: str, dims: dict[str, Any]) -> Any:
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise DynamicShapeError(f"{what}: expected a mapping of dim index -> {{name, min, max}}, "
                                f"got {type(spec).__name__}")
    out = {}
    for key, dim in spec.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise DynamicShapeError(f"{what}: dim index {key!r} is not an integer") from None
        if index < 0:
            raise DynamicShapeError(f"{what}: dim index {index} is negative")
        out[index] = _dim_from_json(dim, f"{what}[{index}]", dims)
    return out


def _dim_from_json(doc: Any, what: str, dims: dict[str, Any]):
    if not isinstance(doc, Mapping) or set(doc) - {"name", "min", "max"} or "max" not in doc:
        raise DynamicShapeError(f"{what}: expected {{name, min, max}} (max required), got {doc!r}")
    name = doc.get("name")
    lo, hi = doc.get("min", 1), doc["max"]
    if not isinstance(name, str) or not name.isidentifier():
        raise DynamicShapeError(f"{what}: name {name!r} is not an identifier")
    for label, v in (("min", lo), ("max", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise DynamicShapeError(f"{what}: {label} {v!r} is not a non-negative integer")
    if lo > hi:
        raise DynamicShapeError(f"{what}: min {lo} > max {hi}")
    if name in dims:
        known = dims[name]
        if (known.min, known.max) != (lo, hi):
            raise DynamicShapeError(f"{what}: Dim {name!r} is given twice with different ranges "
                                    f"([{known.min}, {known.max}] and [{lo}, {hi}])")
        return known
    dims[name] = torch.export.Dim(name, min=lo, max=hi)
    return dims[name]


def check_against_inputs(
    dynamic_shapes: Any, model: torch.nn.Module, example_inputs: Sequence[Any], *, what: str = "dynamic_shapes"
) -> None:
    """The spec names forward arguments and dims the example inputs have, and
    each example size lies in its dim's range."""
    if dynamic_shapes is None:
        return
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = []
    if isinstance(dynamic_shapes, Mapping):
        items = []
        for key, spec in dynamic_shapes.items():
            if key not in params[: len(example_inputs)]:
                raise DynamicShapeError(f"{what}: {key!r} is not an argument of forward "
                                        f"(arguments: {', '.join(params[: len(example_inputs)])})")
            items.append((key, example_inputs[params.index(key)], spec))
    else:
        if len(dynamic_shapes) != len(example_inputs):
            raise DynamicShapeError(f"{what}: {len(dynamic_shapes)} entries for {len(example_inputs)} inputs")
        items = [(params[i] if i < len(params) else str(i), x, s)
                 for i, (x, s) in enumerate(zip(example_inputs, dynamic_shapes))]
    for name, x, spec in items:
        if spec is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise DynamicShapeError(f"{what}: input {name!r} is not a tensor")
        for d, dim in (spec.items() if isinstance(spec, Mapping) else enumerate(spec)):
            if dim is None:
                continue
            if not -x.dim() <= d < x.dim():
                raise DynamicShapeError(f"{what}: input {name!r} has {x.dim()} dims, no dim {d}")
            size = x.shape[d]
            if not dim.min <= size <= dim.max:
                raise DynamicShapeError(f"{what}: input {name!r} dim {d} is {size} in the example inputs, "
                                        f"outside Dim {dim.__name__!r}'s range [{dim.min}, {dim.max}]")


# --------------------------------------------------------------------------- graph pass


def sym_scalars_to_tensors(graph: torch.fx.Graph) -> int:
    """Wrap a symbolic scalar passed as a Tensor argument in ``aten.scalar_tensor``.

    torch's dispatcher turns a SymInt into a tensor implicitly; the runtime's
    kernels take the schema's types (ExecuTorch's ``SymToTensorPass``).

    Before::

        %add = operator.add(%sym_size_int, 1)
        %mul = aten.mul.Tensor(%sum, %add)

    After::

        %add = operator.add(%sym_size_int, 1)
        %scalar_tensor = aten.scalar_tensor.default(%add, dtype=torch.int32)
        %mul = aten.mul.Tensor(%sum, %scalar_tensor)

    Returns the number of arguments wrapped.
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        arguments = node.target._schema.arguments
        args = list(node.args)
        kwargs = dict(node.kwargs)
        changed = False
        for i, argument in enumerate(arguments):
            if not isinstance(argument.type, torch.TensorType):
                continue
            if i < len(args) and not argument.kwarg_only:
                value, put = args[i], lambda v, i=i: args.__setitem__(i, v)
            elif argument.name in kwargs:
                value, put = kwargs[argument.name], lambda v, k=argument.name: kwargs.__setitem__(k, v)
            else:
                continue
            if isinstance(value, torch.fx.Node) and _scalar_dtype(value.meta.get("val")) is not None:
                put(_scalar_tensor(graph, node, value))
                changed = True
                count += 1
        if changed:
            node.args, node.kwargs = tuple(args), kwargs
    return count


def _scalar_dtype(val: Any) -> torch.dtype | None:
    """The tensor dtype ExecuTorch gives a symbolic scalar (None: not a scalar)."""
    if isinstance(val, torch.SymBool):
        return torch.bool
    if isinstance(val, torch.SymFloat):
        return torch.float32
    if isinstance(val, torch.SymInt):
        return torch.int32
    return None


def _scalar_tensor(graph: torch.fx.Graph, user: torch.fx.Node, value: torch.fx.Node) -> torch.fx.Node:
    dtype = _scalar_dtype(value.meta["val"])
    with graph.inserting_before(user):
        wrapped = graph.call_function(torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype})
    fake_mode = next(
        (n.meta["val"].fake_mode for n in graph.nodes
         if isinstance(n.meta.get("val"), torch.Tensor) and hasattr(n.meta["val"], "fake_mode")),
        None,
    )
    if fake_mode is not None:
        with fake_mode:
            wrapped.meta["val"] = torch.ops.aten.scalar_tensor.default(value.meta["val"], dtype=dtype)
    else:
        wrapped.meta["val"] = torch.empty((), dtype=dtype)
    return wrapped


# --------------------------------------------------------------------------- inputs at other sizes


def dims_by_position(
    dynamic_shapes: Any, model: torch.nn.Module, n_inputs: int
) -> list[dict[int, Any]]:
    """torch.export's ``dynamic_shapes`` as one ``{dim: Dim}`` per input position."""
    out: list[dict[int, Any]] = [{} for _ in range(n_inputs)]
    if dynamic_shapes is None:
        return out
    if isinstance(dynamic_shapes, Mapping):
        params = list(inspect.signature(model.forward).parameters)
        items = [(params.index(k), v) for k, v in dynamic_shapes.items() if k in params]
    else:
        items = list(enumerate(dynamic_shapes))
    for position, spec in items:
        if spec is None or position >= n_inputs:
            continue
        pairs = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
        out[position] = {int(d): dim for d, dim in pairs if dim is not None}
    return out


def inputs_at_sizes(
    model: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any
) -> list[tuple[str, tuple[Any, ...]]]:
    """``(label, inputs)`` to run a dynamic program at: every Dim at its min, then at its max
    (and the example inputs as they are).

    An input is brought to another size along a dynamic dim by repeating its
    example values along that dim (then cutting), so index-like inputs keep
    values the model accepts.  Static programs get just the example inputs.
    """
    per_input = dims_by_position(dynamic_shapes, model, len(example_inputs))
    dims = {dim.__name__: dim for spec in per_input for dim in spec.values()}
    sets = [("example", tuple(example_inputs))]
    if not dims:
        return sets
    for which in ("min", "max"):
        sizes = {name: max(int(getattr(dim, which)), 1) for name, dim in dims.items()}
        label = ",".join(f"{name}={size}" for name, size in sorted(sizes.items()))
        inputs = tuple(
            _resized(x, {d: sizes[dim.__name__] for d, dim in spec.items()}) if spec else x
            for x, spec in zip(example_inputs, per_input)
        )
        if all(_same_shapes(a, b) for a, b in zip(inputs, example_inputs)):
            continue
        sets.append((label, inputs))
    return sets


def _resized(x: torch.Tensor, sizes: Mapping[int, int]) -> torch.Tensor:
    for d, n in sizes.items():
        have = x.shape[d]
        if n > have:
            reps = [1] * x.dim()
            reps[d] = -(-n // have)
            x = x.repeat(*reps)
        x = x.narrow(d, 0, n)
    return x.contiguous()


def _same_shapes(a: Any, b: Any) -> bool:
    return not isinstance(a, torch.Tensor) or tuple(a.shape) == tuple(b.shape)


def complete_dynamic_shapes(model: torch.nn.Module, n_inputs: int, dynamic_shapes: Any) -> Any:
    """A by-name spec with every positional argument of forward present (None: static),
    as torch.export requires; anything else is returned unchanged."""
    if not isinstance(dynamic_shapes, Mapping):
        return dynamic_shapes
    try:
        params = list(inspect.signature(model.forward).parameters)[:n_inputs]
    except (TypeError, ValueError):
        return dynamic_shapes
    if set(dynamic_shapes) - set(params) or len(params) != n_inputs:
        return dynamic_shapes  # torch.export says what is wrong
    return {name: dynamic_shapes.get(name) for name in params}
