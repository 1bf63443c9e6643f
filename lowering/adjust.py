"""Stage 6 — adjust the original program around a lowered module.

Before (after stages 3–5)::

    %fused_0   = call_module[fused_0](%x, %p_w, %b_acc)
    %getitem   = getitem(%fused_0, 0)                 # acc's new value
    %getitem_1 = getitem(%fused_0, 1)
    return (%getitem [BUFFER_MUTATION acc], %getitem_1)

After::

    %lowered_module_0 = get_attr[lowered_module_0]
    %executorch_call_delegate = executorch_call_delegate(%lowered_module_0, %x)
    %getitem_1 = getitem(%executorch_call_delegate, 0)  # renumbered
    return (%getitem_1,)

``p_w`` and ``b_acc`` leave the placeholders, the input specs and the state
dict; acc's mutation output and its getitem are gone (the delegate owns acc).
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from .delegate import executorch_call_delegate, get_lowered_module_name
from .lowered_module import LoweredBackendModule
from .program import rebuild_program
from .subprogram import DelegateIO


def adjust_original_program(exported_program: ExportedProgram) -> ExportedProgram:
    """Finish stage 6 after every :func:`insert_lowered_module`: a new, validated program."""
    exported_program.graph_module.graph.lint()
    exported_program.graph_module.recompile()
    program = rebuild_program(exported_program)
    program._validate()
    return program


def insert_lowered_module(
    exported_program: ExportedProgram,
    call: torch.fx.Node,
    lowered: LoweredBackendModule,
    io: DelegateIO,
) -> torch.fx.Node:
    """Replace the submodule call by a delegate call; returns the delegate node.

    Works in place on ``exported_program``'s graph and signature lists; call
    :func:`lowering.program.rebuild_program` once after the last partition.
    """
    gm = exported_program.graph_module
    graph = gm.graph
    name = get_lowered_module_name(gm, lowered)
    with graph.inserting_before(call):
        attr = graph.get_attr(name)
        delegate = graph.call_function(executorch_call_delegate, (attr, *io.user_inputs))
    # Output metadata from the top-level graph's own fake tensors (the fused
    # call's outputs), never from the lowered program, which may have been
    # loaded separately under another FakeTensorMode.
    fused_vals = call.meta["val"]
    kept = sorted((new, old) for old, new in io.output_index.items() if new is not None)
    delegate.meta["val"] = tuple(fused_vals[old] for _, old in kept)
    remove_consumed_mutations(exported_program, io.consumed_mutations, call)
    for item in list(call.users):
        new_index = io.output_index[item.args[1]]
        if new_index is None:
            graph.erase_node(item)  # it only carried the consumed buffer's mutation
        else:
            item.args = (delegate, new_index)
    submodule = call.target
    graph.erase_node(call)
    gm.delete_submodule(submodule)
    remove_consumed_placeholders(exported_program, io.consumed_placeholders)
    return delegate


def remove_consumed_mutations(
    exported_program: ExportedProgram, targets: list[str], call: torch.fx.Node
) -> None:
    """Drop the BUFFER_MUTATION outputs of ``targets`` that came from ``call``."""
    if not targets:
        return
    sig = exported_program.graph_signature
    output = exported_program.graph.output_node()
    keep_specs, keep_args = [], []
    for spec, arg in zip(sig.output_specs, output.args[0]):
        from_call = isinstance(arg, torch.fx.Node) and arg.target is operator.getitem and arg.args[0] is call
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in targets and from_call:
            continue
        keep_specs.append(spec)
        keep_args.append(arg)
    sig.output_specs[:] = keep_specs
    output.args = (tuple(keep_args),)


def remove_consumed_placeholders(
    exported_program: ExportedProgram, placeholders: list[torch.fx.Node]
) -> None:
    """Erase placeholders the delegate consumed (and nothing else uses) with their input specs."""
    sig = exported_program.graph_signature
    for node in placeholders:
        if node.users:
            continue
        sig.input_specs[:] = [s for s in sig.input_specs if getattr(s.arg, "name", None) != node.name]
        exported_program.graph.erase_node(node)
