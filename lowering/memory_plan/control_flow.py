"""Stage 7's control-flow case: the values of cond branches and map bodies.

A program with ``cond`` / ``map`` also plans the values of their branches and
bodies (keys ``"<submodule>/<node>"``) on one timeline in emission order (a
branch's steps nested inside its node's span); a branch's result shares
memory with the cond's output it is moved to.  :func:`plan_control_flow` is
what :func:`lowering.memory_plan.plan.memory_plan` calls instead of
:func:`~lowering.memory_plan.values.compute_lifetimes` when the program has
control flow.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from ..control_flow_graph import COND, SCOPE_SEPARATOR, Submodule, control_flow_nodes, is_control_flow, submodules_of
from .out_variants import find_out_variants
from .values import ValueTable, input_nodes, tensor_value, value_key


def plan_control_flow(
    ep: ExportedProgram,
    table: ValueTable,
    alignment: int,
    out_variants: dict[str, str],
    aliases: dict[str, str],
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Lifetimes and placement bases when the program has cond / map submodules.

    Adds the submodules' values to ``table`` and their out variants (keys
    ``"<submodule>/<node>"``) to ``out_variants``.
    """
    flow = plan_control_flow_values(ep, table, alignment)
    out_variants.update(flow.out_variants)
    own = control_flow_lifetimes(ep, table)
    return resolve_shared_lifetimes(own, aliases, flow)


@dataclass
class ControlFlowValues:
    """What :func:`plan_control_flow_values` adds to the top level's value table.

    ``shared`` maps a branch result to the cond output it is moved to (they
    are placed at the same offset: the MoveCall then moves a tensor onto its
    own memory); ``moved`` lists (source key, cond output key) pairs that
    cannot share (a branch returning an operand): the source lives as long as
    the output does.
    """

    out_variants: dict[str, str]
    shared: dict[str, str]
    moved: list[tuple[str, str]]


def plan_control_flow_values(ep: ExportedProgram, table: ValueTable, alignment: int) -> ControlFlowValues:
    """Add the values of every submodule to ``table`` (in place).

    A submodule placeholder names its operand's value (no memory of its own),
    except map's slice placeholder, which is a planned tensor the loop writes
    each iteration.  Every op result inside gets the key
    ``"<submodule>/<node name>"`` (``"<submodule>/<node>.<i>"`` for output ``i``).
    """
    result = ControlFlowValues({}, {}, [])
    _collect_scope_values(ep.graph_module, "", table, alignment, result)
    return result


def _collect_scope_values(gm, prefix, table, alignment, result) -> None:
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            scope = f"{prefix}{sub.attr}{SCOPE_SEPARATOR}"
            graph = sub.module.graph
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            for placeholder, operand in zip(placeholders, sub.operands):
                if operand is None:  # map's slice: written by the loop, planned here
                    key = scope + placeholder.name
                    table.values[key] = tensor_value(key, placeholder.meta["val"], alignment)
                    table.refs[placeholder] = [key]
                elif isinstance(operand, torch.fx.Node) and operand in table.refs:
                    table.refs[placeholder] = list(table.refs[operand])
            for sub_node in graph.nodes:
                if sub_node.op != "call_function":
                    continue
                if sub_node.target is operator.getitem:
                    source = sub_node.args[0]
                    key = scope + value_key(sub_node)
                    if key in table.values:
                        table.refs[sub_node] = [key]
                    elif source in table.refs and len(table.refs[source]) == 1:
                        table.refs[sub_node] = list(table.refs[source])
                    continue
                val = sub_node.meta.get("val")
                items = {sub_node.name: val} if not isinstance(val, (tuple, list)) else {
                    f"{sub_node.name}.{i}": item for i, item in enumerate(val)
                }
                tensors = [(scope + k, item) for k, item in items.items() if isinstance(item, torch.Tensor)]
                for key, item in tensors:
                    table.values[key] = tensor_value(key, item, alignment)
                if tensors:
                    table.refs[sub_node] = [key for key, _ in tensors]
            for node_name, out in find_out_variants(graph).items():
                result.out_variants[scope + node_name] = out
            _collect_scope_values(sub.module, scope, table, alignment, result)
            if node.target is COND:
                _share_branch_results(node, sub, scope, table, result)


def _share_branch_results(node, sub: Submodule, scope: str, table, result: ControlFlowValues) -> None:
    """Each branch result shares its cond output's memory when it is the branch's own value
    of the same size (returned once); otherwise it is kept alive as long as the output."""
    results = list(sub.module.graph.output_node().args[0])
    outputs = table.refs.get(node, [])
    taken: set[str] = set()
    for value, output_key in zip(results, outputs):
        keys = table.refs.get(value, []) if isinstance(value, torch.fx.Node) else []
        if len(keys) != 1:
            continue  # a constant: moved, needs no memory
        key = keys[0]
        own = key.startswith(scope) and key not in taken and key not in result.shared
        if own and table.values[key].size == table.values[output_key].size:
            result.shared[key] = output_key
            taken.add(key)
        else:
            result.moved.append((key, output_key))


def control_flow_lifetimes(ep: ExportedProgram, table: ValueTable) -> dict[str, tuple[int, int]]:
    """Inclusive (first, last) step of every value on one timeline in emission order.

    Steps are numbered as the instructions run: a cond's true branch, then its
    false branch, then the cond node itself; a map's body, then the map node.
    The values a cond / map reads and the values it returns live over its
    whole span (a map's output is written at every iteration; its operands
    are read at every iteration).  Top-level placeholders start at 0, mutated
    buffers live throughout.
    """
    spans: dict[str, list[int]] = {}
    step = 0

    def touch(keys, first: int, last: int) -> None:
        for key in keys:
            span = spans.setdefault(key, [first, last])
            span[0] = min(span[0], first)
            span[1] = max(span[1], last)

    def walk(gm: torch.fx.GraphModule, top: bool) -> None:
        nonlocal step
        for node in gm.graph.nodes:
            if is_control_flow(node):
                start = step
                for sub in submodules_of(gm, node):
                    walk(sub.module, top=False)
                end = step
                step += 1
                touch(table.refs.get(node, ()), start, end)
                for arg in input_nodes(node):
                    touch(table.refs.get(arg, ()), start, end)
                continue
            first = 0 if (top and node.op == "placeholder") else step
            touch(table.refs.get(node, ()), first, step)
            for arg in input_nodes(node):
                touch(table.refs.get(arg, ()), step, step)
            step += 1

    walk(ep.graph_module, top=True)
    for key in table.mutated:
        spans[key] = [0, step - 1]
    return {key: tuple(spans.get(key, (0, 0))) for key in table.values}


def resolve_shared_lifetimes(
    lifetimes: dict[str, tuple[int, int]],
    aliases: dict[str, str],
    flow: ControlFlowValues,
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Lifetimes after sharing, and every key's placement base (view aliases + shared results).

    A base covers the lifetimes of everything placed on it; a moved source
    covers its cond output's lifetime.
    """
    placed_on = dict(aliases)
    for key, base in flow.shared.items():
        placed_on[key] = aliases.get(base, base)

    def root(key: str) -> str:
        seen = set()
        while key in placed_on and key not in seen:
            seen.add(key)
            key = placed_on[key]
        return key

    placed_on = {key: root(key) for key in placed_on}
    extended = dict(lifetimes)
    for key, base in placed_on.items():
        (b0, b1), (a0, a1) = extended[base], lifetimes[key]
        extended[base] = (min(b0, a0), max(b1, a1))
    for source, output in flow.moved:
        source_base = placed_on.get(source, source)
        (s0, s1), (o0, o1) = extended[source_base], extended[placed_on.get(output, output)]
        extended[source_base] = (min(s0, o0), max(s1, o1))
    for key, base in placed_on.items():  # an alias spans at least its own uses
        extended[key] = lifetimes[key]
    return extended, placed_on
