"""Stage 7, values: what needs memory, which views share it, and how long each lives.

- :func:`collect_values` lists the planned tensor values (user inputs, mutated
  buffers, every op output) with their sizes, keyed by :func:`value_key`;
- :func:`find_view_aliases` lets a ``view_copy`` share its base's memory;
- :func:`compute_lifetimes` gives each value the inclusive range of graph
  steps from its definition to its last use; :func:`extend_base_lifetimes`
  stretches a base over its aliases' uses.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ..dynamic import DynamicShapeError, is_dynamic, upper_bound_shape
from ..errors import MemoryPlanError
from ..mutating_ops import is_auto_functionalized, mutated_bases, num_op_results


@dataclass(frozen=True)
class TensorValue:
    """One tensor value the program computes or receives: its key and byte sizes."""

    key: str
    nbytes: int
    size: int  # nbytes rounded up to the alignment


@dataclass
class ValueTable:
    """The planned values of a program, in graph order.

    ``refs`` maps each node to the value keys it names (a ``getitem`` names
    one element of its source; a multi-output node names all its outputs);
    ``mutated`` holds the keys of mutated buffers.
    """

    values: dict[str, TensorValue]
    refs: dict[torch.fx.Node, list[str]]
    mutated: set[str]


def collect_values(ep: ExportedProgram, alignment: int, shared: Iterable[str] = ()) -> ValueTable:
    """User inputs, mutated buffers and every op output; constants are left out.

    A tensor with symbolic sizes (dynamic shapes) is sized at its upper bound
    (every symbol at the max of its ``range_constraints``); one without an
    upper bound raises :class:`MemoryPlanError` naming the value.  Buffers named
    in ``shared`` (shared state) are planned too, even where this method only
    reads them.
    """
    planned_inputs, mutated_inputs = _planned_inputs(ep, shared)
    values: dict[str, TensorValue] = {}
    refs: dict[torch.fx.Node, list[str]] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name not in planned_inputs:
            continue
        if node.op not in ("placeholder", "call_function"):
            continue
        if _is_getitem(node):
            key = value_key(node)
            if key in values:
                refs[node] = [key]
            continue
        val = node.meta.get("val")
        items = {node.name: val} if not isinstance(val, (tuple, list)) else {
            f"{node.name}.{i}": item for i, item in enumerate(val)
        }
        keys = [key for key, item in items.items() if isinstance(item, torch.Tensor)]
        for key in keys:
            values[key] = tensor_value(key, items[key], alignment, ep.range_constraints)
        if keys:
            refs[node] = keys
    return ValueTable(values, refs, mutated_inputs)


def _planned_inputs(ep: ExportedProgram, shared: Iterable[str] = ()) -> tuple[set[str], set[str]]:
    """Placeholder names that get memory (user inputs, mutated or shared buffers),
    and the state buffers among them.  Parameters, lifted constants and buffers
    that are never mutated (nor shared) are constants."""
    sig = ep.graph_signature
    mutated_fqns = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    mutated_fqns |= set(shared)
    planned: set[str] = set()
    mutated: set[str] = set()
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind == InputKind.USER_INPUT:
            planned.add(name)
        elif spec.kind == InputKind.BUFFER and spec.target in mutated_fqns:
            planned.add(name)
            mutated.add(name)
    return planned, mutated


def value_key(node: torch.fx.Node) -> str:
    """The value key a node names: ``getitem(src, i)`` names ``"src.i"``."""
    if _is_getitem(node) and isinstance(node.args[0], torch.fx.Node):
        source, index = node.args
        if isinstance(source.meta.get("val"), (tuple, list)):
            return f"{source.name}.{index}"
    return node.name


def tensor_value(key: str, val: torch.Tensor, alignment: int, ranges=None) -> TensorValue:
    """``val``'s byte sizes; a dynamic shape at its upper bound."""
    try:
        shape = upper_bound_shape(val, ranges, what=f"value {key!r}")
    except DynamicShapeError as exc:
        raise MemoryPlanError(f"cannot plan memory at the upper bound: {exc}") from None
    nbytes = functools.reduce(operator.mul, shape, 1) * val.element_size()
    return TensorValue(key, nbytes, _align(nbytes, alignment))


def find_view_aliases(graph: torch.fx.Graph, table: ValueTable) -> dict[str, str]:
    """``view_copy`` outputs that share their base's memory: view key -> base key.

    As in ExecuTorch's ``ReplaceViewCopyWithViewPass``, a view that feeds the
    graph output keeps its own copy; chains resolve to the root base.  Only
    planned bases qualify (a view of a constant stays a planned copy), and
    only static shapes: a dynamic view's shape changes at run time, which an
    aliased tensor (no instruction) could not follow.
    """
    aliases: dict[str, str] = {}
    for node in graph.nodes:
        if node.target is not torch.ops.aten.view_copy.default or node.name not in table.values:
            continue
        if any(user.op == "output" for user in node.users):
            continue
        if is_dynamic(node.meta.get("val")) or is_dynamic(getattr(node.args[0], "meta", {}).get("val")):
            continue
        base_keys = table.refs.get(node.args[0], [])
        if len(base_keys) != 1:
            continue
        root = aliases.get(base_keys[0], base_keys[0])
        if table.values[root].nbytes == table.values[node.name].nbytes:
            aliases[node.name] = root
    return aliases


def find_mutation_aliases(graph: torch.fx.Graph, table: ValueTable) -> dict[str, str]:
    """The new values of bases an ``auto_functionalized(_v2)`` op mutates: key -> base key.

    The op's ``.out`` variant writes the base in place (:mod:`lowering.mutating_ops`),
    so output ``"<node>.<n + i>"`` (n = the op's own results) is base ``i``'s memory.
    """
    aliases: dict[str, str] = {}
    for node in graph.nodes:
        if not is_auto_functionalized(node):
            continue
        first = num_op_results(node)
        for i, (_, base) in enumerate(mutated_bases(node)):
            base_keys = table.refs.get(base, [])
            key = f"{node.name}.{first + i}"
            if len(base_keys) != 1 or key not in table.values:
                raise MemoryPlanError(f"node {node.name!r} mutates {base.name!r}, which is not planned "
                                      "memory (a parameter or a constant?)")
            aliases[key] = base_keys[0]
    return aliases


def compute_lifetimes(graph: torch.fx.Graph, table: ValueTable) -> dict[str, tuple[int, int]]:
    """Each value's inclusive (first, last) step; step = node index in graph order.

    A value lives from its defining node to the last node that reads it
    (uses through ``getitem`` count); placeholders start at 0, graph outputs
    live to the output node, mutated buffers live throughout.
    """
    nodes = list(graph.nodes)
    spans: dict[str, list[int]] = {}
    for step, node in enumerate(nodes):
        touched = list(table.refs.get(node, ()))
        for arg in input_nodes(node):
            touched.extend(table.refs.get(arg, ()))
        first = 0 if node.op == "placeholder" else step
        for key in touched:
            span = spans.setdefault(key, [first, step])
            span[1] = step
    for key in table.mutated:
        spans[key] = [0, len(nodes) - 1]
    return {key: tuple(spans[key]) for key in table.values}


def extend_base_lifetimes(
    lifetimes: Mapping[str, tuple[int, int]], aliases: Mapping[str, str]
) -> dict[str, tuple[int, int]]:
    """Lifetimes in which each base also covers every use of its aliases."""
    extended = dict(lifetimes)
    for alias, base in aliases.items():
        (b0, b1), (a0, a1) = extended[base], lifetimes[alias]
        extended[base] = (min(b0, a0), max(b1, a1))
    return extended


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` reads (args and kwargs, flattened)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found



def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
