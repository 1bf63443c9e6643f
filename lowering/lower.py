"""``lower``: a model (or exported program) to ``.pte`` bytes in one call.

    export ─► to_backend (only with a partitioner) ─► memory plan ─► emit

Every stage runs in this process on live objects; nothing is written to disk.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.export import ExportedProgram

from .errors import LoweringError
from .export import export, to_edge
from .memory_plan import MemoryPlan, memory_plan

#: The stages ``LowerResult.timings`` reports, in order.
STAGES = ("export", "to_backend", "memory_plan", "emit")


@dataclass(frozen=True)
class LowerResult:
    """What :func:`lower` produced: the ``.pte`` bytes, the plan, the final
    program and seconds per stage (a skipped stage reports 0.0)."""

    pte: bytes
    memory_plan: MemoryPlan
    exported_program: ExportedProgram
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the planned arena the runtime allocates."""
        return self.memory_plan.arena_bytes

    @property
    def lower_bound(self) -> int:
        """The most bytes live at once: no placement can use less."""
        return self.memory_plan.lower_bound


def lower(
    model_or_exported_program: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[Any] | None = None,
    *,
    partitioner: Any = None,
) -> LowerResult:
    """Lower a module or an exported program to an ExecuTorch ``.pte``.

    A module is exported with ``example_inputs``.  An ``ExportedProgram`` is
    brought to the edge form unless it already is (e.g. it came from
    :func:`lowering.export`).  With a ``partitioner``, its partitions are
    delegated by :func:`lowering.to_backend.to_backend`; without one nothing
    is delegated.
    """
    timings = dict.fromkeys(STAGES, 0.0)
    with _timed(timings, "export"):
        program = _edge_program(model_or_exported_program, example_inputs)
    if partitioner is not None:
        from .to_backend import to_backend

        with _timed(timings, "to_backend"):
            program = to_backend(program, partitioner)
    with _timed(timings, "memory_plan"):
        plan = memory_plan(program)
    from .emit import emit_program

    with _timed(timings, "emit"):
        pte = emit_program(program, plan)
    return LowerResult(pte=pte, memory_plan=plan, exported_program=program, timings=timings)


def _edge_program(
    model_or_exported_program: torch.nn.Module | ExportedProgram, example_inputs: Sequence[Any] | None
) -> ExportedProgram:
    """The edge-form program of a module or an exported program."""
    if isinstance(model_or_exported_program, ExportedProgram):
        if example_inputs is not None:
            raise LoweringError(
                "lower: example_inputs are only for a module; an ExportedProgram carries its own"
            )
        program = model_or_exported_program
        return program if is_edge_form(program) else to_edge(program)
    if not isinstance(model_or_exported_program, torch.nn.Module):
        raise LoweringError(
            "lower: expected a torch.nn.Module or an ExportedProgram, "
            f"got {type(model_or_exported_program).__name__}"
        )
    if example_inputs is None:
        raise LoweringError(
            f"lower: model {type(model_or_exported_program).__name__!r} needs example_inputs to be exported"
        )
    return export(model_or_exported_program, example_inputs)


def is_edge_form(program: ExportedProgram) -> bool:
    """Whether every ATen op is a non-aliasing core (or ``*_copy``) op.

    That is the form :func:`lowering.export.to_edge` produces; checking it
    costs microseconds, re-decomposing costs a retrace (>= 0.15 s).  The
    branches and bodies of cond / map are checked too.
    """
    from .control_flow import iter_scopes

    for node in (n for _, gm in iter_scopes(program.graph_module) for n in gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "aten":
            continue
        if any(ret.alias_info is not None for ret in target._schema.returns):
            return False
        if torch.Tag.core not in target.tags and torch.Tag.view_copy not in target.tags:
            return False
    return True


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = time.perf_counter() - start
