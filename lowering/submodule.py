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

The fused graph is a function of the tagged graph's nodes alone, whether it
is the live program or one read back from the store, in any process:

* names: the nodes fusion creates (``fused_<i>``, ``getitem_<n>``) are named
  from the graph's current node names, never from names its history used
  (:func:`fresh_namespace`);
* order: each call's getitems follow it directly, in index order — the order
  torch's deserializer gives them — so the fused and the delegated program
  read back from the store as the same graph (the memory planner numbers
  graph steps: a getitem elsewhere gives another plan and other ``.pte`` bytes).
"""

from __future__ import annotations

from typing import Iterable

import operator

import torch
from torch.fx.graph import _Namespace
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, insert_subgm

from .errors import SubmoduleError
from .delegation import TAG


def create_submodules(
    graph_module: torch.fx.GraphModule, tags: Iterable[str]
) -> dict[str, torch.fx.Node]:
    """Fuse each tag's operator nodes into a submodule; returns tag -> ``call_module`` node.

    Submodules are named ``fused_<i>`` in the order of ``sorted(tags)``.
    A tag whose nodes would form a dependency cycle raises :class:`SubmoduleError`
    naming the nodes inside and outside the partition that close the cycle.
    The result depends only on the graph's nodes and tags (see the module docstring).
    """
    tags = sorted(tags)
    members = nodes_by_tag(graph_module.graph, tags)
    for tag in tags:
        if not members[tag]:
            raise SubmoduleError(f"partition tag {tag!r} has no operator nodes to delegate")
        check_no_cycle(tag, members[tag])
    fresh_namespace(graph_module.graph)
    calls = {}
    for i, tag in enumerate(tags):
        calls[tag] = fuse_partition(graph_module, members[tag], f"fused_{i}")
    # One sort for all partitions.  It copies the graph into new nodes (same
    # names), so the calls are looked up again by name.
    stable_topological_sort(graph_module)
    by_name = {n.name: n for n in graph_module.graph.nodes if n.op == "call_module"}
    calls = {tag: by_name[call.name] for tag, call in calls.items()}
    for call in calls.values():
        place_getitems_after(call)
    graph_module.graph.lint()
    graph_module.recompile()
    return calls


def fresh_namespace(graph: torch.fx.Graph) -> None:
    """Forget the names ``graph`` used before (in place): only its current nodes' names are taken.

    torch.fx never frees a name: a graph that erased ``getitem_7`` on its way
    (export, decompositions) names its next getitem differently from a copy
    of it or one read back from the store.  After this, names of new nodes
    depend on the current nodes alone.  (torch.fx has no public API for it.)
    """
    namespace = _Namespace()
    for node in graph.nodes:
        if node.name in namespace._used_names:  # cannot happen: node names are unique identifiers
            raise SubmoduleError(f"node name {node.name!r} is not unique in the graph")
        name = namespace.create_name(node.name, None)
        if name != node.name:
            # A name fx never hands out, a builtin's (torch.export calls nn.Sequential's
            # argument 'input'): the node keeps it, and it is taken.
            namespace._used_names.discard(name)
            namespace._used_names.add(node.name)
        namespace.associate_name_with_obj(node.name, node)
    graph._graph_namespace = namespace


def place_getitems_after(node: torch.fx.Node) -> None:
    """Move the getitems of a multi-output ``node`` right after it, in index order (in place).

    Always valid (a getitem needs only ``node``), and the order a program
    read back from the store has, so live and stored programs plan alike.
    """
    anchor = node
    for item in getitems_of(node):
        if anchor.next is not item:
            anchor.append(item)
        anchor = item


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


def getitems_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem users of ``node``, by index."""
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    return sorted(items, key=lambda u: u.args[1])
