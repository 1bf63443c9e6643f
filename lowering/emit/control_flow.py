"""Stage 8's control-flow case: ``cond`` and ``map`` inlined as ExecuTorch's emitter does.

A cond's branches / a map's body are emitted inline (their values keyed
``"<submodule>/<node>"``, as in the memory plan) between ``JumpFalseCall``
instructions, with ``MoveCall`` for a branch's results and the
``executorch_prim`` integer ops for map's loop index.  ``emitter`` is the
:class:`lowering.emit.method.MethodEmitter` emitting the enclosing graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ..control_flow_graph import COND, SCOPE_SEPARATOR, Submodule, submodules_of
from ..pte import schema
from .evalues import scalar_evalue


def emit_control_flow(emitter: Any, node: torch.fx.Node) -> None:
    """Emit a cond or map node with the method emitter ``emitter`` (``lowering.emit.method.MethodEmitter``)."""
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
                    bound = emitter.planned_tensor(emitter.scope + node.name, node.meta["val"])
                emitter.node_values[node] = bound
            elif node.op == "get_attr":
                emitter.node_values[node] = None
            elif node.op == "call_function":
                emitter.emit_call(node)
            elif node.op == "output":
                results = [emitter.output_value(v) for v in node.args[0]]
            else:
                raise emitter.error(f"{node.op} nodes are not supported inside control flow")
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
    pred = emitter.node_value(node.args[0])
    outputs = emitter.node_results(node)
    true_branch, false_branch = submodules_of(emitter.graph_module, node)
    bindings = [emitter.output_value(v) for v in true_branch.operands]

    to_false = _jump(emitter, pred)
    _moves(emitter, emit_subgraph(emitter, true_branch, bindings), outputs)
    always = emitter.add_value(_bool_evalue(False))
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
    _, mapped, _ = node.args
    xs = emitter.node_value(mapped[0])
    outputs = emitter.node_results(node)
    # et_copy_index resizes the output to (i + 1, ...) at iteration i, which
    # the runtime allows only for a bounded-dynamic tensor (planned at its full size).
    emitter.values[outputs[0]].val.shapeDynamism = schema.TensorShapeDynamism.DYNAMIC_BOUND
    (body,) = submodules_of(emitter.graph_module, node)
    bindings: list[int | None] = [None] + [emitter.output_value(v) for v in body.operands[1:]]
    placeholders = [n for n in body.module.graph.nodes if n.op == "placeholder"]
    slice_id = emitter.planned_tensor(
        f"{emitter.scope}{body.attr}{SCOPE_SEPARATOR}{placeholders[0].name}", placeholders[0].meta["val"]
    )
    bindings[0] = slice_id

    index = emitter.add_value(_int_evalue(0))
    count = emitter.add_value(_int_evalue(0))
    zero = emitter.add_value(_int_evalue(0))
    emitter.kernel_call("aten::sym_size", "int", [xs, zero, count])
    loop = len(emitter.instructions)
    emitter.kernel_call("aten::select_copy", "int_out", [xs, zero, index, slice_id, slice_id])
    results = emit_subgraph(emitter, body, bindings)
    emitter.node = node
    emitter.kernel_call("executorch_prim::et_copy_index", "tensor", [outputs[0], results[0], index])
    one = emitter.add_value(_int_evalue(1))
    emitter.kernel_call("executorch_prim::add", "Scalar", [index, one, index])
    done = emitter.add_value(_bool_evalue(False))
    emitter.kernel_call("executorch_prim::eq", "Scalar", [index, count, done])
    back = _jump(emitter, done)
    back.destinationInstruction = loop
    emitter.kernel_call("executorch_prim::sub", "Scalar", [index, count, index])
    emitter.node_values[node] = outputs


def _jump(emitter: Any, cond_value: int):
    """Append a JumpFalseCall on ``cond_value``; its destination is set by the caller."""
    call = schema.JumpFalseCallT()
    call.condValueIndex = cond_value
    call.destinationInstruction = -1
    emitter.instruction(schema.InstructionArguments.JumpFalseCall, call)
    return call


def _moves(emitter: Any, sources: list[int], targets: list[int]) -> None:
    if len(sources) != len(targets):
        raise emitter.error(f"a branch returns {len(sources)} values, the cond {len(targets)}")
    for source, target in zip(sources, targets):
        if source != target:
            call = schema.MoveCallT()
            call.moveFrom = source
            call.moveTo = target
            emitter.instruction(schema.InstructionArguments.MoveCall, call)


def _int_evalue(value: int):
    return scalar_evalue(int(value))


def _bool_evalue(value: bool):
    return scalar_evalue(bool(value))
