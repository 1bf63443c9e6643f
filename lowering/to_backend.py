"""``to_backend``: stages 2–6 for every partition tag.

    partition ─► check ─► duplicate shared constants ─► create submodules (all tags, one sort)
              ─► per tag: build ExportedProgram ─► preprocess + wrap ─► adjust original program
"""

from __future__ import annotations

from typing import Sequence, overload

from torch.export import ExportedProgram

from .adjust import adjust_original_program, insert_lowered_module
from .control_flow import has_control_flow, lower_control_flow_submodules
from .errors import LoweringError, PartitionError
from .lowered_module import LoweredBackendModule, preprocess
from .partition import CompileSpec, Partitioner, partition
from .program import copy_program
from .submodule import create_submodules
from .subprogram import create_exported_program_from_submodule


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
