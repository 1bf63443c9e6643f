"""Stage 7, placement: offsets for values with sizes and lifetimes, in as small an arena as found.

:func:`choose_placement` places the values best-fit (:func:`place`) in three
greedy orders (:data:`GREEDY_ORDERS`), the smallest arena winning (ties: the
first in that order), then, only if it misses the lower bound, a
deterministic :func:`local_search` from it and, for small problems, the
branch and bound of :func:`exact_search`.

Two values may share bytes only if their lifetimes are disjoint; inclusive
ranges mean an op's inputs and outputs never share memory.  The lower bound
(the most bytes live at one step) is what no placement can beat.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


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
