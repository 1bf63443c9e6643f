"""``lower``: a model (or exported program) to ``.pte`` bytes in one call.

    export ─► quantize (only with a recipe) ─► to_backend (only with a partitioner)
           ─► memory plan ─► emit

Every stage runs in this process on live objects; nothing is written to disk.

Several methods in one program (:func:`lower_methods`, or ``lower`` given a dict)::

    lower({"encode": (encoder, (tokens,)), "decode": (decoder, (tokens, memory))},
          partitioner=XnnpackPartitioner())

Each method runs the stages above on its own; one emit writes them all
(:mod:`lowering.methods`: methods in name order, shared weights and equal
delegate payloads stored once).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.export import ExportedProgram

from .control_flow_graph import iter_scopes
from .errors import LoweringError
from .export import KEPT, export, to_edge
from .memory_plan.plan import MemoryPlan, memory_plan
from .partition import ChainPartitioner, Partitioner, external_weights_partitioner
from .stock_ops.table import runtime_profile, stock_decomposition

#: The stages ``LowerResult.timings`` reports, in order.
STAGES = ("export", "quantize", "to_backend", "memory_plan", "emit")


@dataclass(frozen=True)
class LowerResult:
    """What :func:`lower` produced: the ``.pte`` bytes, the plan, the final
    program and seconds per stage (a skipped stage reports 0.0)."""

    pte: bytes
    memory_plan: MemoryPlan
    exported_program: ExportedProgram
    timings: dict[str, float] = field(default_factory=dict)
    #: The ``.ptd`` the ``.pte`` binds its weights from (``external_weights=True``), else None.
    ptd: bytes | None = None
    #: With ``external_weights``: the exported edge program before quantize and delegation, what
    #: :func:`lowering.rebind.rebind_weights` binds a retrain's weights to.
    source_program: ExportedProgram | None = None
    #: With ``external_weights`` and a recipe: the quantized program before delegation (what the
    #: program computes, in torch; what :func:`lowering.rebind.rebind_weights` quantizes new weights by).
    quantized_program: ExportedProgram | None = None

    @property
    def arena_bytes(self) -> int:
        """Bytes of the planned arena the runtime allocates."""
        return self.memory_plan.arena_bytes

    @property
    def lower_bound(self) -> int:
        """The most bytes live at once: no placement can use less."""
        return self.memory_plan.lower_bound


def lower(
    model_or_exported_program: torch.nn.Module | ExportedProgram | Mapping[str, Any],
    example_inputs: Sequence[Any] | None = None,
    *,
    partitioner: Any = None,
    dynamic_shapes: Any = None,
    share_mutable_buffers: bool = False,
    quantize: Any = None,
    calibration: Any = None,
    runtime_ops: Any = None,
    strict: bool = False,
    external_weights: bool = False,
) -> "LowerResult | MethodsLowerResult":
    """Lower a module or an exported program to an ExecuTorch ``.pte``.

    A dict ``{method name: (module, example_inputs) | ExportedProgram}`` is
    :func:`lower_methods`: one ``.pte`` with one method per entry.
    A module is exported with ``example_inputs``.  An ``ExportedProgram`` is
    brought to the edge form unless it already is (e.g. it came from
    :func:`lowering.export`).  With a ``partitioner``, its partitions are
    delegated by :func:`lowering.to_backend.to_backend`; without one nothing
    is delegated.  ``dynamic_shapes`` (torch.export's argument, every
    ``torch.export.Dim`` with a max) makes those dims dynamic: the ``.pte``
    runs at any size in their ranges.  ``share_mutable_buffers`` is for a dict
    of methods (see :func:`lower_methods`).  ``quantize``: a recipe
    (:func:`lowering.quantize.parse_recipe`: ``"int8"``, ``"int8-dynamic"``,
    ``"8da4w"`` or a mapping) applied after export, with ``calibration`` batches
    (an iterable of input tuples; ``int8`` needs them).  Without a partitioner
    the program keeps its quantize / dequantize ops at the top level.
    ``runtime_ops``: the runtime profile the emitted operators must be in
    (:func:`lowering.stock_ops.runtime_profile`: some of ``"portable"``, ``"quantized"``,
    ``"llm"``, ``"fused"``; None: all of them); an operator outside it fails the lowering
    with :class:`~lowering.errors.MissingOperatorError` before any bytes are written.
    ``strict``: torch.export's strict mode (see :func:`lowering.export.export`).
    ``external_weights``: the weights go to ``LowerResult.ptd`` (ExecuTorch's ``.ptd``),
    the ``.pte`` keeps the program only (:mod:`lowering.external`): a retrain of the same
    model gives the same ``.pte`` bytes and a new ``.ptd``.
    """
    runtime_profile(runtime_ops)  # a bad name fails before any work
    if share_mutable_buffers and not isinstance(model_or_exported_program, Mapping):
        raise LoweringError("lower: share_mutable_buffers applies to a dict of methods, not one model")
    if isinstance(model_or_exported_program, Mapping):
        if example_inputs is not None:
            raise LoweringError("lower: example_inputs go inside the methods dict, one per method")
        if dynamic_shapes is not None:
            raise LoweringError("lower: dynamic_shapes go inside the methods dict, a third element per method")
        return lower_methods(model_or_exported_program, partitioner=partitioner,
                             share_mutable_buffers=share_mutable_buffers, quantize=quantize,
                             calibration=calibration, runtime_ops=runtime_ops, strict=strict,
                             external_weights=external_weights)
    partitioner = external_weights_partitioner(partitioner, external_weights)
    timings = dict.fromkeys(STAGES, 0.0)
    keep = _ops_to_not_decompose(partitioner)
    quantizer = _backend_quantizer(partitioner, quantize, model_or_exported_program)
    if quantizer is not None:  # the backend quantizes the module itself (Ethos-U: Arm's quantizer)
        if external_weights or dynamic_shapes is not None:
            raise LoweringError("lower: a backend's own quantizer takes neither external_weights nor dynamic_shapes")
        from .quantize import quantize_module

        with _timed(timings, "quantize"):
            program = quantize_module(model_or_exported_program, example_inputs, quantize, calibration, quantizer,
                                      name=_label(model_or_exported_program), keep=keep)
        source = quantized = None
    else:
        with _timed(timings, "export"):
            program = _edge_program(model_or_exported_program, example_inputs, dynamic_shapes, strict, keep=keep,
                                    fold_constants=_fold_constants(partitioner))
        source = program if external_weights else None
        if quantize is not None and partitioner is None:
            _parse_recipe(quantize).check_portable(f"lower: model {_label(model_or_exported_program)!r}")
        program = _quantize(program, quantize, calibration, timings, _label(model_or_exported_program))
        quantized = program if external_weights and quantize is not None else None
    program, plan = _delegate_and_plan(program, partitioner, timings)
    from .emit.method import build_pte
    from .external import program_files

    with _timed(timings, "emit"):
        pte, ptd = program_files(build_pte(program, plan, runtime_ops=runtime_ops, external_weights=external_weights),
                                 external_weights)
    return LowerResult(pte=pte, memory_plan=plan, exported_program=program, timings=timings, ptd=ptd,
                       source_program=source, quantized_program=quantized)


def _quantize(program: ExportedProgram, recipe: Any, calibration: Any, timings: dict[str, float],
              name: str) -> ExportedProgram:
    """The quantize stage with a recipe; the program itself without one."""
    if recipe is None:
        if calibration is not None:
            raise LoweringError(f"lower: model {name!r}: calibration is given but no quantize recipe")
        return program
    from .quantize import quantize

    with _timed(timings, "quantize"):
        return quantize(program, recipe, calibration, name=name)


def _label(model: Any) -> str:
    return type(model).__name__


def _delegate_and_plan(program: ExportedProgram, partitioner: Any, timings: dict[str, float]):
    """to_backend (with a partitioner) and memory plan: (final program, its plan)."""
    program = _delegate(program, partitioner, timings)
    with _timed(timings, "memory_plan"):
        plan = memory_plan(program)
    return program, plan


def _delegate(program: ExportedProgram, partitioner: Any, timings: dict[str, float]) -> ExportedProgram:
    """to_backend with a partitioner; the program itself without one."""
    if partitioner is None:
        return program
    from .to_backend import to_backend

    with _timed(timings, "to_backend"):
        return to_backend(program, partitioner)


@dataclass(frozen=True)
class MethodsLowerResult:
    """What :func:`lower_methods` produced: the one ``.pte`` and, per method (in
    program order), its memory plan, final program and seconds per stage."""

    pte: bytes
    memory_plans: dict[str, MemoryPlan]
    exported_programs: dict[str, ExportedProgram]
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    #: The ``.ptd`` of every method's weights (``external_weights=True``), else None.
    ptd: bytes | None = None
    #: With ``external_weights``: each method's edge program before quantize and delegation, and
    #: the constant methods (:func:`lowering.rebind.rebind_weights`).
    source_programs: dict[str, ExportedProgram] | None = None
    constant_methods: dict[str, Any] = field(default_factory=dict)
    #: With ``external_weights`` and a recipe: each method's quantized program (how its pass
    #: derived each constant: a retrain's weights are quantized without the pass).
    quantized_programs: dict[str, ExportedProgram] | None = None

    @property
    def method_names(self) -> list[str]:
        return list(self.memory_plans)


def lower_methods(
    methods: Mapping[str, Any], *, partitioner: Any = None, share_mutable_buffers: bool = False,
    quantize: Any = None, calibration: Any = None, runtime_ops: Any = None, strict: bool = False,
    external_weights: bool = False,
) -> MethodsLowerResult:
    """Lower several methods into one ``.pte``.

    ``methods``: ``{name: (module, example_inputs[, dynamic_shapes]) | ExportedProgram}``;
    names are Python identifiers.  Modules may share submodules and parameters
    (``encode = Encoder(model)``, ``decode = Decoder(model)``): weights with equal
    bytes are stored once.  Each method is exported, delegated with
    ``partitioner`` and memory-planned on its own, then all are emitted together
    (methods sorted by name: the same methods give the same bytes whatever the
    dict order).  The emit stage's seconds are reported under every method.

    ``share_mutable_buffers``: mutable buffers (a KV cache) are state of the
    program, not of one method: each buffer name has one place in a shared
    arena (mem_id 2) that every method reads and writes, so ``decode`` sees
    what ``prefill`` wrote on the same loaded program (see
    :func:`lowering.methods.plan_shared_state`).  Without it, a buffer one
    method mutates and another uses is a MethodError, and each method's own
    mutable buffers get a region of arena 2 of their own
    (:func:`lowering.methods.plan_method_state`: ExecuTorch's runtime shares
    arena 1 between the methods of a program).

    ``quantize``: one recipe for every method; ``calibration``: a dict
    ``{method name: batches}`` (int8 needs one entry per method).  ``runtime_ops``: as
    in :func:`lower`, for every method; ``external_weights`` as in :func:`lower` (one
    ``.ptd`` for every method: a weight two methods share is stored once).

    A method whose value is a plain int, float, bool, str or a list of them is a
    *constant method* (no inputs; returns the value), as ExecuTorch's
    ``constant_methods``: ``{"forward": (m, (x,)), "get_max_seq_len": 128}``
    (:func:`lowering.methods.constant_methods`).
    """
    from .external import program_files
    from .methods import (
        build_methods_pte,
        check_no_shared_state,
        check_shared_state_names,
        mark_shared_state,
        method_entries,
        mutated_buffers,
        plan_method_state,
        split_constant_methods,
        state_written_elsewhere,
    )

    runtime_profile(runtime_ops)
    partitioner = external_weights_partitioner(partitioner, external_weights)
    methods, constants = split_constant_methods(methods, "lower")
    entries = method_entries(methods, "lower")
    programs: dict[str, ExportedProgram] = {}
    plans: dict[str, MemoryPlan] = {}
    timings: dict[str, dict[str, float]] = {}
    sources: dict[str, ExportedProgram] = {}
    quantized: dict[str, ExportedProgram] = {}
    for name, (model, inputs, dynamic_shapes) in entries.items():
        timings[name] = dict.fromkeys(STAGES, 0.0)
        with _timed(timings[name], "export"):
            if isinstance(model, ExportedProgram):
                program = _edge_program(model, None)
            else:
                program = export(model, inputs, dynamic_shapes=dynamic_shapes, name=name, strict=strict)
        if external_weights:
            sources[name] = program
        calibration_of = calibration.get(name) if isinstance(calibration, Mapping) else None
        if calibration is not None and not isinstance(calibration, Mapping):
            raise LoweringError("lower_methods: calibration must be a dict {method name: batches}")
        if quantize is not None and partitioner is None:
            _parse_recipe(quantize).check_portable(f"lower_methods: method {name!r}")
        programs[name] = _quantize(program, quantize, calibration_of, timings[name], name)
        if external_weights and quantize is not None:
            quantized[name] = programs[name]
        del program  # a quantized method's fp32 program: nothing reads it again (its weights go)
    modules = {name: entry[0] for name, entry in entries.items() if isinstance(entry[0], torch.nn.Module)}
    mutated = {name: mutated_buffers(program) for name, program in programs.items()}
    (check_shared_state_names if share_mutable_buffers else check_no_shared_state)(modules, mutated)
    for name in entries:
        if share_mutable_buffers:
            mark_shared_state(programs[name], state_written_elsewhere(mutated, name))
        programs[name] = _delegate(programs[name], partitioner, timings[name])
    states = plan_method_state(programs, share=share_mutable_buffers)
    for name in entries:
        with _timed(timings[name], "memory_plan"):
            plans[name] = memory_plan(programs[name], shared_state=states[name] if states else None)
    emit_seconds: dict[str, float] = {}
    with _timed(emit_seconds, "emit"):
        pte, ptd = program_files(build_methods_pte({name: (programs[name], plans[name]) for name in entries},
                                                   constants, runtime_ops=runtime_ops,
                                                   external_weights=external_weights), external_weights)
    for name in entries:
        timings[name]["emit"] = emit_seconds["emit"]
    return MethodsLowerResult(pte=pte, memory_plans=plans, exported_programs=programs, timings=timings, ptd=ptd,
                              source_programs=sources or None, constant_methods=dict(constants),
                              quantized_programs=quantized or None)


def _as_partitioner(partitioner: Any) -> Partitioner | None:
    """A Partitioner (a list of them: their chain), else None."""
    if isinstance(partitioner, (list, tuple)) and partitioner and all(isinstance(p, Partitioner) for p in partitioner):
        partitioner = ChainPartitioner(partitioner)
    return partitioner if isinstance(partitioner, Partitioner) else None


def _ops_to_not_decompose(partitioner: Any):
    """The partitioner's ``ops_to_not_decompose`` (a list of partitioners: their chain's); None without one."""
    partitioner = _as_partitioner(partitioner)
    return partitioner.ops_to_not_decompose if partitioner is not None else None


def _fold_constants(partitioner: Any) -> bool | None:
    """The partitioner's ``fold_constants`` (None without one: export's default)."""
    partitioner = _as_partitioner(partitioner)
    return partitioner.fold_constants if partitioner is not None else None


def _backend_quantizer(partitioner: Any, recipe: Any, model: Any):
    """The partitioner's own quantizer for ``recipe`` when a module is to be quantized with it; else None."""
    partitioner = _as_partitioner(partitioner)
    if partitioner is None or recipe is None or not isinstance(model, torch.nn.Module):
        return None
    return partitioner.quantizer(_parse_recipe(recipe))


def _edge_program(
    model_or_exported_program: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[Any] | None,
    dynamic_shapes: Any = None,
    strict: bool = False,
    keep: Any = None,
    fold_constants: bool | None = None,
) -> ExportedProgram:
    """The edge-form program of a module or an exported program (``keep``: a partitioner's
    ``ops_to_not_decompose``, for a program stage 1 decomposes here; ``fold_constants``: its
    :attr:`~lowering.partition.Partitioner.fold_constants`)."""
    if isinstance(model_or_exported_program, ExportedProgram):
        if example_inputs is not None or dynamic_shapes is not None:
            raise LoweringError(
                "lower: example_inputs and dynamic_shapes are only for a module; "
                "an ExportedProgram carries its own"
            )
        program = model_or_exported_program
        return program if is_edge_form(program) else to_edge(program, keep=keep, fold_constants=fold_constants)
    if not isinstance(model_or_exported_program, torch.nn.Module):
        raise LoweringError(
            "lower: expected a torch.nn.Module or an ExportedProgram, "
            f"got {type(model_or_exported_program).__name__}"
        )
    if example_inputs is None:
        raise LoweringError(
            f"lower: model {type(model_or_exported_program).__name__!r} needs example_inputs to be exported"
        )
    return export(model_or_exported_program, example_inputs, dynamic_shapes=dynamic_shapes, strict=strict, keep=keep,
                  fold_constants=fold_constants)


def is_edge_form(program: ExportedProgram) -> bool:
    """Whether every ATen op is a non-aliasing core (or ``*_copy``) op that needs no
    decomposition for the stock runtime (:func:`lowering.stock_ops.stock_decomposition`).

    That is the form :func:`lowering.export.to_edge` produces; checking it
    costs microseconds, re-decomposing costs a retrace (>= 0.15 s).  The
    branches and bodies of cond / map are checked too.
    """
    for node in (n for _, gm in iter_scopes(program.graph_module) for n in gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or node.meta.get(KEPT):
            continue
        if target.namespace != "aten":
            continue
        if any(ret.alias_info is not None for ret in target._schema.returns):
            return False
        if torch.Tag.core not in target.tags and torch.Tag.view_copy not in target.tags:
            return False
        if stock_decomposition(target) is not None:  # stage 1 decomposes it (lowering.stock_ops)
            return False
    return True


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = time.perf_counter() - start


def _parse_recipe(recipe: Any):
    from .quantize import parse_recipe

    return parse_recipe(recipe)
