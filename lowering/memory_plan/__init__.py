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
:mod:`lowering.memory_plan.control_flow` (:func:`plan_control_flow` is the hook).

A method of a program whose methods have mutable buffers gets a
:class:`SharedState` (``memory_plan(ep, shared_state=...)``): those buffers go
to arena 2 at fixed offsets, outside arena 1's placement
(:func:`lowering.methods.plan_method_state`).

Two values may share bytes only if their lifetimes are disjoint; inclusive
ranges mean an op's inputs and outputs never share memory.  The lower bound
(the most bytes live at one step) is what no placement can beat.

The rooms of this package (this file only re-exports their public names):

- :mod:`~lowering.memory_plan.plan`: :func:`memory_plan`, :class:`MemoryPlan`,
  :class:`SharedState` and the arena ids;
- :mod:`~lowering.memory_plan.out_variants`: step 2;
- :mod:`~lowering.memory_plan.values`: steps 1, 3 and 4 (values, view
  aliases, lifetimes);
- :mod:`~lowering.memory_plan.placement`: step 5 (the placement algorithms);
- :mod:`~lowering.memory_plan.control_flow`: the cond / map case.
"""

from __future__ import annotations

from .control_flow import ControlFlowValues, control_flow_lifetimes, plan_control_flow, plan_control_flow_values
from .out_variants import find_out_variants, out_variant_name
from .placement import (
    ALGORITHMS,
    EXACT_MAX_DEPTH,
    EXACT_MAX_VALUES,
    GREEDY_ORDERS,
    PlacementProblem,
    PlannedValue,
    arena_size,
    best_greedy,
    breadth_order,
    choose_placement,
    exact_search,
    lifetime_order,
    local_search,
    lower_bound,
    place,
    size_order,
)
from .plan import ARENA_MEM_ID, SHARED_STATE_MEM_ID, MemoryPlan, SharedState, TensorAllocation, memory_plan
from .values import (
    TensorValue,
    ValueTable,
    collect_values,
    compute_lifetimes,
    extend_base_lifetimes,
    find_view_aliases,
    tensor_value,
    value_key,
)

__all__ = [
    "ALGORITHMS",
    "ARENA_MEM_ID",
    "ControlFlowValues",
    "EXACT_MAX_DEPTH",
    "EXACT_MAX_VALUES",
    "GREEDY_ORDERS",
    "MemoryPlan",
    "PlacementProblem",
    "PlannedValue",
    "SHARED_STATE_MEM_ID",
    "SharedState",
    "TensorAllocation",
    "TensorValue",
    "ValueTable",
    "arena_size",
    "best_greedy",
    "breadth_order",
    "choose_placement",
    "collect_values",
    "compute_lifetimes",
    "control_flow_lifetimes",
    "exact_search",
    "extend_base_lifetimes",
    "find_out_variants",
    "find_view_aliases",
    "lifetime_order",
    "local_search",
    "lower_bound",
    "memory_plan",
    "out_variant_name",
    "place",
    "plan_control_flow",
    "plan_control_flow_values",
    "size_order",
    "tensor_value",
    "value_key",
]
