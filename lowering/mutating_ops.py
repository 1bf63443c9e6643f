"""Graph queries for a custom op that mutates its argument in place, as export leaves it.

torch.export functionalizes a mutating custom op (schema ``Tensor(a!) cache``)
into the ``auto_functionalized_v2`` higher-order op (``auto_functionalized`` in
older forms): the op's results, then each mutated base's new value::

    %afv2 = auto_functionalized_v2(llama.update_cache.default, value=%k, start_pos=%s,
                                   _cache_base_index=0, _all_bases=[%b_key_cache_0])
    %getitem_1 = getitem(%afv2, 1)          # new value of b_key_cache_0 (a BUFFER_MUTATION output)

The runtime calls the op's ``.out`` variant instead, writing the base in place:
``llama::update_cache.out(k, b_key_cache_0, s, out=%afv2.0)``; the new value
``%afv2.1`` *is* the base (memory plan aliases it, emit reuses its value), so no
copy and no write-back.  Only whole bases qualify (a mutated view of a base
raises).  Imports no stage.
"""

from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

from .errors import LoweringError


def is_auto_functionalized(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls ``auto_functionalized(_v2)``."""
    return node.op == "call_function" and node.target in (auto_functionalized, auto_functionalized_v2)


def mutating_op(node: torch.fx.Node) -> torch._ops.OpOverload:
    """The functionalized op of an ``auto_functionalized(_v2)`` node."""
    return node.args[0]


def mutated_bases(node: torch.fx.Node) -> list[tuple[str, torch.fx.Node]]:
    """``(argument name, base node)`` per mutated argument, in the op's schema order.

    Output ``len(op results) + i`` of the node is the new value of base ``i``.
    """
    op, kwargs = mutating_op(node), node.kwargs
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    bases: list[tuple[str, torch.fx.Node]] = []
    for name in mutable:
        if node.target is auto_functionalized:
            base = kwargs.get(name)
        else:
            index = kwargs.get(f"_{name}_base_index")
            view_keys = [k for k in kwargs if k.startswith(f"_{name}_") and k != f"_{name}_base_index"]
            if view_keys:
                raise LoweringError(f"node {node.name!r}: {op} mutates a view of a tensor ({view_keys}); "
                                    "only whole tensors are supported")
            base = None if index is None else kwargs["_all_bases"][index]
        if not isinstance(base, torch.fx.Node):
            raise LoweringError(f"node {node.name!r}: {op} argument {name!r} is not a tensor of the graph")
        bases.append((name, base))
    return bases


def op_arguments(node: torch.fx.Node) -> dict[str, object]:
    """The op's arguments by schema name: the node's kwargs, mutated ones as their bases."""
    args = {k: v for k, v in node.kwargs.items() if not k.startswith("_")}
    args.update(dict(mutated_bases(node)))
    return args


def num_op_results(node: torch.fx.Node) -> int:
    """How many of the node's outputs are the op's own results (the rest are new bases)."""
    return len(mutating_op(node)._schema.returns)


def out_variant(node: torch.fx.Node) -> str | None:
    """``"llama::update_cache.out"`` for a node of ``llama.update_cache.default``; None without one."""
    op = mutating_op(node)
    packet = getattr(getattr(torch.ops, op.namespace), op._schema.name.partition("::")[2])
    return f"{op._schema.name}.out" if "out" in packet.overloads() else None


# --------------------------------------------------------------------------- write-first caches

#: The in-place cache write and the only reader that reads nothing it was not written first.
_CACHE_WRITE = "llama::update_cache"
_CACHE_READ = "llama::custom_sdpa"


def write_first_buffers(graph: torch.fx.Graph, buffer_mutations: set[str]) -> set[str]:
    """Placeholders of mutated buffers whose initial value no call ever reads.

    A KV cache of the custom-attention decoder is one::

        %afv2 = auto_functionalized_v2(llama.update_cache, value=%k, start_pos=%s, _all_bases=[%b_key_cache_0])
        %new = getitem(%afv2, 1)                                 # a BUFFER_MUTATION output
        %o = llama.custom_sdpa(%q, %new, %v_new, %s, None, ...)  # reads rows < s + S only

    ``update_cache`` writes rows ``[s, s+S)`` and ``custom_sdpa`` (no mask) reads
    rows ``< s+S`` at the same ``s``; rows ``< s`` were written by the runner's
    earlier calls.  So the buffer needs no stored initial value (ExecuTorch
    stores none).  Conservative: any other user (another op, a mask, a user
    output, a different ``start_pos``) keeps the buffer out of the set.
    ``buffer_mutations`` names the graph's BUFFER_MUTATION output nodes.
    """
    found = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.users and all(
                _writes_then_reads(user, node, buffer_mutations) for user in node.users):
            found.add(node.name)
    return found


def _schema_name(node: torch.fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else ""


def _writes_then_reads(write: torch.fx.Node, base: torch.fx.Node, buffer_mutations: set[str]) -> bool:
    """Whether ``write`` updates ``base`` with ``llama::update_cache`` and only custom_sdpa reads the result."""
    if not is_auto_functionalized(write) or mutating_op(write)._schema.name != _CACHE_WRITE:
        return False
    args = op_arguments(write)
    if args.get("cache") is not base or args.get("value") is base:
        return False
    new_value = num_op_results(write)  # the cache is the op's only mutated base
    for item in write.users:
        if item.target is not operator.getitem or item.args[1] != new_value:
            return False
        for reader in item.users:
            if reader.op == "output":
                outputs = torch.fx.node.map_aggregate(reader.args, lambda a: a)
                if item.name not in buffer_mutations or _count(outputs, item) != 1:
                    return False
            elif not _reads_prefix(reader, item, args.get("start_pos")):
                return False
    return True


def _reads_prefix(reader: torch.fx.Node, cache: torch.fx.Node, start_pos: object) -> bool:
    """``llama::custom_sdpa(q, k_cache, v_cache, start_pos, None, ...)`` with ``cache`` as k or v only."""
    if _schema_name(reader) != _CACHE_READ or reader.kwargs:
        return False
    args = reader.args
    if len(args) < 4 or args[0] is cache or args[3] is not start_pos:
        return False
    return (len(args) < 5 or args[4] is None) and all(a is not cache for a in args[5:])


def _count(tree: object, node: torch.fx.Node) -> int:
    if isinstance(tree, (list, tuple)):
        return sum(_count(t, node) for t in tree)
    return int(tree is node)
