"""torch.fx's capability-based partitions, found in near-linear time.

:func:`propose_partitions` returns exactly what torch.fx's
``CapabilityBasedPartitioner(gm, support, allows_single_node_partition=...).propose_partitions()``
returns (the same partitions, in the same order, their nodes in the same order),
without its quadratic cost on large graphs (an LLM of 30 layers: ~5,000 nodes):

- torch.fx keeps, per node, a Python ``set`` of every node downstream of it
  (O(N²) memory and time); here each node's reach is an ``int`` bit mask
  (bit *i* = the *i*-th node of the graph), so "does anything downstream of
  these users land in these partitions" is one ``&``.
- torch.fx tries, at every node, to merge the first partition with every other
  one, and re-runs its cycle search for pairs it already refused.  A refused
  merge stays refused while neither partition changes (the proof is in
  :meth:`_Search.try_merge`), so a refusal is remembered per (pair, versions).

Same walk as torch.fx: nodes in reverse graph order; a supported node opens a
partition; then the candidates (the new partition first, then every partition
by age) are merged into the first one by one, each merge refused when it would
make a cycle.  Example (``a`` and ``c`` supported, ``b`` not)::

    Before:  a ─► b ─► c          a ─► c   (no b)
             └────────►┘
    After:   {a} {c}  (a+c would   {a, c}
             wrap b: a cycle)
"""

from __future__ import annotations

import itertools
import operator
from typing import Callable

import torch
from torch.fx.node import _get_qualified_name as _qualified_name  # torch.fx's own naming of targets
from torch.fx.passes.infra.partitioner import Partition

#: torch.fx's default ops that do not count as compute for ``allows_single_node_partition=False``.
NON_COMPUTE_OPS = ("torch.ops.aten.view", "_operator.getitem")


def reach_masks(graph: torch.fx.Graph) -> tuple[dict[torch.fx.Node, int], dict[torch.fx.Node, int]]:
    """(bit of each node, reach of each node): the reach is the node's bit OR every node downstream of it.

    Before::  a ─► b ─► c        After::  bit  {a: 0b001, b: 0b010, c: 0b100}
                                          reach {a: 0b111, b: 0b110, c: 0b100}
    """
    nodes = list(graph.nodes)
    bit = {n: 1 << i for i, n in enumerate(nodes)}
    reach: dict[torch.fx.Node, int] = {}
    for node in reversed(nodes):
        mask = bit[node]
        for user in node.users:
            mask |= reach[user]
        reach[node] = mask
    return bit, reach


class _Search:
    """torch.fx's ``propose_partitions`` state: partitions by id, each with its nodes (and
    their reverse-order positions), the nodes using it from outside, the ids it reaches
    (``partition_map``), its age (``partitions_order``), a bit mask of its nodes and a version."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.bit, self.reach = reach_masks(graph)
        self.assignment: dict[torch.fx.Node, int] = {}
        self.partitions: dict[int, Partition] = {}
        self.users: dict[int, set[torch.fx.Node]] = {}
        self.reaches: dict[int, set[int]] = {}
        self.order: dict[int, int] = {}
        self.mask: dict[int, int] = {}
        self.users_mask: dict[int, int] = {}
        self.users_reach: dict[int, int] = {}
        self.version: dict[int, int] = {}
        self.refused: set[tuple] = set()
        self.ids = itertools.count()

    def open(self, node: torch.fx.Node, node_order: int) -> int:
        """A new partition of ``node`` alone; it reaches the partitions downstream of its users."""
        pid = next(self.ids)
        self.order[pid] = pid
        self.assignment[node] = pid
        self.partitions[pid] = Partition(id=pid, nodes=[node], node_orders=[node_order])
        self.mask[pid] = self.bit[node]
        self.version[pid] = 0
        self.set_users(pid, set(node.users), self.reach_of(node.users))
        self.reaches[pid] = set()
        self.reaches[pid].update(self.downstream_ids(self.users_reach[pid], (pid,)))
        return pid

    def set_users(self, pid: int, users: set[torch.fx.Node], reach: int) -> None:
        """``pid``'s outside users, their mask and the mask of all they reach."""
        self.users[pid] = users
        self.users_mask[pid] = sum(self.bit[u] for u in users)
        self.users_reach[pid] = reach

    def reach_of(self, users) -> int:
        """Every node at or downstream of ``users``, as a mask."""
        mask = 0
        for user in users:
            mask |= self.reach[user]
        return mask

    def outside_reach(self, a: int, b: int) -> int:
        """What ``a`` + ``b``'s outside users reach: each side's cached mask, unless some of its
        users are in the other side (then recomputed without them)."""
        mask = 0
        for one, other in ((a, b), (b, a)):
            if self.users_mask[one] & self.mask[other]:
                inside = self.partitions[other].nodes
                mask |= self.reach_of(u for u in self.users[one] if u not in inside)
            else:
                mask |= self.users_reach[one]
        return mask

    def outside_users(self, a: int, b: int) -> set[torch.fx.Node]:
        """torch.fx's ``all_user_nodes``: the users of ``a`` or ``b`` in neither (a partition's
        users are never its own nodes)."""
        a_nodes, b_nodes = self.partitions[a].nodes, self.partitions[b].nodes
        return {u for u in self.users[a] if u not in b_nodes} | {u for u in self.users[b] if u not in a_nodes}

    def downstream_ids(self, mask: int, sources: tuple[int, ...]) -> set[int]:
        """The partitions with a node in ``mask`` (what some users reach), with the ids they
        reach, less ``sources``.  torch.fx walks every downstream node of the users."""
        found: set[int] = set()
        for pid, nodes in self.mask.items():
            if nodes & mask:
                found.add(pid)
                found.update(self.reaches[pid])
        found.difference_update(sources)
        return found

    def forms_cycle(self, a: int, b: int, mask: int) -> bool:
        """Whether ``a`` + ``b`` would be upstream of itself: a node in ``mask`` (at or downstream
        of their outside users) is in ``a`` or ``b``, or in a partition that reaches ``a`` or ``b``.

        Before::  A ─► x ─► B     (x unsupported)   After:: True (A+B ─► x ─► A+B)
        """
        if mask & (self.mask[a] | self.mask[b]):
            return True
        return any(nodes & mask and (a in self.reaches[pid] or b in self.reaches[pid])
                   for pid, nodes in self.mask.items())

    def try_merge(self, self_id: int, other_id: int) -> int:
        """Merge ``other_id`` and ``self_id`` unless that makes a cycle; the id kept (the larger's).

        A refusal is remembered: it holds while neither partition changes, because
        their outside users (so the mask of what they reach) are fixed, and the
        partitions that could close a cycle only grow (a merge of two others keeps
        the union of what they reach; a new partition only adds nodes).
        """
        key = (min(self_id, other_id), max(self_id, other_id), self.version[self_id], self.version[other_id])
        if key in self.refused:
            return self_id
        mask = self.outside_reach(self_id, other_id)
        if self.forms_cycle(self_id, other_id, mask):
            self.refused.add(key)
            return self_id
        merge_id, removed_id = self_id, other_id
        if len(self.partitions[self_id].nodes) < len(self.partitions[other_id].nodes):
            merge_id, removed_id = removed_id, merge_id
        self.absorb(merge_id, removed_id, self.outside_users(self_id, other_id), mask)
        return merge_id

    def absorb(self, merge_id: int, removed_id: int, outside: set[torch.fx.Node], mask: int) -> None:
        """Move ``removed_id``'s nodes into ``merge_id`` (torch.fx's bookkeeping, step by step);
        ``outside``: the users of both in neither, ``mask``: what they reach."""
        removed = self.partitions.pop(removed_id)
        self.partitions[merge_id].nodes.update(removed.nodes)
        for node in removed.nodes:
            self.assignment[node] = merge_id
        self.order[merge_id] = min(self.order[merge_id], self.order.pop(removed_id))
        self.reaches[merge_id] = self.reaches[merge_id] | self.reaches.pop(removed_id)
        for table in (self.users, self.users_mask, self.users_reach, self.version):
            del table[removed_id]
        self.set_users(merge_id, outside, mask)
        self.mask[merge_id] |= self.mask.pop(removed_id)
        self.version[merge_id] += 1
        self.reaches[merge_id].update(self.downstream_ids(mask, (merge_id, removed_id)))
        self.reaches[merge_id].discard(merge_id)
        self.reaches[merge_id].discard(removed_id)

    def merge_all(self, first: int | None) -> None:
        """torch.fx's step after each node: ``first`` (a new partition, if any), then every
        partition by age, each merged into the running one unless that makes a cycle."""
        candidates = dict.fromkeys([] if first is None else [first])
        for pid, _ in sorted(self.order.items(), key=operator.itemgetter(1)):
            candidates[pid] = None
        ids = list(candidates)
        self_id = ids[0] if ids else None
        for other_id in ids[1:]:
            self_id = self.try_merge(self_id, other_id)


def _reassign_getitems(graph: torch.fx.Graph, search: _Search) -> None:
    """torch.fx's post-pass: the getitems of a tuple-producing node join its partition (or none).

    Before::  %split {P0}   %getitem = getitem(%split, 0) {P1}
    After::   %split {P0}   %getitem {P0}
    """
    assignment, partitions = search.assignment, search.partitions
    while True:
        moves: dict[torch.fx.Node, int | None] = {}
        for node in graph.nodes:
            if all(u.op == "call_function" and _qualified_name(u.target) == "_operator.getitem" for u in node.users):
                pid = assignment.get(node)
                for user in node.users:
                    if assignment.get(user) != pid:
                        moves[user] = pid
        if not moves:
            return
        for node, pid in moves.items():
            if node in assignment:
                partitions[assignment[node]].remove_node(node)
            if pid is None:
                assignment.pop(node)
            else:
                assignment[node] = pid
                partitions[pid].add_node(node, None)


def _drop_single_node_partitions(partitions: dict[int, Partition]) -> None:
    """torch.fx's ``allows_single_node_partition=False``: drop partitions of at most one compute node."""
    for pid in [pid for pid, part in partitions.items() if _compute_nodes(part) <= 1]:
        del partitions[pid]


def _compute_nodes(part: Partition) -> int:
    return sum(
        1 for n in part.nodes
        if n.op == "call_function" and _qualified_name(n.target) not in NON_COMPUTE_OPS
    )


def propose_partitions(
    graph_module: torch.fx.GraphModule,
    is_supported: Callable[[torch.fx.Node], bool],
    *,
    allows_single_node_partition: bool = False,
) -> list[Partition]:
    """torch.fx's ``CapabilityBasedPartitioner(graph_module, support, allows_single_node_partition)
    .propose_partitions()`` (no horizontal-fusion skip, default non-compute ops), ``support``
    asking ``is_supported(node)``: the same partitions, in the same order."""
    graph = graph_module.graph
    search = _Search(graph)
    for node_order, node in enumerate(reversed(graph.nodes)):
        first = search.open(node, node_order) if is_supported(node) and node not in search.assignment else None
        search.merge_all(first)
    for part in search.partitions.values():
        part.nodes = dict(sorted(part.nodes.items(), key=operator.itemgetter(1), reverse=True))
    _reassign_getitems(graph, search)
    if not allows_single_node_partition:
        _drop_single_node_partitions(search.partitions)
    return [part for part in search.partitions.values() if part.size() > 0]
