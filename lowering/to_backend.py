"""``to_backend``: stages 2–6 for every partition tag.

    partition ─► check ─► duplicate shared constants ─► create submodules (all tags, one sort)
              ─► per tag: build ExportedProgram ─► preprocess + wrap ─► adjust original program
              ─► the same inside every cond branch / map body (:func:`lower_control_flow_submodules`)
"""

from __future__ import annotations

from typing import Callable, Sequence, overload

import torch
from torch.export import ExportedProgram

from .adjust import adjust_original_program, insert_lowered_module
from .control_flow_graph import control_flow_nodes, has_control_flow, iter_scopes, submodules_of
from .delegate import executorch_call_delegate
from .errors import LoweringError, PartitionError
from .lowered_module import LoweredBackendModule, preprocess
from .partition import ChainPartitioner, CompileSpec, Partitioner, partition
from .program import copy_program
from .submodule import create_submodules
from .subprogram import create_exported_program_from_submodule, submodule_program


@overload
def to_backend(exported_program: ExportedProgram, partitioner: Partitioner, /) -> ExportedProgram: ...
@overload
def to_backend(
    backend_id: str, exported_program: ExportedProgram, compile_specs: Sequence[CompileSpec] = (), /
) -> LoweredBackendModule: ...


def to_backend(first, second, third=(), /):
    """Lower the tagged partitions of a program, or a whole program, to a backend.

    * ``to_backend(exported_program, partitioner) -> ExportedProgram``: every
      partition the partitioner tags becomes a ``lowered_module_<i>`` called
      through ``executorch_call_delegate``.  The input program is not modified.
      A :class:`~lowering.partition.ChainPartitioner` (or a list of partitioners)
      delegates with each in turn, each taking what the ones before it left.
    * ``to_backend(backend_id, exported_program, compile_specs) -> LoweredBackendModule``:
      the whole program preprocessed by one backend.
    """
    if isinstance(first, str):
        if not isinstance(second, ExportedProgram):
            raise LoweringError(
                f"to_backend({first!r}, ...): expected an ExportedProgram, got {type(second).__name__}"
            )
        return preprocess(copy_program(second), first, tuple(third))
    if not isinstance(first, ExportedProgram):
        raise LoweringError(f"to_backend: expected an ExportedProgram, got {type(first).__name__}")
    if isinstance(second, (list, tuple)):
        second = ChainPartitioner(second)
    if isinstance(second, ChainPartitioner):
        for step in second.partitioners:
            first = _lower_partitions(first, step)
        return first
    if not isinstance(second, Partitioner):
        raise PartitionError(
            f"to_backend: expected a lowering.Partitioner, got {type(second).__name__}"
        )
    return _lower_partitions(first, second)


def _lower_partitions(exported_program: ExportedProgram, partitioner: Partitioner) -> ExportedProgram:
    """The top level's partitions, then those inside every cond branch / map body."""
    program = _lower_graph_partitions(exported_program, partitioner)
    if has_control_flow(program.graph):
        lower_control_flow_submodules(program, lambda sub: _lower_partitions(sub, partitioner))
    return program


def _lower_graph_partitions(exported_program: ExportedProgram, partitioner: Partitioner) -> ExportedProgram:
    """Stages 2-6 on one graph (submodules of control flow untouched); a new program."""
    result = partition(exported_program, partitioner)
    program = result.tagged_exported_program
    if not result.partition_tags:
        return program
    calls = create_submodules(program.graph_module, result.partition_tags)
    for tag, call in calls.items():
        spec = result.partition_tags[tag]
        sub_program, io = create_exported_program_from_submodule(program, call, tag)
        lowered = preprocess(sub_program, spec.backend_id, spec.compile_specs, partition=tag)
        insert_lowered_module(program, call, lowered, io)
    return adjust_original_program(program)


# ---------------------------------------------------------------------------
# Control flow: the partitions inside cond branches / map bodies
# ---------------------------------------------------------------------------


def lower_control_flow_submodules(
    program: ExportedProgram, lower: Callable[[ExportedProgram], ExportedProgram]
) -> int:
    """Delegate the partitions inside every cond / map submodule (in place); returns how many
    submodules changed.

    ``lower`` is ``to_backend`` with the same partitioner, applied to
    :func:`lowering.subprogram.submodule_program` (it recurses into control flow nested there);
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
    count = 0
    for node in control_flow_nodes(gm.graph):
        for sub in submodules_of(gm, node):
            count += sum(
                1 for n in sub.module.graph.nodes
                if n.op == "call_function" and n.target is executorch_call_delegate
            )
            count += count_submodule_delegates(sub.module)
    return count
