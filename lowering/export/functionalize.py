"""Stage 1's fast path, functionalization: in-place ops become functional ones.

:func:`rewrite_tensor_constant_ops` does what functionalization makes of
``torch.tensor(...)``; :func:`functionalize_mutations` replaces an in-place op
on a buffer or on an unaliased intermediate by its functional variant (a
buffer's new value becomes a ``BUFFER_MUTATION`` output);
:func:`remove_buffer_copies` drops the ``copy`` a ``buf.copy_(src)`` leaves.
Anything else (mutation through a view, of a user input, ...) raises
:class:`~lowering.export.fallback.Fallback`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

from .fallback import Fallback


def rewrite_tensor_constant_ops(graph: torch.fx.Graph) -> int:
    """What functionalization makes of ``torch.tensor(...)`` in ``forward``; returns the count.

    ``lift_fresh_copy`` becomes ``clone``; ``detach_`` (only changes autograd
    metadata, and the edge form has none) is dropped.

    Before::

        %lift_fresh_copy = aten.lift_fresh_copy.default(%c_lifted_tensor_0)
        %detach_ = aten.detach_.default(%lift_fresh_copy)
        %mul = aten.mul.Tensor(%x, %detach_)

    After::

        %lift_fresh_copy = aten.clone.default(%c_lifted_tensor_0)
        %mul = aten.mul.Tensor(%x, %lift_fresh_copy)
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.lift_fresh_copy.default:
            node.target = torch.ops.aten.clone.default
            count += 1
        elif node.target is torch.ops.aten.detach_.default and isinstance(node.args[0], torch.fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            count += 1
    return count


def functionalize_mutations(
    graph: torch.fx.Graph,
    input_specs: list[InputSpec],
    output_specs: list[OutputSpec],
    fake_mode: Any,
) -> list[OutputSpec]:
    """Replace in-place ops by their functional variants; returns the new output specs.

    Handles an in-place op whose mutated argument (``self``) is a buffer
    placeholder or the result of a functional, non-aliasing op, when nothing
    aliases that tensor (no view of it anywhere).  Later uses of the tensor
    read the new value; a buffer's last value becomes a ``BUFFER_MUTATION``
    output (first, in input order, as functionalization orders them).
    Anything else raises ``Fallback``.

    Before::

        %add_ = aten.add_.Tensor(%b_acc, %sum_1)
        %add = aten.add.Tensor(%mul, %add_)
        return (add,)                                # USER_OUTPUT

    After::

        %add_1 = aten.add.Tensor(%b_acc, %sum_1)
        %add = aten.add.Tensor(%mul, %add_1)
        return (add_1, add)                          # BUFFER_MUTATION 'acc', USER_OUTPUT
    """
    kind_of = {s.arg.name: s for s in input_specs if isinstance(s.arg, TensorArgument)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    root_of: dict[torch.fx.Node, torch.fx.Node] = {}
    last_value: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        custom = node.target.namespace != "aten"
        functional = None if custom else _functional_variant(node.target)
        mutated = _custom_mutated_arg(node) if custom else node.args[0] if node.args else None
        if (functional is None and not custom) or not isinstance(mutated, torch.fx.Node):
            raise Fallback(f"in-place op {node.target} at {node.name!r}")
        root = root_of.get(mutated, mutated)
        if root.op == "placeholder":
            spec = kind_of.get(root.name)
            if spec is None or spec.kind != InputKind.BUFFER:
                raise Fallback(f"{node.target} at {node.name!r} mutates a non-buffer input")
        elif not _is_functional_call(mutated):
            raise Fallback(f"{node.target} at {node.name!r} mutates the output of {mutated.target}")
        if any(is_aliasing_call(u) for u in mutated.users if u is not node):
            raise Fallback(f"{node.target} at {node.name!r} mutates a tensor that has views")
        if custom:
            new = _auto_functionalized(graph, node, mutated, fake_mode)
        else:
            with graph.inserting_before(node):
                new = graph.create_node("call_function", functional, node.args, node.kwargs,
                                        name=functional._opname)
            new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
            with fake_mode:
                new.meta["val"] = functional(*_vals(node.args), **_vals(node.kwargs))
        order[new] = order[node]
        if custom:
            order[new.args[0]] = order[node]  # the auto_functionalized_v2 call reads the old value
        for user in list(mutated.users):
            if user is not node and user is not new and order[user] > order[node]:
                user.replace_input_with(mutated, new)
        if not custom:
            node.replace_all_uses_with(new)
        graph.erase_node(node)
        root_of[new] = root
        if root.op == "placeholder":
            last_value[root] = new
    if not last_value:
        return output_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mutated_buffers = [p for p in placeholders if p in last_value]
    out = graph.output_node()
    values = list(out.args[0])
    out.args = ((*[last_value[p] for p in mutated_buffers], *values),)
    mutation_specs = [
        OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(last_value[p].name), kind_of[p.name].target)
        for p in mutated_buffers
    ]
    return [*mutation_specs, *output_specs]


def remove_buffer_copies(graph: torch.fx.Graph, output_specs: list[OutputSpec]) -> int:
    """A buffer's new value that is a same-shape, same-dtype ``copy`` of ``src`` is ``src``.

    ``buf.copy_(src)`` functionalizes to ``copy(buf, src)``; ``run_decompositions``
    drops that copy (``_remove_unnecessary_copy_op_pass``), so the fast path
    does too.  Returns the count.

    Before::

        %copy = aten.copy.default(%b_c, %select)
        return (copy, ...)                       # BUFFER_MUTATION 'c'

    After::

        return (select, ...)                     # BUFFER_MUTATION 'c'
    """
    out = graph.output_node()
    values = list(out.args[0])
    count = 0
    for spec, value in zip(output_specs, values):
        if spec.kind != OutputKind.BUFFER_MUTATION or not isinstance(value, torch.fx.Node):
            continue
        if value.op != "call_function" or value.target is not torch.ops.aten.copy.default:
            continue
        dst, src = value.args[0], value.args[1]
        if not isinstance(src, torch.fx.Node) or value.kwargs.get("non_blocking"):
            continue
        a, b = dst.meta.get("val"), src.meta.get("val")
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            continue
        value.replace_all_uses_with(src)
        graph.erase_node(value)
        count += 1
    return count


def _custom_mutated_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one tensor a custom op (not ATen) writes, passed by position; None otherwise."""
    written = [i for i, a in enumerate(node.target._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or node.kwargs or written[0] >= len(node.args):
        return None
    if any(r.alias_info is not None for r in node.target._schema.returns):
        return None
    return node.args[written[0]]


def _auto_functionalized(graph: torch.fx.Graph, node: torch.fx.Node, mutated: torch.fx.Node,
                         fake_mode: Any) -> torch.fx.Node:
    """What functionalization makes of a custom op writing one whole tensor (not a view):
    an ``auto_functionalized_v2`` call and a ``getitem`` of the new value, which is returned;
    a ``getitem`` of the op's own result replaces ``node`` where it is read.

    Before::

        %update_cache = llama.update_cache.default(%value, %b_key_cache_0, %start_pos)

    After::

        %auto_functionalized_v2 = higher_order.auto_functionalized_v2(llama.update_cache.default,
            value=%value, start_pos=%start_pos, _cache_base_index=0, _all_bases=[%b_key_cache_0])
        %getitem_1 = getitem(%auto_functionalized_v2, 1)    # the cache's new value
    """
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    schema = node.target._schema
    kwargs: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else arg.default_value
        if value is not mutated:
            kwargs[arg.name] = value
        else:
            name = arg.name
    kwargs[f"_{name}_base_index"] = 0
    kwargs["_all_bases"] = [mutated]
    meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    with graph.inserting_before(node):
        call = graph.create_node("call_function", auto_functionalized_v2, (node.target,), kwargs,
                                 name="auto_functionalized_v2")
        with fake_mode:
            call.meta = {**meta, "val": auto_functionalized_v2(node.target, **_vals(kwargs))}
        if node.users:
            result = graph.create_node("call_function", operator.getitem, (call, 0), name="getitem")
            result.meta = {**meta, "val": call.meta["val"][0]}
            node.replace_all_uses_with(result)
        new = graph.create_node("call_function", operator.getitem, (call, 1), name="getitem")
        new.meta = {**meta, "val": call.meta["val"][1]}
    return new


def _functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``: same arguments, only ``self`` written."""
    schema = op._schema
    if not schema.name.startswith("aten::") or not schema.name.endswith("_"):
        return None
    args = schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in args[1:]):
        return None
    packet = getattr(torch.ops.aten, schema.name[len("aten::") : -1], None)
    if packet is None:
        return None
    functional = getattr(packet, schema.overload_name or "default", None)
    if functional is None or functional._schema.is_mutable:
        return None
    theirs = functional._schema.arguments
    if [(a.name, str(a.type)) for a in theirs] != [(a.name, str(a.type)) for a in args]:
        return None
    return functional


def is_aliasing_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns (or may return) an alias of an input."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _is_functional_call(node: torch.fx.Node) -> bool:
    """A call of an ATen op that neither mutates nor aliases (or a getitem of one)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_functional_call(node.args[0])
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and not node.target._schema.is_mutable
        and not is_aliasing_call(node)
    )


def _vals(tree: Any) -> Any:
    return torch.fx.node.map_arg(tree, lambda n: n.meta["val"])
