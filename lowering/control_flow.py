"""Control flow: ``torch.cond`` and ``torch.map`` through every stage.

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

What each stage does with them (one function each, below):

- export: :func:`check_control_flow` refuses what is not supported, naming the
  node and the model; :func:`for_each_submodule_graph` lets the edge clean-ups
  (view ops to copies, no asserts) apply inside the submodules too;
- to_backend: :func:`lower_control_flow_submodules` runs the partitioner on each
  submodule (wrapped as an ExportedProgram whose inputs are all user inputs)
  and puts the delegated submodule back;
- memory plan: :func:`plan_control_flow_values` gives the submodules' values
  keys ``"<submodule>/<node>"`` and lifetimes on one timeline in emission
  order (a branch's steps nested inside its node's span); a branch's result
  shares memory with the cond's output it is moved to;
- emit: :func:`emit_cond` and :func:`emit_map` inline the submodules as
  ExecuTorch's emitter does, with ``JumpFalseCall`` / ``MoveCall`` and the
  ``executorch_prim`` integer ops for map's loop index.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.export import ExportedProgram

#: The control-flow ops lowerflow lowers.
COND = torch.ops.higher_order.cond
MAP = torch.ops.higher_order.map_impl

#: Separator between a submodule and its node in a value key (``true_graph_0/addmm``).
SCOPE_SEPARATOR = "/"


def _unsupported_ops() -> dict[Any, str]:
    """Higher-order control-flow ops lowerflow refuses, with the reason."""
    hop = torch.ops.higher_order
    found = {}
    for name, why in (
        ("while_loop", "torch.while_loop is not supported (only torch.cond and torch.map)"),
        ("scan", "torch.scan is not supported (only torch.cond and torch.map)"),
        ("associative_scan", "associative_scan is not supported (only torch.cond and torch.map)"),
    ):
        op = getattr(hop, name, None)
        if op is not None:
            found[op] = why
    return found


def is_control_flow(node: torch.fx.Node) -> bool:
    """A ``cond`` or ``map_impl`` call."""
    return node.op == "call_function" and node.target in (COND, MAP)


def control_flow_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The cond / map nodes of ``graph`` (not of its submodules), in graph order."""
    return [n for n in graph.nodes if is_control_flow(n)]


def has_control_flow(graph: torch.fx.Graph) -> bool:
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


# ---------------------------------------------------------------------------
# Stage 1: what is supported
# ---------------------------------------------------------------------------


def check_control_flow(program: ExportedProgram, name: str) -> None:
    """Refuse control flow lowerflow cannot lower, naming the node and the model.

    Supported: ``torch.cond`` with a one-element bool tensor predicate and
    tensor outputs, and ``torch.map`` over one tensor with one tensor output;
    either may be nested in a branch or body of the other.  Raises
    :class:`~lowering.errors.ExportError`.
    """
    _check_graph(program.graph_module, name, inside=None)


def _check_graph(gm: torch.fx.GraphModule, name: str, inside: str | None) -> None:
    from .errors import ExportError

    unsupported = _unsupported_ops()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        where = f"model {name!r}, node {node.name!r}" + (f" (inside {inside!r})" if inside else "")
        if node.target in unsupported:
            raise ExportError(f"{where}: {unsupported[node.target]}")
        if not is_control_flow(node):
            continue
        outputs = node.meta.get("val")
        if not isinstance(outputs, (tuple, list)) or not all(isinstance(v, torch.Tensor) for v in outputs):
            raise ExportError(f"{where}: {node.target.__name__} must return tensors only")
        if node.target is COND:
            pred = node.args[0]
            if not isinstance(pred, torch.fx.Node) or not isinstance(pred.meta.get("val"), torch.Tensor):
                raise ExportError(f"{where}: the torch.cond predicate must be a tensor computed by the model")
            if pred.meta["val"].dtype != torch.bool or pred.meta["val"].numel() != 1:
                raise ExportError(f"{where}: the torch.cond predicate must be a one-element bool tensor")
        else:
            _, mapped, _ = node.args
            if len(mapped) != 1:
                raise ExportError(
                    f"{where}: torch.map over {len(mapped)} tensors is not supported (map over one tensor)"
                )
            if len(outputs) != 1:
                raise ExportError(
                    f"{where}: torch.map with {len(outputs)} outputs is not supported (the body must "
                    "return one tensor)"
                )
        for sub in submodules_of(gm, node):
            _check_graph(sub.module, name, inside=sub.attr if inside is None else f"{inside}/{sub.attr}")


# ---------------------------------------------------------------------------
# Stage 2-6: partitions inside the submodules
# ---------------------------------------------------------------------------


def submodule_program(module: torch.fx.GraphModule) -> ExportedProgram:
    """A submodule as an ExportedProgram: every placeholder a user input, every result a user output.

    A partition inside it therefore never consumes a parameter: the weights
    of a branch arrive as inputs (as in ExecuTorch's ``is_submodule`` lowering).
    """
    from torch.export.graph_signature import (
        ExportGraphSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    from .subprogram import _module_call_entry

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
        module_call_graph=[_module_call_entry(placeholders, results)],
        constants={},
    )


def lower_control_flow_submodules(
    program: ExportedProgram, lower: Callable[[ExportedProgram], ExportedProgram]
) -> int:
    """Delegate the partitions inside every cond / map submodule (in place); returns how many
    submodules changed.

    ``lower`` is ``to_backend`` with the same partitioner, applied to
    :func:`submodule_program` (it recurses into control flow nested there);
    the delegated graph module replaces the submodule.

    Before::

        true_graph_0: %permute_copy = permute_copy(%p_a_weight); %addmm = addmm(%p_a_bias, %x, %permute_copy)

    After::

        true_graph_0: %lowered_module_0 = get_attr[lowered_module_0]
                      %executorch_call_delegate = executorch_call_delegate(%lowered_module_0, %x, %p_a_bias, %p_a_weight)
    """
    return _lower_in(program.graph_module, lower)


def _lower_in(gm: torch.fx.GraphModule, lower: Callable[[ExportedProgram], ExportedProgram]) -> int:
    changed = 0
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            # ``lower`` handles the control flow nested in the submodule itself.
            new_module = lower(submodule_program(sub.module)).graph_module
            if new_module is not sub.module:
                setattr(gm, sub.attr, new_module)
                changed += 1
    return changed


def submodule_lowered_modules(gm: torch.fx.GraphModule) -> list:
    """The lowered modules the cond / map submodules call (recursively), in graph order."""
    from .delegate import executorch_call_delegate

    found = []
    for scope, module in iter_scopes(gm):
        if not scope:
            continue
        for n in module.graph.nodes:
            if n.op == "call_function" and n.target is executorch_call_delegate:
                found.append(getattr(module, n.args[0].target))
    return found


def count_submodule_delegates(gm: torch.fx.GraphModule) -> int:
    """How many ``executorch_call_delegate`` nodes the cond / map submodules hold (recursively)."""
    from .delegate import executorch_call_delegate

    count = 0
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            count += sum(
                1 for n in sub.module.graph.nodes
                if n.op == "call_function" and n.target is executorch_call_delegate
            )
            count += count_submodule_delegates(sub.module)
    return count


# ---------------------------------------------------------------------------
# Stage 7: memory planning
# ---------------------------------------------------------------------------


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


def plan_control_flow_values(ep: ExportedProgram, table: Any, alignment: int) -> ControlFlowValues:
    """Add the values of every submodule to ``table`` (a ``memory_plan.ValueTable``, in place).

    A submodule placeholder names its operand's value (no memory of its own),
    except map's slice placeholder, which is a planned tensor the loop writes
    each iteration.  Every op result inside gets the key
    ``"<submodule>/<node name>"`` (``"<submodule>/<node>.<i>"`` for output ``i``).
    """
    from .memory_plan import find_out_variants

    result = ControlFlowValues({}, {}, [])
    _collect_scope_values(ep.graph_module, "", table, alignment, result, find_out_variants)
    return result


def _collect_scope_values(gm, prefix, table, alignment, result, find_out_variants) -> None:
    from .memory_plan import _tensor_value, value_key

    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            scope = f"{prefix}{sub.attr}{SCOPE_SEPARATOR}"
            graph = sub.module.graph
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            for placeholder, operand in zip(placeholders, sub.operands):
                if operand is None:  # map's slice: written by the loop, planned here
                    key = scope + placeholder.name
                    table.values[key] = _tensor_value(key, placeholder.meta["val"], alignment)
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
                    table.values[key] = _tensor_value(key, item, alignment)
                if tensors:
                    table.refs[sub_node] = [key for key, _ in tensors]
            for node_name, out in find_out_variants(graph).items():
                result.out_variants[scope + node_name] = out
            _collect_scope_values(sub.module, scope, table, alignment, result, find_out_variants)
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


def control_flow_lifetimes(ep: ExportedProgram, table: Any) -> dict[str, tuple[int, int]]:
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
                for arg in _input_nodes(node):
                    touch(table.refs.get(arg, ()), start, end)
                continue
            first = 0 if (top and node.op == "placeholder") else step
            touch(table.refs.get(node, ()), first, step)
            for arg in _input_nodes(node):
                touch(table.refs.get(arg, ()), step, step)
            step += 1

    walk(ep.graph_module, top=True)
    for key in table.mutated:
        spans[key] = [0, step - 1]
    return {key: tuple(spans.get(key, (0, 0))) for key in table.values}


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


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


# ---------------------------------------------------------------------------
# Stage 8: emission
# ---------------------------------------------------------------------------


def emit_control_flow(emitter: Any, node: torch.fx.Node) -> None:
    """Emit a cond or map node with the method emitter ``emitter`` (``lowering.emit._MethodEmitter``)."""
    if node.target is COND:
        emit_cond(emitter, node)
    else:
        emit_map(emitter, node)


def emit_subgraph(emitter: Any, sub: Submodule, bindings: list[int | None]) -> list[int]:
    """Emit a submodule's nodes inline; returns the value ids of its results.

    Placeholder ``i`` is value ``bindings[i]``; a ``None`` binding gets a
    planned tensor of its own (map's slice).  Keys are scoped by the
    submodule's attribute name, as in the memory plan.
    """
    saved = (emitter.scope, emitter.graph_module, emitter.node)
    emitter.scope = f"{emitter.scope}{sub.attr}{SCOPE_SEPARATOR}"
    emitter.graph_module = sub.module
    results: list[int] = []
    try:
        placeholders = iter(bindings)
        for node in sub.module.graph.nodes:
            emitter.node = node
            if node.op == "placeholder":
                bound = next(placeholders, None)
                if bound is None:
                    bound = emitter._planned_tensor(emitter.scope + node.name, node.meta["val"])
                emitter.node_values[node] = bound
            elif node.op == "get_attr":
                emitter.node_values[node] = None
            elif node.op == "call_function":
                emitter._emit_call(node)
            elif node.op == "output":
                results = [emitter._output_value(v) for v in node.args[0]]
            else:
                raise emitter._error(f"{node.op} nodes are not supported inside control flow")
    finally:
        emitter.scope, emitter.graph_module, emitter.node = saved
    return results


def emit_cond(emitter: Any, node: torch.fx.Node) -> None:
    """``cond(pred, true, false, operands)`` as jumps around the two inlined branches.

    ::

        JumpFalseCall(pred, -> false)          # pred false: skip the true branch
        <true branch> ; MoveCall(result -> output) ...
        JumpFalseCall(False, -> end)           # always jumps
        false: <false branch> ; MoveCall(result -> output) ...
        end:
    """
    pred = emitter._node_value(node.args[0])
    outputs = emitter._node_results(node)
    true_branch, false_branch = submodules_of(emitter.graph_module, node)
    bindings = [emitter._output_value(v) for v in true_branch.operands]

    to_false = _jump(emitter, pred)
    _moves(emitter, emit_subgraph(emitter, true_branch, bindings), outputs)
    always = emitter._add_value(_bool_evalue(False))
    to_end = _jump(emitter, always)
    to_false.destinationInstruction = len(emitter.instructions)
    _moves(emitter, emit_subgraph(emitter, false_branch, bindings), outputs)
    to_end.destinationInstruction = len(emitter.instructions)
    emitter.node = node
    emitter.node_values[node] = outputs


def emit_map(emitter: Any, node: torch.fx.Node) -> None:
    """``map_impl(body, [xs], operands)`` as a loop over ``xs``'s first dimension.

    ::

        n = aten::sym_size.int(xs, 0)
        loop: aten::select_copy.int_out(xs, 0, i, out=slice)
              <body on slice, operands>
              executorch_prim::et_copy_index.tensor(output, result, i)   # output[i] = result
              i = executorch_prim::add.Scalar(i, 1)
              done = executorch_prim::eq.Scalar(i, n)
              JumpFalseCall(done, -> loop)
        i = executorch_prim::sub.Scalar(i, n)                           # 0 for the next run
    """
    from .pte import schema

    _, mapped, _ = node.args
    xs = emitter._node_value(mapped[0])
    outputs = emitter._node_results(node)
    # et_copy_index resizes the output to (i + 1, ...) at iteration i, which
    # the runtime allows only for a bounded-dynamic tensor (planned at its full size).
    emitter.values[outputs[0]].val.shapeDynamism = schema.TensorShapeDynamism.DYNAMIC_BOUND
    (body,) = submodules_of(emitter.graph_module, node)
    bindings: list[int | None] = [None] + [emitter._output_value(v) for v in body.operands[1:]]
    placeholders = [n for n in body.module.graph.nodes if n.op == "placeholder"]
    slice_id = emitter._planned_tensor(
        f"{emitter.scope}{body.attr}{SCOPE_SEPARATOR}{placeholders[0].name}", placeholders[0].meta["val"]
    )
    bindings[0] = slice_id

    index = emitter._add_value(_int_evalue(0))
    count = emitter._add_value(_int_evalue(0))
    zero = emitter._add_value(_int_evalue(0))
    emitter._kernel_call("aten::sym_size", "int", [xs, zero, count])
    loop = len(emitter.instructions)
    emitter._kernel_call("aten::select_copy", "int_out", [xs, zero, index, slice_id, slice_id])
    results = emit_subgraph(emitter, body, bindings)
    emitter.node = node
    emitter._kernel_call("executorch_prim::et_copy_index", "tensor", [outputs[0], results[0], index])
    one = emitter._add_value(_int_evalue(1))
    emitter._kernel_call("executorch_prim::add", "Scalar", [index, one, index])
    done = emitter._add_value(_bool_evalue(False))
    emitter._kernel_call("executorch_prim::eq", "Scalar", [index, count, done])
    back = _jump(emitter, done)
    back.destinationInstruction = loop
    emitter._kernel_call("executorch_prim::sub", "Scalar", [index, count, index])
    emitter.node_values[node] = outputs


def _jump(emitter: Any, cond_value: int):
    """Append a JumpFalseCall on ``cond_value``; its destination is set by the caller."""
    from .pte import schema

    call = schema.JumpFalseCallT()
    call.condValueIndex = cond_value
    call.destinationInstruction = -1
    emitter._instruction(schema.InstructionArguments.JumpFalseCall, call)
    return call


def _moves(emitter: Any, sources: list[int], targets: list[int]) -> None:
    from .pte import schema

    if len(sources) != len(targets):
        raise emitter._error(f"a branch returns {len(sources)} values, the cond {len(targets)}")
    for source, target in zip(sources, targets):
        if source != target:
            call = schema.MoveCallT()
            call.moveFrom = source
            call.moveTo = target
            emitter._instruction(schema.InstructionArguments.MoveCall, call)


def _int_evalue(value: int):
    from .emit import _scalar_evalue

    return _scalar_evalue(int(value))


def _bool_evalue(value: bool):
    from .emit import _scalar_evalue

    return _scalar_evalue(bool(value))


def iter_scopes(gm: torch.fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, torch.fx.GraphModule]]:
    """``(scope prefix, graph module)`` of the program and of every submodule, depth first."""
    yield prefix, gm
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            yield from iter_scopes(sub.module, f"{prefix}{sub.attr}{SCOPE_SEPARATOR}")
