"""Stage 4 — build the ExportedProgram of one partition from its fused submodule.

Before (top level, after stage 3; ``p_w`` and ``b_acc`` tagged T)::

    %fused_0 = call_module[fused_0](%x, %p_w, %b_acc)
    %getitem   = getitem(%fused_0, 0)      # new value of acc
    %getitem_1 = getitem(%fused_0, 1)
    return (%getitem [BUFFER_MUTATION acc], %getitem_1 [USER_OUTPUT])

After — the partition's own program::

    placeholders: %p_w [PARAMETER w], %b_acc [BUFFER acc], %x [USER_INPUT]
    return (%add [BUFFER_MUTATION acc], %mul [USER_OUTPUT])
    state_dict: {w, acc}

plus a :class:`DelegateIO` that tells stage 6 how to rewire the top level:
user inputs to pass, consumed placeholders to drop, and for each submodule
output its index among the delegate's outputs (``None`` when it was only the
consumed buffer's mutation, which now happens inside the delegate).

Control flow's case: :func:`submodule_program` wraps a cond branch / map body
as a program of its own (every placeholder a user input), which to_backend
partitions like any other.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils import _pytree as pytree

from .errors import SubmoduleError
from .delegation import TAG

_KIND_ORDER = {
    InputKind.PARAMETER: 0,
    InputKind.BUFFER: 1,
    InputKind.CONSTANT_TENSOR: 2,
    InputKind.USER_INPUT: 3,
}


@dataclasses.dataclass
class DelegateIO:
    """How a partition's program connects to the top-level graph."""

    #: top-level nodes passed to the delegate, in the program's user-input order
    user_inputs: list[torch.fx.Node]
    #: top-level placeholders whose data moved into the partition's program
    consumed_placeholders: list[torch.fx.Node]
    #: buffer targets whose mutation moved inside the delegate
    consumed_mutations: list[str]
    #: submodule output index -> index in the delegate's outputs, or None
    output_index: dict[int, int | None]


def create_exported_program_from_submodule(
    exported_program: ExportedProgram, call: torch.fx.Node, tag: str
) -> tuple[ExportedProgram, DelegateIO]:
    """The partition's program: consumed constants become its params/buffers/constants."""
    submodule = getattr(exported_program.graph_module, call.target)
    graph = submodule.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    top_specs = {
        s.arg.name: s for s in exported_program.graph_signature.input_specs if hasattr(s.arg, "name")
    }

    inputs = []  # (kind, placeholder, top-level node, top-level spec or None)
    for placeholder, top in zip(placeholders, call.args):
        spec = top_specs.get(top.name) if top.op == "placeholder" else None
        consumed = (
            spec is not None
            and spec.kind in _KIND_ORDER
            and spec.kind != InputKind.USER_INPUT
            and top.meta.get(TAG) == tag
        )
        kind = spec.kind if consumed else InputKind.USER_INPUT
        inputs.append((kind, placeholder, top, spec if consumed else None))
    inputs.sort(key=lambda item: _KIND_ORDER[item[0]])  # stable within a kind
    _reorder_placeholders(graph, [p for _, p, _, _ in inputs])

    consumed_buffers = {spec.target for kind, _, _, spec in inputs if kind == InputKind.BUFFER}
    output_specs, output_values, consumed_mutations, output_index = _outputs(
        exported_program, call, graph, consumed_buffers
    )
    old_output = graph.output_node()
    with graph.inserting_before(old_output):
        graph.output(tuple(output_values))
    graph.erase_node(old_output)
    graph.lint()
    submodule.recompile()

    state_dict, constants = {}, {}
    input_specs = []
    for kind, placeholder, _, spec in inputs:
        if kind == InputKind.USER_INPUT:
            input_specs.append(InputSpec(kind, TensorArgument(placeholder.name), None))
            continue
        input_specs.append(
            InputSpec(kind, TensorArgument(placeholder.name), spec.target, spec.persistent)
        )
        source = exported_program.constants if spec.target in exported_program.constants else exported_program.state_dict
        table = constants if source is exported_program.constants else state_dict
        table[spec.target] = source[spec.target]

    user_inputs = [p for kind, p, _, _ in inputs if kind == InputKind.USER_INPUT]
    user_outputs = [v for s, v in zip(output_specs, output_values) if s.kind == OutputKind.USER_OUTPUT]
    program = ExportedProgram(
        root=submodule,
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict=state_dict,
        range_constraints=_used_ranges(graph, exported_program.range_constraints),
        module_call_graph=[module_call_entry(user_inputs, user_outputs)],
        constants=constants,
    )
    io = DelegateIO(
        user_inputs=[top for kind, _, top, _ in inputs if kind == InputKind.USER_INPUT],
        consumed_placeholders=[top for kind, _, top, _ in inputs if kind != InputKind.USER_INPUT],
        consumed_mutations=consumed_mutations,
        output_index=output_index,
    )
    return program, io


def _used_ranges(graph: torch.fx.Graph, ranges: Mapping[Any, Any]) -> dict[Any, Any]:
    """The parent's symbol ranges (dynamic shapes) that the partition's values use: a
    stored partition program keeps its upper bounds (memory is planned at them)."""
    used: set[Any] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        for item in val if isinstance(val, (tuple, list)) else [val]:
            sizes = item.shape if isinstance(item, torch.Tensor) else [item]
            for size in sizes:
                if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    used |= size.node.expr.free_symbols
    return {symbol: r for symbol, r in ranges.items() if symbol in used}


def _reorder_placeholders(graph: torch.fx.Graph, ordered: list[torch.fx.Node]) -> None:
    """Move placeholders to the front of ``graph`` in ``ordered`` order (they have no inputs)."""
    for placeholder in reversed(ordered):
        first = next(iter(graph.nodes))
        if first is not placeholder:
            first.prepend(placeholder)


def _outputs(exported_program, call, graph, consumed_buffers):
    """Output specs of the partition's program: consumed mutations first, then user outputs."""
    sub_outputs = list(graph.output_node().args[0])
    getitems = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    if len(getitems) != len(call.users):
        raise SubmoduleError(f"submodule {call.target!r} has a user that is not a getitem")
    top_output = exported_program.graph.output_node()
    top_specs = exported_program.graph_signature.output_specs

    mutations, user = [], []
    for i, value in enumerate(sub_outputs):
        item = getitems.get(i)
        if item is None:
            raise SubmoduleError(f"output {i} of submodule {call.target!r} is unused")
        mutated = [
            s.target
            for s, arg in zip(top_specs, top_output.args[0])
            if arg is item and s.kind == OutputKind.BUFFER_MUTATION and s.target in consumed_buffers
        ]
        uses_elsewhere = any(u is not top_output for u in item.users) or any(
            arg is item and not (s.kind == OutputKind.BUFFER_MUTATION and s.target in consumed_buffers)
            for s, arg in zip(top_specs, top_output.args[0])
        )
        for target in mutated:
            mutations.append((target, value))
        if uses_elsewhere or not mutated:
            user.append((i, value))

    specs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(v.name), t) for t, v in mutations]
    specs += [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(v.name), None) for _, v in user]
    values = [v for _, v in mutations] + [v for _, v in user]
    index: dict[int, int | None] = {i: None for i in range(len(sub_outputs))}
    for position, (i, _) in enumerate(user):
        index[i] = position
    return specs, values, [t for t, _ in mutations], index


def module_call_entry(user_inputs, user_outputs) -> ModuleCallEntry:
    """The module call graph entry of a program called as ``f(*user_inputs) -> tuple(user_outputs)``."""
    _, in_spec = pytree.tree_flatten((tuple(range(len(user_inputs))), {}))
    _, out_spec = pytree.tree_flatten(tuple(range(len(user_outputs))))
    signature = ModuleCallSignature(
        inputs=[TensorArgument(p.name) for p in user_inputs],
        outputs=[TensorArgument(v.name) for v in user_outputs],
        in_spec=in_spec,
        out_spec=out_spec,
    )
    return ModuleCallEntry(fqn="", signature=signature)


# ---------------------------------------------------------------------------
# Control flow: a cond branch / map body as a program of its own
# ---------------------------------------------------------------------------


def submodule_program(module: torch.fx.GraphModule) -> ExportedProgram:
    """A submodule as an ExportedProgram: every placeholder a user input, every result a user output.

    A partition inside it therefore never consumes a parameter: the weights
    of a branch arrive as inputs (as in ExecuTorch's ``is_submodule`` lowering).
    """
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    results = list(module.graph.output_node().args[0])
    signature = ExportGraphSignature(
        [InputSpec(InputKind.USER_INPUT, TensorArgument(p.name), None) for p in placeholders],
        [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(r.name), None) for r in results],
    )
    return ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=signature,
        state_dict={},
        range_constraints={},
        module_call_graph=[module_call_entry(placeholders, results)],
        constants={},
    )
