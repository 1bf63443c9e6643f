"""Control flow as a graph shape: ``torch.cond`` and ``torch.map`` queries every stage shares.

torch.export keeps both as higher-order ops whose branches / body are
``get_attr`` submodules of the program's graph module::

    %true_graph_0 = get_attr[true_graph_0]
    %false_graph_0 = get_attr[false_graph_0]
    %cond = higher_order.cond(%gt, %true_graph_0, %false_graph_0, (%x, %p_a_w, %p_b_w))
    %getitem = getitem(%cond, 0)

    %body_graph_0 = get_attr[body_graph_0]
    %map_impl = higher_order.map_impl(%body_graph_0, [%xs], [%y, %p_w])
    %getitem = getitem(%map_impl, 0)

A submodule's placeholders are the operands, in order (for map: the slice of
the mapped tensor first, then the other operands).  Parameters the branches
use are operands of the top-level node: a submodule has no parameters of its
own, and a partition inside it receives them as inputs.

This room owns only the queries (which nodes are control flow, which
submodules they call, every scope of a program); it imports no stage.  What
each stage does with control flow lives in that stage's own room:

- export: :mod:`lowering.export.control_flow` refuses what is not supported;
  the slow path (:mod:`lowering.export.fallback`) applies the edge clean-ups
  inside the submodules with :func:`for_each_submodule_graph`;
- to_backend: :func:`lowering.to_backend.lower_control_flow_submodules` delegates
  the partitions inside every submodule, each wrapped as a program by
  :func:`lowering.subprogram.submodule_program`;
- memory plan: :mod:`lowering.memory_plan.control_flow` plans the submodules'
  values (keys ``"<submodule>/<node>"``) on one timeline in emission order;
- emit: :mod:`lowering.emit.control_flow` inlines the submodules between jumps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

#: The control-flow ops lowerflow lowers.
COND = torch.ops.higher_order.cond
MAP = torch.ops.higher_order.map_impl

#: Separator between a submodule and its node in a value key (``true_graph_0/addmm``).
SCOPE_SEPARATOR = "/"


def is_control_flow(node: torch.fx.Node) -> bool:
    """A ``cond`` or ``map_impl`` call."""
    return node.op == "call_function" and node.target in (COND, MAP)


def control_flow_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The cond / map nodes of ``graph`` (not of its submodules), in graph order."""
    return [n for n in graph.nodes if is_control_flow(n)]


def has_control_flow(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` itself has a cond / map node."""
    return any(is_control_flow(n) for n in graph.nodes)


@dataclass(frozen=True)
class Submodule:
    """One branch or body: its ``get_attr`` target, graph module and operands.

    ``operands[i]`` is what the submodule's placeholder ``i`` is bound to: a
    node (or constant) of the parent graph; for map's first placeholder (the
    slice of the mapped tensor) it is ``None``.
    """

    attr: str
    module: torch.fx.GraphModule
    operands: tuple


def submodules_of(parent: torch.fx.GraphModule, node: torch.fx.Node) -> list[Submodule]:
    """The branches of a cond (true, false) or the body of a map."""
    if node.target is COND:
        _, true_attr, false_attr, operands = node.args
        return [
            Submodule(true_attr.target, getattr(parent, true_attr.target), tuple(operands)),
            Submodule(false_attr.target, getattr(parent, false_attr.target), tuple(operands)),
        ]
    body_attr, mapped, operands = node.args
    return [Submodule(body_attr.target, getattr(parent, body_attr.target), (None, *operands))]


def for_each_submodule_graph(
    graph_module: torch.fx.GraphModule, visit: Callable[[torch.fx.GraphModule], Any]
) -> int:
    """Call ``visit`` on the graph module of every cond / map submodule (recursively),
    recompiling each afterwards; returns the number visited."""
    count = 0
    for node in control_flow_nodes(graph_module.graph):
        for sub in submodules_of(graph_module, node):
            visit(sub.module)
            count += 1 + for_each_submodule_graph(sub.module, visit)
            sub.module.graph.lint()
            sub.module.recompile()
    return count


def iter_scopes(gm: torch.fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, torch.fx.GraphModule]]:
    """``(scope prefix, graph module)`` of the program and of every submodule, depth first."""
    yield prefix, gm
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            yield from iter_scopes(sub.module, f"{prefix}{sub.attr}{SCOPE_SEPARATOR}")
