"""Stage 7, the plan: :func:`memory_plan` and what it returns.

:class:`MemoryPlan` (plain data, JSON-able) holds an allocation per planned
value, the out variant per op and the arena sizes; :class:`SharedState` is
where the mutable buffers that several methods of one program share live
(arena :data:`SHARED_STATE_MEM_ID`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..control_flow_graph import has_control_flow
from ..errors import MemoryPlanError
from .control_flow import plan_control_flow
from .out_variants import find_out_variants
from .placement import ALGORITHMS, PlacementProblem, PlannedValue, choose_placement
from .values import (ValueTable, collect_values, compute_lifetimes, extend_base_lifetimes, find_mutation_aliases,
                     find_view_aliases)

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
# Entry point
# ---------------------------------------------------------------------------


def memory_plan(
    ep: ExportedProgram,
    *,
    algorithm: str = "auto",
    alignment: int = 16,
    shared_state: SharedState | None = None,
) -> MemoryPlan:
    """Plan the memory of ``ep`` (not mutated); see :mod:`lowering.memory_plan`.

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
    mutated_in_place = find_mutation_aliases(ep.graph, table)
    aliases = {**mutated_in_place, **{key: mutated_in_place.get(base, base)
                                      for key, base in find_view_aliases(ep.graph, table).items()}}
    if has_control_flow(ep.graph):
        lifetimes, placed_on = plan_control_flow(ep, table, alignment, out_variants, aliases)
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
