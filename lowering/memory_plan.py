"""Stage 7 — memory planning.

Give every tensor the program computes at run time a place in one arena
(``mem_id`` 1), so that the runtime needs a single allocation per method and
no allocator on the hot path.  Constants (parameters, lifted tensor constants,
buffers that are never mutated) live in the ``.pte`` itself and get no
allocation.

The stage is a pure function of the exported program::

    plan = memory_plan(exported_program)          # the program is not changed
    plan.allocations["addmm"]  # TensorAllocation(mem_id=1, offset=0, size=64, lifetime=(5, 9))
    plan.out_variants["addmm"] # "aten::addmm.out"
    plan.arena_sizes           # (0, 270336)

How it works, one function each:

1. :func:`collect_values` lists the planned tensor values (user inputs,
   mutated buffers, every op output) with their sizes.  A value is keyed by
   its node's name, output ``i`` of a multi-output node by ``"<name>.<i>"``
   (:func:`value_key`: a ``getitem`` node names that value).
2. :func:`find_out_variants` maps every ATen call to the ``.out`` overload the
   portable kernels implement (the kernel writes into planned memory).
3. :func:`find_view_aliases` lets a ``view_copy`` share its base's memory, as
   ExecuTorch's ``ReplaceViewCopyWithViewPass`` does (a contiguous view of
   contiguous memory is the same bytes; views feeding the graph output keep
   a copy).  An aliased view needs no instruction: its tensor is described
   at the base's offset with the view's shape.
4. :func:`compute_lifetimes` gives each value the inclusive range of graph
   steps (node indices) from its definition to its last use;
   :func:`extend_base_lifetimes` stretches a base over its aliases' uses.
5. :func:`choose_placement` assigns offsets: three greedy orders placed
   best-fit (:data:`GREEDY_ORDERS`), the smallest arena winning (ties: the
   first in that order), then, only if it misses the lower bound, a
   deterministic :func:`local_search` from it.

A program with ``cond`` / ``map`` also plans the values of their branches and
bodies (keys ``"<submodule>/<node>"``) on one timeline in execution order, a
branch's result placed on the cond output it is moved to; see
:mod:`lowering.control_flow` (:func:`_control_flow_lifetimes` is the hook).

A method of a program whose methods have mutable buffers gets a
:class:`SharedState` (``memory_plan(ep, shared_state=...)``): those buffers go
to arena 2 at fixed offsets, outside arena 1's placement
(:func:`lowering.methods.plan_method_state`).

Two values may share bytes only if their lifetimes are disjoint; inclusive
ranges mean an op's inputs and outputs never share memory.  The lower bound
(the most bytes live at one step) is what no placement can beat.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch._higher_order_ops.executorch_call_delegate import executorch_call_delegate
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .dynamic import DynamicShapeError, is_dynamic, is_sym_op, upper_bound_shape
from .control_flow import has_control_flow, is_control_flow
from .errors import MemoryPlanError

#: The arena every planned tensor lives in; 0 is reserved for constants.
ARENA_MEM_ID = 1

#: The arena of mutable state shared across the methods of one program
#: (ExecuTorch's ``MemoryPlanningPass(share_mutable_buffers=True)`` uses 2 too).
SHARED_STATE_MEM_ID = 2


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorAllocation:
    """Where one tensor value lives.

    ``size`` is the number of bytes reserved (the tensor's ``nbytes`` rounded
    up to the alignment); ``lifetime`` is the inclusive range of graph steps
    (node indices in graph order) during which the bytes are in use.
    """

    mem_id: int
    offset: int
    size: int
    lifetime: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mem_id": self.mem_id,
            "offset": self.offset,
            "size": self.size,
            "lifetime": list(self.lifetime),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorAllocation":
        first, last = d["lifetime"]
        return cls(int(d["mem_id"]), int(d["offset"]), int(d["size"]), (int(first), int(last)))


@dataclass(frozen=True)
class MemoryPlan:
    """The result of stage 7; plain data, JSON-able through :meth:`to_dict`.

    ``allocations`` holds every planned value, including the aliases (views),
    whose entries repeat their base's ``mem_id``/``offset`` with the alias's
    own lifetime.  ``aliases`` maps such a value to the base it shares memory
    with; the base's lifetime covers every use of its aliases.
    """

    out_variants: dict[str, str]
    allocations: dict[str, TensorAllocation]
    arena_sizes: tuple[int, ...]
    lower_bound: int
    algorithm: str
    aliases: dict[str, str] = field(default_factory=dict)
    alignment: int = 16

    @property
    def arena_bytes(self) -> int:
        """Size of the planned arena (``mem_id`` 1)."""
        return self.arena_sizes[ARENA_MEM_ID] if len(self.arena_sizes) > ARENA_MEM_ID else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain, deterministic, JSON-able data (keys in graph order)."""
        return {
            "out_variants": dict(self.out_variants),
            "allocations": {k: a.to_dict() for k, a in self.allocations.items()},
            "arena_sizes": list(self.arena_sizes),
            "lower_bound": self.lower_bound,
            "algorithm": self.algorithm,
            "aliases": dict(self.aliases),
            "alignment": self.alignment,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MemoryPlan":
        return cls(
            out_variants=dict(d["out_variants"]),
            allocations={k: TensorAllocation.from_dict(a) for k, a in d["allocations"].items()},
            arena_sizes=tuple(int(s) for s in d["arena_sizes"]),
            lower_bound=int(d["lower_bound"]),
            algorithm=str(d["algorithm"]),
            aliases=dict(d.get("aliases", {})),
            alignment=int(d.get("alignment", 16)),
        )


@dataclass(frozen=True)
class SharedState:
    """Where mutable buffers shared across methods live: arena
    :data:`SHARED_STATE_MEM_ID`, one fixed offset per buffer name (fqn), the same
    in every method of the program.  State persists, so nothing else shares
    its bytes::

        SharedState(offsets={"cache.k": 0, "cache.v": 4096}, size=8192)
        method "prefill": b_cache_k -> (mem_id 2, offset 0)     arena_sizes (0, A_prefill, 8192)
        method "decode":  b_cache_k -> (mem_id 2, offset 0)     arena_sizes (0, A_decode, 8192)
    """

    offsets: dict[str, int]
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"offsets": dict(self.offsets), "size": self.size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SharedState":
        return cls({k: int(v) for k, v in d["offsets"].items()}, int(d["size"]))


# ---------------------------------------------------------------------------
# Out variants
# ---------------------------------------------------------------------------


def find_out_variants(graph: torch.fx.Graph) -> dict[str, str]:
    """Map each ``call_function`` OpOverload node to its out overload name.

    ``getitem`` and the delegate call are skipped; an op without an out
    variant raises :class:`MemoryPlanError` naming the op and the node.
    """
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function" or _is_getitem(node) or _is_delegate_call(node):
            continue
        if is_sym_op(node.target) or is_control_flow(node):
            # a symbolic int op is a prim op of the runtime (no memory); a cond / map's
            # submodules' ops are planned with their own keys
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            if _tensor_vals(node):
                raise MemoryPlanError(
                    f"node {node.name!r}: {node.target} is not an ATen operator overload "
                    "and produces tensors; it cannot be memory-planned"
                )
            continue
        name = out_variant_name(node.target)
        if name is None:
            raise MemoryPlanError(
                f"op {node.target} at node {node.name!r} has no out variant "
                "(no '.out' overload with a matching schema is registered)"
            )
        out[node.name] = name
    return out


def out_variant_name(op: torch._ops.OpOverload) -> str | None:
    """``aten.add.Tensor`` -> ``"aten::add.out"``; None if no out overload matches."""
    schema = op._schema
    return _out_variant_table(schema.name).get(schema.overload_name or "default")


@functools.lru_cache(maxsize=None)
def _out_variant_table(qualified_name: str) -> dict[str, str]:
    """overload name -> out overload name, for every schema of one operator.

    Schemas are grouped by their torchgen signature (arguments without the
    out arguments, no returns), which is how a functional schema and its out
    variant are paired; an out schema maps to itself.
    """
    from torchgen.model import FunctionSchema, SchemaKind

    parsed = []
    for pybind_schema in torch._C._jit_get_schemas_for_operator(qualified_name):
        try:
            parsed.append(FunctionSchema.parse(str(pybind_schema)))
        except Exception:  # torchgen cannot parse some prim schemas; they have no out form
            continue
    groups: dict[Any, dict[Any, Any]] = {}
    for schema in parsed:
        signature = dataclasses.replace(schema.signature(), returns=())
        groups.setdefault(signature, {})[schema.kind()] = schema
    table: dict[str, str] = {}
    for group in groups.values():
        out_schema = group.get(SchemaKind.out)
        if out_schema is None:
            continue
        out_name = _qualified_overload(qualified_name, out_schema.name.overload_name)
        for kind in (SchemaKind.functional, SchemaKind.out):
            schema = group.get(kind)
            if schema is not None:
                table[schema.name.overload_name or "default"] = out_name
    return table


def _qualified_overload(qualified_name: str, overload: str) -> str:
    return f"{qualified_name}.{overload}" if overload else qualified_name


# ---------------------------------------------------------------------------
# Values, aliases, lifetimes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorValue:
    """One tensor value the program computes or receives: its key and byte sizes."""

    key: str
    nbytes: int
    size: int  # nbytes rounded up to the alignment


@dataclass
class ValueTable:
    """The planned values of a program, in graph order.

    ``refs`` maps each node to the value keys it names (a ``getitem`` names
    one element of its source; a multi-output node names all its outputs);
    ``mutated`` holds the keys of mutated buffers.
    """

    values: dict[str, TensorValue]
    refs: dict[torch.fx.Node, list[str]]
    mutated: set[str]


def collect_values(ep: ExportedProgram, alignment: int, shared: Iterable[str] = ()) -> ValueTable:
    """User inputs, mutated buffers and every op output; constants are left out.

    A tensor with symbolic sizes (dynamic shapes) is sized at its upper bound
    (every symbol at the max of its ``range_constraints``); one without an
    upper bound raises :class:`MemoryPlanError` naming the value.  Buffers named
    in ``shared`` (shared state) are planned too, even where this method only
    reads them.
    """
    planned_inputs, mutated_inputs = _planned_inputs(ep, shared)
    values: dict[str, TensorValue] = {}
    refs: dict[torch.fx.Node, list[str]] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name not in planned_inputs:
            continue
        if node.op not in ("placeholder", "call_function"):
            continue
        if _is_getitem(node):
            key = value_key(node)
            if key in values:
                refs[node] = [key]
            continue
        val = node.meta.get("val")
        items = {node.name: val} if not isinstance(val, (tuple, list)) else {
            f"{node.name}.{i}": item for i, item in enumerate(val)
        }
        keys = [key for key, item in items.items() if isinstance(item, torch.Tensor)]
        for key in keys:
            values[key] = _tensor_value(key, items[key], alignment, ep.range_constraints)
        if keys:
            refs[node] = keys
    return ValueTable(values, refs, mutated_inputs)


def _planned_inputs(ep: ExportedProgram, shared: Iterable[str] = ()) -> tuple[set[str], set[str]]:
    """Placeholder names that get memory (user inputs, mutated or shared buffers),
    and the state buffers among them.  Parameters, lifted constants and buffers
    that are never mutated (nor shared) are constants."""
    sig = ep.graph_signature
    mutated_fqns = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    mutated_fqns |= set(shared)
    planned: set[str] = set()
    mutated: set[str] = set()
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind == InputKind.USER_INPUT:
            planned.add(name)
        elif spec.kind == InputKind.BUFFER and spec.target in mutated_fqns:
            planned.add(name)
            mutated.add(name)
    return planned, mutated


def value_key(node: torch.fx.Node) -> str:
    """The value key a node names: ``getitem(src, i)`` names ``"src.i"``."""
    if _is_getitem(node) and isinstance(node.args[0], torch.fx.Node):
        source, index = node.args
        if isinstance(source.meta.get("val"), (tuple, list)):
            return f"{source.name}.{index}"
    return node.name


def _tensor_value(key: str, val: torch.Tensor, alignment: int, ranges=None) -> TensorValue:
    """``val``'s byte sizes; a dynamic shape at its upper bound."""
    try:
        shape = upper_bound_shape(val, ranges, what=f"value {key!r}")
    except DynamicShapeError as exc:
        raise MemoryPlanError(f"cannot plan memory at the upper bound: {exc}") from None
    nbytes = functools.reduce(operator.mul, shape, 1) * val.element_size()
    return TensorValue(key, nbytes, _align(nbytes, alignment))


def find_view_aliases(graph: torch.fx.Graph, table: ValueTable) -> dict[str, str]:
    """``view_copy`` outputs that share their base's memory: view key -> base key.

    As in ExecuTorch's ``ReplaceViewCopyWithViewPass``, a view that feeds the
    graph output keeps its own copy; chains resolve to the root base.  Only
    planned bases qualify (a view of a constant stays a planned copy), and
    only static shapes: a dynamic view's shape changes at run time, which an
    aliased tensor (no instruction) could not follow.
    """
    aliases: dict[str, str] = {}
    for node in graph.nodes:
        if node.target is not torch.ops.aten.view_copy.default or node.name not in table.values:
            continue
        if any(user.op == "output" for user in node.users):
            continue
        if is_dynamic(node.meta.get("val")) or is_dynamic(getattr(node.args[0], "meta", {}).get("val")):
            continue
        base_keys = table.refs.get(node.args[0], [])
        if len(base_keys) != 1:
            continue
        root = aliases.get(base_keys[0], base_keys[0])
        if table.values[root].nbytes == table.values[node.name].nbytes:
            aliases[node.name] = root
    return aliases


def compute_lifetimes(graph: torch.fx.Graph, table: ValueTable) -> dict[str, tuple[int, int]]:
    """Each value's inclusive (first, last) step; step = node index in graph order.

    A value lives from its defining node to the last node that reads it
    (uses through ``getitem`` count); placeholders start at 0, graph outputs
    live to the output node, mutated buffers live throughout.
    """
    nodes = list(graph.nodes)
    spans: dict[str, list[int]] = {}
    for step, node in enumerate(nodes):
        touched = list(table.refs.get(node, ()))
        for arg in _input_nodes(node):
            touched.extend(table.refs.get(arg, ()))
        first = 0 if node.op == "placeholder" else step
        for key in touched:
            span = spans.setdefault(key, [first, step])
            span[1] = step
    for key in table.mutated:
        spans[key] = [0, len(nodes) - 1]
    return {key: tuple(spans[key]) for key in table.values}


def extend_base_lifetimes(
    lifetimes: Mapping[str, tuple[int, int]], aliases: Mapping[str, str]
) -> dict[str, tuple[int, int]]:
    """Lifetimes in which each base also covers every use of its aliases."""
    extended = dict(lifetimes)
    for alias, base in aliases.items():
        (b0, b1), (a0, a1) = extended[base], lifetimes[alias]
        extended[base] = (min(b0, a0), max(b1, a1))
    return extended


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` reads (args and kwargs, flattened)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


@dataclass(frozen=True)
class PlannedValue:
    """A value to place: reserved bytes and inclusive lifetime."""

    key: str
    size: int
    start: int
    end: int


def lower_bound(values: Iterable[PlannedValue]) -> int:
    """Max over steps of the summed sizes of the values live at that step."""
    delta: dict[int, int] = {}
    for v in values:
        delta[v.start] = delta.get(v.start, 0) + v.size
        delta[v.end + 1] = delta.get(v.end + 1, 0) - v.size
    best = live = 0
    for step in sorted(delta):
        live += delta[step]
        best = max(best, live)
    return best


# ---------------------------------------------------------------------------
# Placement algorithms
# ---------------------------------------------------------------------------


@dataclass
class PlacementProblem:
    """The values to place, by index: sizes, inclusive lifetimes, conflicts.

    ``conflicts[i]`` lists the values whose lifetimes overlap value ``i``'s;
    only those may not share bytes with it.
    """

    sizes: list[int]
    starts: list[int]
    ends: list[int]
    conflicts: list[list[int]]
    lower_bound: int

    @classmethod
    def from_values(cls, values: Sequence[PlannedValue]) -> "PlacementProblem":
        sizes = [v.size for v in values]
        starts = [v.start for v in values]
        ends = [v.end for v in values]
        return cls(sizes, starts, ends, _conflicts(starts, ends), lower_bound(values))

    def __len__(self) -> int:
        return len(self.sizes)


def _conflicts(starts: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """For each value, the values whose lifetimes overlap it (sorted indices).

    A sweep over start steps: O(n log n + number of overlapping pairs).
    """
    order = sorted(range(len(starts)), key=lambda i: (starts[i], i))
    conflicts: list[list[int]] = [[] for _ in starts]
    active: list[int] = []
    for i in order:
        start = starts[i]
        active = [j for j in active if ends[j] >= start]
        for j in active:
            conflicts[i].append(j)
            conflicts[j].append(i)
        active.append(i)
    for row in conflicts:
        row.sort()
    return conflicts


def place(
    problem: PlacementProblem,
    order: Sequence[int],
    *,
    start: int = 0,
    offsets: Sequence[int] | None = None,
) -> list[int]:
    """Place values in ``order``, each in a free gap among its placed conflicts.

    Best fit: the smallest gap that fits (the lowest on ties); with no gap
    the value goes on top of its placed conflicts.  To re-place only a
    suffix, pass ``start`` and the ``offsets`` of ``order[:start]``.
    O(sum of conflict degrees x log).
    """
    sizes, conflicts = problem.sizes, problem.conflicts
    placed = [-1] * len(sizes)
    if start:
        for i in order[:start]:
            placed[i] = offsets[i]
    for i in order[start:]:
        size = sizes[i]
        if size == 0:
            placed[i] = 0
            continue
        busy = sorted(
            (placed[j], placed[j] + sizes[j]) for j in conflicts[i] if placed[j] >= 0 and sizes[j]
        )
        chosen = chosen_gap = -1
        cursor = 0
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (chosen < 0 or gap < chosen_gap):
                chosen, chosen_gap = cursor, gap
            if hi > cursor:
                cursor = hi
        placed[i] = chosen if chosen >= 0 else cursor
    return placed


def arena_size(problem: PlacementProblem, offsets: Sequence[int]) -> int:
    """Bytes spanned by a placement."""
    return max((o + s for o, s in zip(offsets, problem.sizes)), default=0)


def size_order(problem: PlacementProblem) -> list[int]:
    """Largest first; ties: longer lifetime, earlier start, index."""
    s, b, e = problem.sizes, problem.starts, problem.ends
    return sorted(range(len(s)), key=lambda i: (-s[i], b[i] - e[i], b[i], i))


def lifetime_order(problem: PlacementProblem) -> list[int]:
    """Longest-lived first; ties: larger, earlier start, index."""
    s, b, e = problem.sizes, problem.starts, problem.ends
    return sorted(range(len(s)), key=lambda i: (b[i] - e[i], -s[i], b[i], i))


def breadth_order(problem: PlacementProblem) -> list[int]:
    """Steps by decreasing live bytes; at each step its unordered values, largest first.

    The values live at the peak step come first, so the peak packs tightly
    (Pisarchyk & Lee 2020, "greedy by breadth").  A value's turn is the
    best-ranked step of its lifetime: a range-minimum query over step ranks
    (sparse table), O(n log n + T log T) for T steps.
    """
    s, b, e = problem.sizes, problem.starts, problem.ends
    if not s:
        return []
    steps = max(e) + 2
    load = [0] * steps
    for i in range(len(s)):
        load[b[i]] += s[i]
        load[e[i] + 1] -= s[i]
    for t in range(1, steps):
        load[t] += load[t - 1]
    rank = [0] * steps
    for r, t in enumerate(sorted(range(steps), key=lambda t: (-load[t], t))):
        rank[t] = r
    table = [rank]
    width = 1
    while 2 * width <= steps:
        prev = table[-1]
        table.append([min(prev[t], prev[t + width]) for t in range(steps - 2 * width + 1)])
        width *= 2

    def best_rank(lo: int, hi: int) -> int:
        level = (hi - lo + 1).bit_length() - 1
        row = table[level]
        return min(row[lo], row[hi - (1 << level) + 1])

    return sorted(range(len(s)), key=lambda i: (best_rank(b[i], e[i]), -s[i], b[i], i))


#: Greedy orders in tie-break order.
GREEDY_ORDERS: dict[str, Callable[[PlacementProblem], list[int]]] = {
    "greedy_by_size": size_order,
    "greedy_by_breadth": breadth_order,
    "greedy_by_lifetime": lifetime_order,
}


def local_search(
    problem: PlacementProblem,
    order: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
    *,
    max_evaluations: int = 2_000,
    max_work: int = 1_000_000,
) -> tuple[list[int], list[int]]:
    """Improve a placement order until the arena meets the lower bound.

    From ``order`` (default: the best greedy order; pass its ``offsets`` if
    already placed), repeatedly move a value that reaches the top of the
    arena to a random earlier position (or, if it is first, swap a random
    pair) and keep the move unless the arena grows; only the changed suffix
    of the order is re-placed.

    The budget is counted in work, not wall time, so the result is the same
    on every machine: at most ``max_evaluations`` re-placements and
    ``max_work`` conflict-list entries scanned; a seeded RNG picks the moves.
    Returns ``(order, offsets)`` of the best placement seen.
    """
    n = len(problem)
    if order is None:
        _, order, offsets = best_greedy(problem)
    order = list(order)
    offsets = list(offsets) if offsets is not None else place(problem, order)
    arena = arena_size(problem, offsets)
    best_order, best_offsets, best_arena = order, offsets, arena
    cost = [len(row) + 1 for row in problem.conflicts]
    rng = random.Random(0)
    evaluations = work = 0
    while evaluations < max_evaluations and work < max_work and best_arena > problem.lower_bound and n > 1:
        top = [i for i in range(n) if problem.sizes[i] and offsets[i] + problem.sizes[i] == arena]
        moved = rng.choice(top)
        position = order.index(moved)
        candidate = list(order)
        if position:
            first = rng.randrange(position)
            del candidate[position]
            candidate.insert(first, moved)
        else:
            a, b = rng.randrange(n), rng.randrange(n)
            candidate[a], candidate[b] = candidate[b], candidate[a]
            first = min(a, b)
        new_offsets = place(problem, candidate, start=first, offsets=offsets)
        new_arena = arena_size(problem, new_offsets)
        evaluations += 1
        work += sum(cost[i] for i in candidate[first:])
        if new_arena <= arena:
            order, offsets, arena = candidate, new_offsets, new_arena
            if arena < best_arena:
                best_order, best_offsets, best_arena = order, offsets, arena
    return best_order, best_offsets


#: Problems up to this many (non-empty) values get the exact search in "auto".
EXACT_MAX_VALUES = 16

#: Beyond this many values :func:`exact_search` does not start (recursion depth).
EXACT_MAX_DEPTH = 500


def exact_search(
    problem: PlacementProblem, offsets: Sequence[int] | None = None, *, max_work: int = 80_000
) -> tuple[list[int], bool]:
    """Branch and bound over placements, for small problems.

    Any placement can be compacted (every value pushed down until it rests on
    0 or on the top of a value whose lifetime overlaps), so it suffices to
    place values in offset order, each at 0 or at the top of a placed
    conflicting value, no lower than the previous one.  Branches that cannot
    beat the incumbent (``offsets``, default: the best greedy placement) are
    cut, and so are those whose unplaced bytes live at one step cannot fit
    under it.  The search stops at the lower bound or after ``max_work``
    candidate positions (a work count, so the result is the same on every
    machine); above :data:`EXACT_MAX_DEPTH` values it does not start.

    Returns ``(offsets, proven)``: ``proven`` if the search was exhaustive,
    i.e. the placement is optimal.
    """
    sizes, conflicts = problem.sizes, problem.conflicts
    if offsets is None:
        offsets = best_greedy(problem)[2]
    best = list(offsets)
    best_arena = arena_size(problem, best)
    items = [i for i in range(len(sizes)) if sizes[i]]
    if best_arena == problem.lower_bound or len(items) > EXACT_MAX_DEPTH:
        return best, best_arena == problem.lower_bound
    current = [0 if not sizes[i] else -1 for i in range(len(sizes))]
    # Bytes still to place that are live at each value's start step: they
    # stack above the floor, which bounds the final arena from below.
    starts, ends = problem.starts, problem.ends
    covers = {i: [k for k in items if starts[i] <= starts[k] <= ends[i]] for i in items}
    pending = {k: sum(sizes[i] for i in items if starts[i] <= starts[k] <= ends[i]) for k in items}
    work = 0

    def fits(i: int, at: int) -> bool:
        end = at + sizes[i]
        return all(
            current[j] < 0 or current[j] + sizes[j] <= at or end <= current[j] for j in conflicts[i]
        )

    def branch(left: list[int], floor: int, last: int, top: int) -> None:
        nonlocal best, best_arena, work
        if not left:
            if top < best_arena:
                best, best_arena = list(current), top
            return
        if floor + max(pending[k] for k in left) >= best_arena:
            return
        choices = []
        for i in left:
            spots = {0, *(current[j] + sizes[j] for j in conflicts[i] if current[j] >= 0)}
            for at in spots:
                if (at > floor or (at == floor and i > last)) and at + sizes[i] < best_arena and fits(i, at):
                    choices.append((at, -sizes[i], i))
        work += len(left) + len(choices)
        for at, _, i in sorted(choices):
            if best_arena == problem.lower_bound or work >= max_work or at + sizes[i] >= best_arena:
                return
            current[i] = at
            for k in covers[i]:
                pending[k] -= sizes[i]
            branch([j for j in left if j != i], at, i, max(top, at + sizes[i]))
            for k in covers[i]:
                pending[k] += sizes[i]
            current[i] = -1

    branch(items, 0, -1, 0)
    return best, best_arena == problem.lower_bound or work < max_work


def best_greedy(problem: PlacementProblem) -> tuple[str, list[int], list[int]]:
    """``(name, order, offsets)`` of the greedy order with the smallest arena
    (the first in :data:`GREEDY_ORDERS` on ties; stops at the lower bound)."""
    best: tuple[str, list[int], list[int]] | None = None
    best_arena = -1
    for name, order_fn in GREEDY_ORDERS.items():
        order = order_fn(problem)
        offsets = place(problem, order)
        arena = arena_size(problem, offsets)
        if best is None or arena < best_arena:
            best, best_arena = (name, order, offsets), arena
        if arena == problem.lower_bound:
            break
    assert best is not None
    return best


#: Placement algorithms in tie-break order; each maps a problem to offsets.
ALGORITHMS: dict[str, Callable[[PlacementProblem], list[int]]] = {
    **{name: (lambda p, f=order_fn: place(p, f(p))) for name, order_fn in GREEDY_ORDERS.items()},
    "local_search": lambda p: local_search(p)[1],
    "exact": lambda p: exact_search(p)[0],
}


def choose_placement(problem: PlacementProblem, algorithm: str = "auto") -> tuple[str, list[int], int]:
    """``(name, offsets, arena)`` of ``algorithm``'s placement.

    "auto" takes the best greedy order and, only while the arena misses the
    lower bound, improves it with :func:`local_search` and then, for at most
    :data:`EXACT_MAX_VALUES` values, :func:`exact_search`.
    """
    if algorithm != "auto":
        offsets = ALGORITHMS[algorithm](problem)
        return algorithm, offsets, arena_size(problem, offsets)
    name, order, offsets = best_greedy(problem)
    arena = arena_size(problem, offsets)
    if arena > problem.lower_bound:
        _, searched = local_search(problem, order, offsets)
        if arena_size(problem, searched) < arena:
            name, offsets, arena = "local_search", searched, arena_size(problem, searched)
    if arena > problem.lower_bound and sum(1 for s in problem.sizes if s) <= EXACT_MAX_VALUES:
        exact, _ = exact_search(problem, offsets)
        if arena_size(problem, exact) < arena:
            name, offsets, arena = "exact", exact, arena_size(problem, exact)
    return name, offsets, arena


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def memory_plan(
    ep: ExportedProgram,
    *,
    algorithm: str = "auto",
    alignment: int = 16,
    shared_state: SharedState | None = None,
) -> MemoryPlan:
    """Plan the memory of ``ep`` (not mutated); see the module docstring.

    With ``shared_state`` (one method of several sharing mutable buffers), the
    buffers it names are placed at its offsets in arena
    :data:`SHARED_STATE_MEM_ID` and left out of arena 1's placement.
    """
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise MemoryPlanError(
            f"unknown memory planning algorithm {algorithm!r}; "
            f"choose 'auto' or one of {sorted(ALGORITHMS)}"
        )
    if alignment <= 0 or alignment & (alignment - 1):
        raise MemoryPlanError(f"alignment must be a power of two, got {alignment}")
    shared = shared_state.offsets if shared_state is not None else {}
    table = collect_values(ep, alignment, shared)
    shared_keys = _shared_state_keys(ep, shared, table)
    out_variants = find_out_variants(ep.graph)
    aliases = find_view_aliases(ep.graph, table)
    if has_control_flow(ep.graph):
        lifetimes, placed_on = _control_flow_lifetimes(ep, table, alignment, out_variants, aliases)
    else:
        own = compute_lifetimes(ep.graph, table)
        lifetimes, placed_on = extend_base_lifetimes(own, aliases), aliases
    planned = [
        PlannedValue(key, value.size, *lifetimes[key])
        for key, value in table.values.items()
        if key not in placed_on and key not in shared_keys
    ]
    problem = PlacementProblem.from_values(planned)
    name, offsets, arena = choose_placement(problem, algorithm)
    offset_of = {v.key: offset for v, offset in zip(planned, offsets)}
    allocations = {}
    for key, value in table.values.items():
        root = placed_on.get(key, key)
        mem_id, offset = (SHARED_STATE_MEM_ID, shared_keys[root]) if root in shared_keys else (ARENA_MEM_ID, offset_of[root])
        allocations[key] = TensorAllocation(mem_id, offset, value.size, lifetimes[key])
    return MemoryPlan(
        out_variants=out_variants,
        allocations=allocations,
        arena_sizes=(0, arena) if shared_state is None else (0, arena, shared_state.size),
        lower_bound=problem.lower_bound,
        algorithm=name,
        aliases=aliases,
        alignment=alignment,
    )


def _control_flow_lifetimes(
    ep: ExportedProgram,
    table: ValueTable,
    alignment: int,
    out_variants: dict[str, str],
    aliases: dict[str, str],
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Lifetimes and placement bases when the program has cond / map submodules.

    Adds the submodules' values to ``table`` and their out variants (keys
    ``"<submodule>/<node>"``) to ``out_variants``; see :mod:`lowering.control_flow`.
    """
    from .control_flow import control_flow_lifetimes, plan_control_flow_values, resolve_shared_lifetimes

    flow = plan_control_flow_values(ep, table, alignment)
    out_variants.update(flow.out_variants)
    own = control_flow_lifetimes(ep, table)
    return resolve_shared_lifetimes(own, aliases, flow)


def _shared_state_keys(ep: ExportedProgram, shared: Mapping[str, int], table: ValueTable) -> dict[str, int]:
    """Placeholder name -> shared offset, for the buffers of ``ep`` named in ``shared``.

    A mutated buffer missing from ``shared`` is a MemoryPlanError: with shared
    state, every method's state lives in the shared arena.
    """
    if not shared:
        return {}
    keys: dict[str, int] = {}
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind != InputKind.BUFFER or name not in table.values:
            continue
        if spec.target not in shared:
            raise MemoryPlanError(f"mutable buffer {spec.target!r} has no place in the shared state "
                                  f"(shared: {sorted(shared)})")
        keys[name] = shared[spec.target]
    return keys


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_delegate_call(node: torch.fx.Node) -> bool:
    """A call of a delegated payload: its outputs are planned, but it has no
    out variant (the backend writes them)."""
    return node.op == "call_function" and node.target is executorch_call_delegate


def _tensor_vals(node: torch.fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []
