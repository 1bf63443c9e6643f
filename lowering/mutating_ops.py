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
