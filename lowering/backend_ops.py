"""Backend fused ops: a backend's own operators, and the pass that puts them in a graph.

A backend declares a :class:`FusedOp`: a ``torch.library`` operator (say
``lowerflow_reference::addmm_relu``) and the pattern of core-ATen ops it
replaces, given as an eager function traced to the edge form the way models
are (:func:`lowering.export.export`).  A partitioner lists its fused ops in its
``fused_ops`` attribute; stage 2 (:func:`lowering.partition.partition`) runs
:func:`apply_fused_ops` on its private copy of the program before the
partitioner tags it, so the partitioner sees (and delegates) the fused op::

    before:  %addmm = aten.addmm.default(%p_b, %x, %c_w)
             %relu  = aten.relu.default(%addmm)
    after:   %addmm_relu = lowerflow_reference.addmm_relu.default(%p_b, %x, %c_w)

Matching and rewriting are torch.fx's ``subgraph_rewriter.replace_pattern_with_filters``.
A match is replaced only if its intermediate values have no other readers.

What an op needs (checked when the :class:`FusedOp` is made, :class:`FusedOpError` otherwise):

* a kernel torch.export can trace: ``Meta``, ``CompositeExplicitAutograd`` (which
  serves Meta too), ``CompositeImplicitAutograd`` or a ``torch.library.register_fake``
  implementation.  Without one, the rewritten graph could not be traced, re-exported
  or given shapes;
* a kernel that runs on CPU (``CPU`` or a composite kernel): lowerflow's executor runs
  a fused op the backend did not take through it.

A fused op left in the top-level program (the backend did not take it) is
emitted as a KernelCall of its ``.out`` overload, by qualified name, e.g.
``lowerflow_reference::addmm_relu.out``: :func:`define_fused_op` defines both
overloads.  lowerflow's executor runs it through the op's composite kernel;
ExecuTorch's stock runtime has no kernel for it and refuses to load the
method (``verify`` skips that runtime, naming the missing operators).  Emit lets
it through under the default runtime profile, whose ``"fused"`` entry allows the
ops declared here (:func:`is_fused_op`); a profile without it
(``lower(..., runtime_ops=("portable",))``) fails naming the op
(:mod:`lowering.stock_ops`).

A ``CompositeImplicitAutograd`` op decomposes back into its pattern when the
program is re-exported or decomposed again; prefer ``CompositeExplicitAutograd``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.export import ExportedProgram

from .errors import FusedOpError

#: node.meta key set on every node a fused op put in the graph: the op's qualified name.
FUSED_META = "lowerflow_fused_op"

#: Dispatch keys whose kernel lets torch.export trace (and give shapes to) a call.
TRACEABLE_KEYS = ("Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
#: Dispatch keys whose kernel lets lowerflow's executor run a call on CPU tensors.
RUNNABLE_KEYS = ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")

#: torch.library fragments made by :func:`define_fused_op` (kept alive: a dropped
#: Library object unregisters its definitions).
_LIBRARIES: list[torch.library.Library] = []
#: ``"ns::name"`` of every op declared as a fused op in this process (FusedOp, define_fused_op).
_DECLARED: set[str] = set()


# --------------------------------------------------------------------------- declaring


def qualified_name(op: torch._ops.OpOverload) -> str:
    """``lowerflow_reference::addmm_relu`` (``.overload`` appended unless ``default``)."""
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def is_fused_op(operator: str) -> bool:
    """Whether ``operator`` (``"ns::name"`` or ``"ns::name.overload"``, e.g. the emitted
    ``lowerflow_reference::addmm_relu.out``) is an overload of a declared fused op."""
    name = operator.partition(".")[0]
    return name in _DECLARED


def missing_kernels(op: torch._ops.OpOverload) -> list[str]:
    """What ``op`` lacks to be a fused op: ``[]``, or phrases naming the missing kernels."""
    missing = []
    if not any(op.has_kernel_for_dispatch_key(key) for key in TRACEABLE_KEYS) and not _has_fake_impl(op):
        missing.append(
            "kernel torch.export can trace (Meta, CompositeExplicitAutograd, CompositeImplicitAutograd "
            "or a torch.library.register_fake implementation)"
        )
    if not any(op.has_kernel_for_dispatch_key(key) for key in RUNNABLE_KEYS):
        missing.append("kernel that runs on CPU (CPU, CompositeExplicitAutograd or CompositeImplicitAutograd)")
    return missing


def _has_fake_impl(op: torch._ops.OpOverload) -> bool:
    from torch._library.simple_registry import singleton

    return singleton.find(op._name).fake_impl.kernel is not None


def check_fused_op_kernels(op: Any) -> torch._ops.OpOverload:
    """``op`` itself if it can be a fused op; a :class:`FusedOpError` naming it and what it lacks."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        raise FusedOpError(
            f"fused op {op._qualified_op_name}: give an overload (e.g. {op._qualified_op_name}.default), "
            "not the overload packet"
        )
    if not isinstance(op, torch._ops.OpOverload):
        raise FusedOpError(f"fused op {op!r}: expected a torch.library operator overload, got {type(op).__name__}")
    name = qualified_name(op)
    if op._schema.is_mutable:
        raise FusedOpError(f"fused op {name}: mutates an argument; a fused op must be functional")
    if not op._schema.returns:
        raise FusedOpError(f"fused op {name}: returns nothing; a fused op must return the pattern's result")
    missing = missing_kernels(op)
    if missing:
        raise FusedOpError(f"fused op {name} has no {' and no '.join(missing)}")
    return op


@dataclasses.dataclass(frozen=True, eq=False)
class FusedOp:
    """A backend operator and the pattern of edge-form ops it replaces.

    ``pattern(*example_inputs)`` is an eager function; it is exported and
    brought to the edge form (as models are) to give the pattern graph.  Its
    inputs become the wildcards of the match, in order.  ``replacement`` takes
    the same inputs and calls ``op``; by default ``op(*inputs)``.
    ``match_filters`` are extra conditions on a match
    (``filter(match, original_graph, pattern_graph) -> bool``, as torch.fx's
    ``replace_pattern_with_filters`` takes them).
    """

    op: torch._ops.OpOverload
    pattern: Callable[..., Any]
    example_inputs: tuple
    replacement: Callable[..., Any] | None = None
    match_filters: tuple[Callable[..., bool], ...] = ()

    def __post_init__(self) -> None:
        check_fused_op_kernels(self.op)
        _DECLARED.add(self.op._schema.name)
        if isinstance(self.example_inputs, torch.Tensor) or not isinstance(self.example_inputs, (tuple, list)):
            raise FusedOpError(f"fused op {self.name}: example_inputs must be a tuple of the pattern's inputs")
        object.__setattr__(self, "example_inputs", tuple(self.example_inputs))
        object.__setattr__(self, "match_filters", tuple(self.match_filters))

    @property
    def name(self) -> str:
        return qualified_name(self.op)

    @functools.cached_property
    def pattern_graph(self) -> torch.fx.GraphModule:
        """The pattern in edge form (traced once per process)."""
        return trace_pattern(self.pattern, self.example_inputs, name=self.name)

    @functools.cached_property
    def replacement_graph(self) -> torch.fx.GraphModule:
        """A graph of ``replacement`` (or of ``op(*inputs)``) with the pattern's inputs."""
        count = sum(1 for n in self.pattern_graph.graph.nodes if n.op == "placeholder")
        graph = torch.fx.Graph()
        inputs = [graph.placeholder(f"arg{i}") for i in range(count)]
        if self.replacement is None:
            short = self.op._schema.name.partition("::")[2]
            graph.output(graph.create_node("call_function", self.op, tuple(inputs), name=short))
        else:
            try:
                traced = torch.fx.symbolic_trace(self.replacement)
            except Exception as exc:
                raise FusedOpError(f"fused op {self.name}: replacement cannot be traced: {exc}") from exc
            if sum(1 for n in traced.graph.nodes if n.op == "placeholder") != count:
                raise FusedOpError(f"fused op {self.name}: replacement takes other inputs than the pattern's {count}")
            graph = traced.graph
        if not any(n.target is self.op for n in graph.nodes):
            raise FusedOpError(f"fused op {self.name}: replacement does not call {self.name}")
        produced = len(_outputs(graph))
        expected = len(_outputs(self.pattern_graph.graph))
        if produced != expected:
            raise FusedOpError(
                f"fused op {self.name}: the pattern returns {expected} values, the replacement {produced}"
            )
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    def digest(self) -> str:
        """sha256 of what decides the rewrite, without tracing anything: the op's schema,
        the code of the pattern, replacement and match filters (and of the functions
        they call), and the example inputs' shapes and dtypes.

        Tracing the pattern would cost a first ``torch.export`` (seconds in a fresh
        process) to every flow run, cached or not; the code is what the trace is a
        function of (with torch's version, which every cache key holds).
        """
        inputs = [
            (str(v.dtype), tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in self.example_inputs
        ]
        parts = [
            str(self.op._schema),
            code_digest(self.pattern),
            code_digest(self.replacement) if self.replacement is not None else "op(*inputs)",
            *(code_digest(f) for f in self.match_filters),
            repr(inputs),
        ]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def code_digest(fn: Any) -> str:
    """sha256 of a Python function's code: bytecode, constants and names, of nested code
    objects, and of the module-level functions it calls (recursively).  Equal source
    gives equal digests in any process of one Python version; a comment does not count."""
    digest = hashlib.sha256()
    seen: set[int] = set()

    def visit_function(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        code = getattr(obj, "__code__", None)
        if code is None:  # a builtin, an OpOverload, a class: its name
            digest.update(f"<{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}>".encode())
            return
        visit_code(code, getattr(obj, "__globals__", {}))
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            visit_value(contents, getattr(obj, "__globals__", {}))

    def visit_code(code: Any, globals_: dict) -> None:
        digest.update(code.co_code)
        digest.update(repr(code.co_names).encode())
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                visit_code(const, globals_)
            elif isinstance(const, frozenset):  # its repr's order follows the string hash seed
                digest.update(repr(sorted(map(repr, const))).encode())
            else:
                digest.update(repr(const).encode())
        for name in code.co_names:
            value = globals_.get(name)
            if callable(value) and hasattr(value, "__code__"):
                visit_function(value)

    def visit_value(value: Any, globals_: dict) -> None:
        if callable(value):
            visit_function(value)
        elif isinstance(value, torch.Tensor):
            digest.update(f"tensor{tuple(value.shape)}{value.dtype}".encode())
        else:
            digest.update(repr(value).encode())

    visit_function(fn)
    return digest.hexdigest()


def _outputs(graph: torch.fx.Graph) -> list:
    """The values a graph returns, flattened (``return (a,)`` and ``return a`` both give ``[a]``)."""
    return torch.utils._pytree.tree_leaves(graph.output_node().args[0])


class _Pattern(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def trace_pattern(fn: Callable[..., Any], example_inputs: Sequence[Any], *, name: str) -> torch.fx.GraphModule:
    """The edge-form graph of ``fn(*example_inputs)``: placeholders, the ops, an output.

    Traced with :func:`lowering.export.export` without constant folding, so the
    pattern has the ops a model's program has (a ``linear`` is
    ``permute_copy`` + ``addmm``; a model's transposed weight is a constant).
    """
    from .export import export
    from .errors import ExportError

    try:
        program = export(_Pattern(fn), tuple(example_inputs), name=f"pattern of {name}", fold_constants=False)
    except ExportError as exc:
        raise FusedOpError(f"fused op {name}: its pattern cannot be traced: {exc}") from exc
    if any(s.kind.name != "USER_INPUT" for s in program.graph_signature.input_specs):
        raise FusedOpError(f"fused op {name}: the pattern must take every tensor as an input (no weights)")
    gm = program.graph_module
    graph = gm.graph
    for node in graph.nodes:
        node.meta = {}  # the example's shapes and source lines are no part of the pattern
    calls = [n for n in graph.nodes if n.op == "call_function"]
    if not calls:
        raise FusedOpError(f"fused op {name}: the pattern computes nothing")
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def define_fused_op(qualified: str, schema: str, kernel: Callable[..., torch.Tensor]) -> torch._ops.OpOverload:
    """Define ``qualified`` (``"ns::name"``) with ``schema`` and a CompositeExplicitAutograd ``kernel``,
    plus its ``.out`` overload (for the portable path); returns the functional overload.

    ``schema`` is the argument list and one Tensor return, e.g.
    ``"(Tensor self, Tensor mat1, Tensor mat2) -> Tensor"``.  The out overload is
    ``name.out(<arguments>, *, Tensor(a!) out) -> Tensor(a!)``; its kernel runs
    ``kernel`` and copies the result into ``out``.
    """
    namespace, _, name = qualified.partition("::")
    if not namespace or not name:
        raise FusedOpError(f"fused op {qualified!r}: expected 'namespace::name'")
    arguments, arrow, returns = schema.rpartition("->")
    arguments = arguments.strip()
    if not arrow or returns.strip() != "Tensor" or not (arguments.startswith("(") and arguments.endswith(")")):
        raise FusedOpError(f"fused op {qualified}: schema {schema!r} must be '(<arguments>) -> Tensor'")
    inner = arguments[1:-1].strip()
    keyword_only = any(part.strip() == "*" for part in inner.split(","))
    out_arguments = f"{inner}, {'' if keyword_only else '*, '}Tensor(a!) out"
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(f"{name}{arguments} -> Tensor")
    library.define(f"{name}.out({out_arguments}) -> Tensor(a!)")
    library.impl(name, kernel, "CompositeExplicitAutograd")

    def out_kernel(*args, out, **kwargs):
        result = kernel(*args, **kwargs)
        if out.shape != result.shape:  # as ATen's out kernels do (a dynamic out arrives emptied)
            out.resize_(result.shape)
        out.copy_(result)
        return out

    library.impl(f"{name}.out", out_kernel, "CompositeExplicitAutograd")
    # Shapes for torch.export, in Python: the C++ path to a CompositeExplicitAutograd kernel
    # takes concrete sizes only, so a dynamic-shape program could not trace the op.
    torch.library.register_fake(qualified, kernel, lib=library)
    torch.library.register_fake(f"{qualified}.out", out_kernel, lib=library)
    _LIBRARIES.append(library)
    _DECLARED.add(qualified)
    return getattr(getattr(torch.ops, namespace), name).default


# --------------------------------------------------------------------------- the pass


def fused_ops_of(partitioner: Any) -> tuple[FusedOp, ...]:
    """A partitioner's ``fused_ops`` (none if it declares none), checked."""
    fused = tuple(getattr(partitioner, "fused_ops", None) or ())
    for item in fused:
        if not isinstance(item, FusedOp):
            raise FusedOpError(
                f"partitioner {type(partitioner).__name__}: fused_ops must hold lowering.backend_ops.FusedOp, "
                f"got {type(item).__name__}"
            )
    return fused


def fused_ops_digest(fused_ops: Iterable[FusedOp]) -> str:
    """One sha256 over the declarations, in order ("" when there are none): a cache-key input."""
    digests = [f"{f.name}:{f.digest()}" for f in fused_ops]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest() if digests else ""


def apply_fused_ops(program: ExportedProgram, fused_ops: Iterable[FusedOp]) -> ExportedProgram:
    """Replace every match of each fused op's pattern (in order) by a call to it.

    Rewrites ``program``'s graph in place and returns the program to use: the
    same object when nothing matched, else one whose signature names the new
    output nodes.  New nodes get ``meta["val"]`` from the op's fake/meta kernel
    and ``meta[FUSED_META]``.
    """
    from torch.fx.subgraph_rewriter import replace_pattern_with_filters

    from .program import rebuild_program

    gm = program.graph_module
    replaced = 0
    for fused in fused_ops:
        try:
            # Graphs, not GraphModules: given a GraphModule replacement, torch.fx deletes
            # every submodule the top graph does not name, e.g. a cond branch's own branches.
            matches = replace_pattern_with_filters(
                gm, fused.pattern_graph.graph, fused.replacement_graph.graph,
                match_filters=list(fused.match_filters),
            )
        except FusedOpError:
            raise
        except Exception as exc:
            raise FusedOpError(f"fused op {fused.name}: rewriting the program failed: {exc}") from exc
        for match in matches:
            _fill_meta(gm.graph, match.replacements, fused)
        replaced += len(matches)
    if not replaced:
        return program
    gm.graph.lint()
    gm.recompile()
    return rebuild_program(program)


def _fill_meta(graph: torch.fx.Graph, nodes: list[torch.fx.Node], fused: FusedOp) -> None:
    """``meta["val"]`` of the replacement's nodes, from their inputs' values (in graph order)."""
    from torch._guards import detect_fake_mode

    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__):
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        fake_mode = detect_fake_mode(torch.utils._pytree.tree_leaves((args, kwargs)))
        try:
            with fake_mode if fake_mode is not None else _nullcontext():
                value = node.target(*args, **kwargs)
        except Exception as exc:
            raise FusedOpError(
                f"fused op {fused.name}: computing the shape of {node.name!r} failed: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from exc
        node.meta = {"val": value, FUSED_META: fused.name}


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# --------------------------------------------------------------------------- loading


@functools.cache
def load_backend_op_libraries() -> tuple[str, ...]:
    """Import every registered backend (``lowerflow.backends`` entry points) once, so the
    fused ops they define exist in this process; returns the names that loaded.

    Needed wherever a program may name a backend's op before anything imported
    the backend: reading a stored program, executing a ``.pte``.
    """
    from importlib import metadata

    from .delegation import ENTRY_POINT_GROUP

    loaded = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception:  # a broken third-party backend must not break loading others
            continue
        loaded.append(entry.name)
    return tuple(sorted(loaded))


__all__ = [
    "FUSED_META",
    "FusedOp",
    "FusedOpError",
    "apply_fused_ops",
    "check_fused_op_kernels",
    "code_digest",
    "define_fused_op",
    "fused_ops_digest",
    "fused_ops_of",
    "is_fused_op",
    "load_backend_op_libraries",
    "missing_kernels",
    "qualified_name",
    "trace_pattern",
]
