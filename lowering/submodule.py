"""Stage 3 — create submodule: fuse the nodes of each partition tag into a ``call_module``.

Before (tag T on ``permute_copy`` and ``addmm``)::

    %permute_copy = aten.permute_copy(%p_w, [1, 0])       {tag: T}
    %addmm        = aten.addmm(%p_b, %x, %permute_copy)   {tag: T}
    %relu         = aten.relu(%addmm)

After::

    %fused_0 = call_module[fused_0](%p_w, %p_b, %x)       # returns a tuple, always
    %getitem = getitem(%fused_0, 0)
    %relu    = aten.relu(%getitem)

All tags are fused in one pass over the graph and the graph is re-sorted once
at the end (ExecuTorch sorts the whole graph once per partition, which makes
96 partitions cost seconds).  Placeholders are never fused: a tagged constant
stays a placeholder of the top-level graph, and its copy inside the submodule
keeps the tag, which is how stage 4 knows the partition consumes it.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, insert_subgm

from .errors import SubmoduleError
from .partition import TAG


def create_submodules(
    graph_module: torch.fx.GraphModule, tags: Iterable[str]
) -> dict[str, torch.fx.Node]:
    """Fuse each tag's operator nodes into a submodule; returns tag -> ``call_module`` node.

    Submodules are named ``fused_<i>`` in the order of ``sorted(tags)``.
    A tag whose nodes would form a dependency cycle raises :class:`SubmoduleError`
    naming the nodes inside and outside the partition that close the cycle.
    """
    tags = sorted(tags)
    members = nodes_by_tag(graph_module.graph, tags)
    for tag in tags:
        if not members[tag]:
            raise SubmoduleError(f"partition tag {tag!r} has no operator nodes to delegate")
        check_no_cycle(tag, members[tag])
    calls = {}
    for i, tag in enumerate(tags):
        calls[tag] = fuse_partition(graph_module, members[tag], f"fused_{i}")
    # One sort for all partitions.  It copies the graph into new nodes (same
    # names), so the calls are looked up again by name.
    stable_topological_sort(graph_module)
    graph_module.graph.lint()
    graph_module.recompile()
    by_name = {n.name: n for n in graph_module.graph.nodes if n.op == "call_module"}
    return {tag: by_name[call.name] for tag, call in calls.items()}


def nodes_by_tag(graph: torch.fx.Graph, tags: list[str]) -> dict[str, list[torch.fx.Node]]:
    """The operator nodes of each tag, in graph (topological) order, in one pass."""
    members: dict[str, list[torch.fx.Node]] = {tag: [] for tag in tags}
    for node in graph.nodes:
        tag = node.meta.get(TAG)
        if tag in members and node.op in ("call_function", "get_attr"):
            members[tag].append(node)
    return members


def fuse_partition(
    graph_module: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str
) -> torch.fx.Node:
    """Replace ``nodes`` (topologically sorted) by one ``call_module`` to a new submodule."""
    lookup = dict.fromkeys(nodes)
    sub, inputs, outputs = fuse_as_graphmodule(
        graph_module, nodes, name, lookup, always_return_tuple=True
    )
    insert_subgm(graph_module, sub, inputs, outputs, nodes[-1])
    call = nodes[-1].next  # insert_subgm places the call right after its insertion point
    erase_nodes(graph_module, nodes)
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    return call


def check_no_cycle(tag: str, nodes: list[torch.fx.Node]) -> None:
    """Raise if a path leaves the partition and comes back into it.

    Breadth-first from the partition's external users, remembering where each
    node was reached from, so the error can name the whole path.
    """
    inside = set(nodes)
    parent: dict[torch.fx.Node, torch.fx.Node] = {}
    queue = []
    for node in nodes:
        for user in node.users:
            if user not in inside and user not in parent:
                parent[user] = node
                queue.append(user)
    while queue:
        current = queue.pop()
        for user in current.users:
            if user in parent:
                continue
            parent[user] = current
            if user in inside:
                raise SubmoduleError(_cycle_message(tag, user, parent, inside))
            queue.append(user)


def _cycle_message(tag, end, parent, inside) -> str:
    path = [end]
    node = parent[end]
    while node not in inside:
        path.append(node)
        node = parent[node]
    path.append(node)
    path.reverse()
    outside = [n.name for n in path if n not in inside]
    return (
        f"partition tag {tag!r} would create a dependency cycle: "
        f"{' -> '.join(n.name for n in path)} leaves the partition through "
        f"{outside} and comes back; untag {outside} into the partition or split it"
    )
