"""The verify stage: run a ``.pte`` and compare it with eager PyTorch.

lowerflow's own executor always runs the program.  When the ExecuTorch runtime
happens to be installed (it is the test oracle, never a dependency), it runs the
program too, with the kernel libraries the program needs
(:mod:`lowering.verify_executorch`); it is looked up by name at call time so
nothing here depends on it.  One verify call hands ExecuTorch's runtime all its runs
at once (every input set, every method: :meth:`~lowering.verify_executorch.ExecutorchRunner.batch`),
so a program that needs a fresh interpreter (``llama::`` ops) starts one per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from .accuracy import QUANT_STEPS, outputs_error, quantized_tolerance, threshold_error
from .paging import page_out_module
from .runtime import load
from .verify_executorch import (
    Pte,
    batch_outputs,
    data_bytes,
    data_of,
    executorch_runner,
    program_operators,
    with_data,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RuntimeCheck:
    runtime: str
    ok: bool | None  # None: skipped
    max_abs_diff: float | None = None
    error: str | None = None
    skipped: str | None = None
    #: Which input set was run: "example", or the dynamic dims' sizes ("seq=1").
    inputs: str = "example"
    #: A quantized program's error against fp32 eager (lowering.accuracy.outputs_error).
    accuracy: dict | None = None


@dataclasses.dataclass
class VerifyReport:
    checks: list[RuntimeCheck]
    #: A quantized program: the quantized eager reference's own error against fp32 eager.
    reference_accuracy: dict | None = None

    @property
    def ok(self) -> bool:
        """Every runtime that ran the program matched eager (skipped ones do not count)."""
        return all(c.ok for c in self.checks if c.skipped is None)

    def to_dict(self) -> dict[str, Any]:
        out = {"ok": self.ok, "checks": [dataclasses.asdict(c) for c in self.checks]}
        if self.reference_accuracy is not None:
            out["reference_accuracy"] = self.reference_accuracy
        return out


def verify(
    pte: Pte,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    calls: int = 2,
    method: str = "forward",
    dynamic_shapes: Any = None,
    reference: Any = None,
    min_sqnr: float | None = None,
    max_error: float | None = None,
) -> VerifyReport:
    """Run ``pte``'s ``method`` ``calls`` times in each available runtime against a fresh
    eager model each time.

    A quantized program comes with its ``reference`` (the quantized ExportedProgram):
    each runtime must match it within a few steps of each output's int8 grid, and its
    error against fp32 eager is reported per check (``accuracy``) and must stay within
    ``min_sqnr`` (dB) / ``max_error`` (:mod:`lowering.accuracy`).

    Two calls on the same loaded method check that state (mutated buffers)
    carries over the way it does in eager.  ``model`` is not mutated (each
    input set runs a fresh copy).  With ``dynamic_shapes`` (torch.export's
    argument the program was exported with) the program is also run with
    every dynamic dim at its min and at its max
    (:func:`lowering.dynamic.inputs_at_sizes`), each on a freshly loaded method.
    ``pte``: the program's bytes, or its file's path (ExecuTorch's runtime maps the file).
    """
    reference = as_delegated(reference, pte)
    cases, reference_accuracy = _cases(model, example_inputs, calls, method, dynamic_shapes, reference,
                                       min_sqnr, max_error)
    reference = None  # run: not held while the runtimes run
    page_out_module(model)  # eager is done: its mapped weights need not stay beside the runtimes
    return VerifyReport([c for checks in _run_cases(pte, cases, calls, atol, rtol) for c in checks], reference_accuracy)


#: The verify modes: ``full`` (every input set of :func:`verify`, each twice, on every
#: runtime), ``quick`` (:func:`verify_quick`: one short sequence of calls), ``off``.
VERIFY_MODES = ("full", "quick", "off")
#: The default mode, chosen per model by its weight bytes (:func:`resolve_mode`).
AUTO = "auto"
#: ``auto`` verifies a model whose weights take more than this many bytes ``quick``, a
#: smaller one ``full``: 64 MiB is ~16M fp32 parameters, where a full verify (the longest
#: input set, twice, in eager and two runtimes, each program loaded per input set) still
#: takes seconds; SmolLM2-135M (540 MB) took 139 s of a 277 s lowering full, and quick
#: checks what matters of a decoder (prefill, then decode steps reading the cache) in one
#: program load.
QUICK_ABOVE_BYTES = 64 * 2**20
#: A decoder's quick check: a prompt of this many tokens, then this many decode steps.
QUICK_PREFILL, QUICK_DECODE_STEPS = 8, 3


def resolve_mode(mode: "str | bool | None", weight_bytes: int | None) -> str:
    """The mode to run: ``full``, ``quick`` or ``off``.  ``True``, None and ``auto`` (the
    default) pick by the model's ``weight_bytes``: quick above :data:`QUICK_ABOVE_BYTES`,
    else full (unknown bytes: full); ``False`` is off."""
    if mode is False:
        return "off"
    if mode is True or mode is None or mode == AUTO:
        return "quick" if weight_bytes is not None and weight_bytes > QUICK_ABOVE_BYTES else "full"
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r} is not one of {[*VERIFY_MODES, AUTO]}")
    return mode


def quick_calls(model: torch.nn.Module, example_inputs: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The inputs of :func:`verify_quick`'s calls: a decoder's own prefill and decode steps
    when it says what they are (``model.quick_calls(prefill, steps)``, e.g.
    :class:`lowering.llm.decoder.Decoder`), else its example inputs once."""
    own = getattr(model, "quick_calls", None)
    if callable(own):
        return [tuple(inputs) for inputs in own(QUICK_PREFILL, QUICK_DECODE_STEPS)]
    return [tuple(example_inputs)]


def verify_quick(
    pte: Pte,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    method: str = "forward",
    reference: Any = None,
    min_sqnr: float | None = None,
    max_error: float | None = None,
    lowerflow: bool | None = None,
) -> VerifyReport:
    """The quick check: :func:`quick_calls` (a decoder: one prefill, then a few decode
    steps) in order on ONE loaded method of each runtime, against ``model`` run in eager
    the same way with its own state (its KV cache: nothing is recomputed per step).

    ``model``'s buffers are restored after the eager run (nothing of the model is
    copied but its mutable state).  ``reference``: a quantized program's eager
    reference, as :func:`verify`'s.  ``lowerflow``: run lowerflow's runtime too (it
    parses the whole program in Python); None: only when the program is small
    (:data:`QUICK_ABOVE_BYTES`) or ExecuTorch's runtime cannot run it.
    """
    inputs = quick_calls(model, example_inputs)
    expected = _eager_in_order(model, inputs)
    # eager is done: its mapped weights need not stay beside the quantized reference or the runtimes
    page_out_module(model)
    quantized, reference_accuracy = None, None
    if reference is not None:
        fp32, expected, nudged = expected, *_reference_runs(as_delegated(reference, pte), inputs)
        quantized = {"fp32": fp32, "nudged": nudged, "min_sqnr": min_sqnr, "max_error": max_error}
        reference_accuracy = outputs_error(expected[0], fp32[0])
        reference = None  # run: not held while the runtimes run (a caller that passed it alone frees it)
        gc.collect()  # its modules are cycles of objects: their weights go now, not at some later collection
    calls = [(method, pytree.tree_leaves(tuple(each))) for each in inputs]
    label = f"quick: {len(calls)} calls"
    checks = []
    executorch = _executorch_sequence_check(pte, [method], calls, expected, atol, rtol, quantized)
    if lowerflow is None:
        lowerflow = executorch is None or executorch.skipped is not None or _pte_size(pte) <= QUICK_ABOVE_BYTES
    if lowerflow:
        missing = _missing_lowerflow_runtimes(delegate_backend_ids(pte))
        if missing:
            checks.append(RuntimeCheck("lowerflow", None, skipped=f"no backend runtime for {missing}"))
        else:
            checks.append(_check("lowerflow", lambda: _run_lowerflow_sequence(_LoadedOnce(pte).bytes(), [method], calls),
                                 expected, atol, rtol, quantized))
    if executorch is not None:
        checks.append(executorch)
    return VerifyReport([dataclasses.replace(c, inputs=label) for c in checks], reference_accuracy)


def _executorch_sequence_check(pte: Pte, names: list[str], calls: list, expected, atol, rtol,
                               quantized: dict | None = None) -> "RuntimeCheck | None":
    """ExecuTorch's runtime running ``calls`` on one loaded program (None: not installed;
    a skipped check when it lacks the program's backends or operators)."""
    runner = executorch_runner()
    if runner is None:
        return None
    missing = runner.missing_backends(delegate_backend_ids(pte))
    if missing:
        return RuntimeCheck("executorch", None, skipped=f"backends not in this runtime: {missing}")
    missing_ops = runner.missing_operators(program_operators(pte))
    if missing_ops:
        return RuntimeCheck("executorch", None, skipped=f"operators not in this runtime: {missing_ops}")
    return _check("executorch", lambda: runner.sequence(pte, names, calls), expected, atol, rtol, quantized)


def _reference_runs(reference: Any, inputs: list[tuple[Any, ...]]) -> tuple[list, list]:
    """The quantized ``reference`` (an ExportedProgram) run on ``inputs`` in order, as it is
    and nudged (:func:`nudged_reference`): ``(outputs, nudged outputs)``.  Its weights are
    dequantized once for all of its calls (:func:`lowering.quantize.dynamic.dequantized_weights`:
    Qwen2.5-0.5B 8da4w's eight calls spent most of their time dequantizing).  Nothing of it is
    held once this returns (the caller collects its cycles)."""
    from .quantize.dynamic import dequantized_weights

    module = dequantized_weights(reference.module())
    return _eager_in_order(module, inputs), _eager_in_order(nudged_reference(module), inputs)


def _eager_in_order(model: torch.nn.Module, inputs: list[tuple[Any, ...]]) -> list[list[torch.Tensor]]:
    """Flat outputs of ``model`` called on each of ``inputs`` in order (its state carrying
    over), its buffers as they were afterwards."""
    with restored_buffers(model), torch.no_grad():
        return [pytree.tree_leaves(model(*each)) for each in inputs]


@contextlib.contextmanager
def restored_buffers(model: torch.nn.Module):
    """Run the block, then put every buffer of ``model`` back: the same tensor object
    under its name, holding the values it had (a KV cache written in place, or a buffer
    the block rebound)."""
    saved = {name: (buffer, buffer.detach().clone()) for name, buffer in model.named_buffers()}
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, (buffer, values) in saved.items():
                buffer.copy_(values)
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner) if owner else model
                if module._buffers.get(attr) is not buffer:
                    module._buffers[attr] = buffer


def _pte_size(pte: Pte) -> int:
    return len(pte) if isinstance(pte, bytes) else os.path.getsize(pte)


@dataclasses.dataclass
class _Case:
    """One input set of one method: what each runtime runs, and eager's outputs."""

    method: str
    label: str
    flat_inputs: list
    expected: list
    quantized: dict | None = None


def _cases(model, example_inputs, calls, method, dynamic_shapes, reference, min_sqnr, max_error):
    """(the input sets :func:`verify` runs, with eager's outputs; the quantized reference's accuracy)."""
    from .dynamic import inputs_at_sizes

    cases, reference_accuracy = [], None
    for label, inputs in inputs_at_sizes(model, example_inputs, dynamic_shapes):
        expected = _eager(model, inputs, calls)
        quantized = None
        if reference is not None:
            fp32, expected = expected, _eager(reference.module(), inputs, calls)
            nudged = _eager(nudged_reference(reference), inputs, calls)
            quantized = {"fp32": fp32, "nudged": nudged, "min_sqnr": min_sqnr, "max_error": max_error}
            if reference_accuracy is None:
                reference_accuracy = outputs_error(expected[0], fp32[0])
        cases.append(_Case(method, label, pytree.tree_leaves(tuple(inputs)), expected, quantized))
    return cases, reference_accuracy


def _run_cases(pte: Pte, cases: list[_Case], calls: int, atol: float, rtol: float) -> list[list[RuntimeCheck]]:
    """Per case, its checks: lowerflow's executor, then ExecuTorch's runtime (which runs
    every case in one :meth:`~lowering.verify_executorch.ExecutorchRunner.batch`)."""
    backend_ids = delegate_backend_ids(pte)
    missing_lowerflow = _missing_lowerflow_runtimes(backend_ids)
    runner = executorch_runner()
    skipped = None
    ours = _LoadedOnce(pte)
    if runner is not None:
        missing_executorch = runner.missing_backends(backend_ids)
        missing_ops = runner.missing_operators(program_operators(pte))
        if missing_executorch:
            skipped = f"backends not in this runtime: {missing_executorch}"
        elif missing_ops:
            # E.g. a backend's fused op no backend took (lowering.backend_ops): ExecuTorch
            # refuses to load the method ("Missing operator", error 0x14); lowerflow's
            # executor runs it through the op's own kernel.
            skipped = f"operators not in this runtime: {missing_ops}"
    executorch = []
    if runner is not None and skipped is None:
        jobs = [([case.method], [(case.method, case.flat_inputs)] * calls) for case in cases]
        try:
            executorch = runner.batch(pte, jobs)
        except Exception as exc:  # e.g. bytes that are no program
            executorch = [exc] * len(jobs)
    out = []
    for i, case in enumerate(cases):
        if missing_lowerflow:
            check = RuntimeCheck("lowerflow", None, skipped=f"no backend runtime for {missing_lowerflow}")
        else:
            check = _check("lowerflow", lambda: _run_lowerflow(ours.bytes(), case.flat_inputs, calls, case.method),
                           case.expected, atol, rtol, case.quantized)
        checks = [dataclasses.replace(check, inputs=case.label)]
        if runner is not None:
            if skipped is not None:
                check = RuntimeCheck("executorch", None, skipped=skipped)
            else:
                check = _check("executorch", lambda: batch_outputs(executorch[i]), case.expected, atol, rtol,
                               case.quantized)
            checks.append(dataclasses.replace(check, inputs=case.label))
        out.append(checks)
    return out


def _eager(model: torch.nn.Module, inputs: Sequence[Any], calls: int) -> list[list[torch.Tensor]]:
    """Flat outputs of ``calls`` successive calls of a fresh copy of ``model``."""
    reference = fresh_copy(model)
    with torch.no_grad():
        return [pytree.tree_leaves(reference(*inputs)) for _ in range(calls)]


def fresh_copy(modules: Any) -> Any:
    """A deep copy of ``modules`` (a module, or a dict of modules copied together) whose
    state starts afresh, sharing the parameters: running it under ``no_grad`` writes
    its buffers (a KV cache), never its weights, so copying those would only hold a
    second copy of the model while verify runs."""
    import copy

    found = modules.values() if isinstance(modules, dict) else [modules]
    shared = {id(p): p for module in found for p in module.parameters()}
    return copy.deepcopy(modules, shared)


def verify_methods(
    pte: Pte, methods: dict[str, tuple[Any, ...]], constants: dict[str, Any] | None = None,
    *, atol: float = 1e-4, rtol: float = 1e-4, calls: int = 2, mode: str = "full",
) -> dict[str, VerifyReport]:
    """:func:`verify` each method of a several-method ``pte`` against its eager module
    (``mode`` ``"quick"``: :func:`verify_quick` each, one method's calls after another).

    ``methods``: ``{name: (module, example_inputs[, dynamic_shapes])}``; ``constants``: the
    constant methods ``{name: value}`` (an hf: model's metadata), checked on lowerflow's
    runtime.  A method the program lacks (or has beyond these) is a failed report, not a
    skipped one.  ExecuTorch's runtime gets every method's runs at once (one batch).
    """
    if mode not in ("full", "quick"):
        raise ValueError(f"verify_methods runs mode 'full' or 'quick', not {mode!r}")
    names = set(method_names(pte))
    constants = {} if constants is None else constants
    reports: dict[str, VerifyReport | None] = {}
    cases: dict[str, list[_Case]] = {}
    for name in sorted(set(methods) | set(constants) | names):
        if name in constants and name in names:
            reports[name] = _verify_constant(pte, name, constants[name])
        elif name not in methods and name not in constants:
            reports[name] = VerifyReport([RuntimeCheck("lowerflow", False, error=f"method {name!r} is not in the model")])
        elif name not in names:
            reports[name] = VerifyReport([RuntimeCheck("lowerflow", False, error=f"the program has no method {name!r}")])
        elif mode == "quick":
            module, inputs, *_ = methods[name]
            reports[name] = verify_quick(pte, module, inputs, atol=atol, rtol=rtol, method=name)
        else:
            module, inputs, *dynamic_shapes = methods[name]
            cases[name] = _cases(module, inputs, calls, name, (dynamic_shapes or [None])[0], None, None, None)[0]
            reports[name] = None  # its place in name order
    for name in cases:
        page_out_module(methods[name][0])
    checks = iter(_run_cases(pte, [case for each in cases.values() for case in each], calls, atol, rtol))
    for name, each in cases.items():
        reports[name] = VerifyReport([check for _ in each for check in next(checks)])
    return reports


def _verify_constant(pte: Pte, name: str, value: Any) -> VerifyReport:
    """The constant method ``name`` returns ``value`` (a list: its items) on lowerflow's runtime."""
    got = [v.item() if isinstance(v, torch.Tensor) else v
           for v in load(_LoadedOnce(pte).bytes(), data_bytes(pte)).run(name, [])]
    ok = got == (list(value) if isinstance(value, (list, tuple)) else [value])
    return VerifyReport([RuntimeCheck("lowerflow", ok, error=None if ok else f"{name} is {got}, expected {value!r}")])


def verify_call_sequence(
    pte: Pte,
    methods: dict[str, tuple[torch.nn.Module, Sequence[Any]]],
    sequence: Sequence[tuple[str, Sequence[Any]]] | None = None,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    references: dict[str, Any] | None = None,
) -> VerifyReport:
    """Run a sequence of method calls on ONE loaded program in each runtime against one
    copy of the eager modules run in the same order: the check of state shared
    across methods (``prefill`` then ``decode`` reading its KV cache).

    ``references``: a quantized program's ``{method: quantized ExportedProgram}``; they run
    in torch with their buffers of one name tied into one tensor (the state the methods
    share), the runtimes must match them as :func:`verify` matches a quantized method, and
    the error against the fp32 modules is reported.

    ``methods``: ``{name: (module, example_inputs)}``, deep-copied together so modules
    sharing a submodule still share it.  ``sequence``: ``[(method, inputs), ...]``;
    default :func:`round_robin` (every method on its example inputs in program
    order, twice, so each method runs after every other one).  Every method is
    loaded before the first call (loading a method writes its initial state).
    """
    if sequence is None:
        sequence = round_robin(methods)
    calls = [(name, pytree.tree_leaves(tuple(inputs))) for name, inputs in sequence]
    expected = _eager_sequence(fresh_copy({name: module for name, (module, _) in methods.items()}), sequence)
    for module, _ in methods.values():
        page_out_module(module)
    quantized = None
    if references:
        references = {name: as_delegated(ref, pte) for name, ref in references.items()}
        fp32, expected = expected, _eager_sequence(tied_references(references), sequence)
        nudged = _eager_sequence({name: nudged_reference(module) for name, module in tied_references(references).items()},
                                 sequence)
        quantized = {"fp32": fp32, "nudged": nudged, "min_sqnr": None, "max_error": None}
    names = sorted(methods)
    backend_ids = delegate_backend_ids(pte)
    missing = _missing_lowerflow_runtimes(backend_ids)
    if missing:
        checks = [RuntimeCheck("lowerflow", None, skipped=f"no backend runtime for {missing}")]
    else:
        checks = [_check("lowerflow", lambda: _run_lowerflow_sequence(_LoadedOnce(pte).bytes(), names, calls),
                         expected, atol, rtol, quantized)]
    executorch = _executorch_sequence_check(pte, names, calls, expected, atol, rtol, quantized)
    return VerifyReport(checks if executorch is None else [*checks, executorch])


def _eager_sequence(modules: dict[str, Any], sequence) -> list[list[torch.Tensor]]:
    with torch.no_grad():
        return [pytree.tree_leaves(modules[name](*inputs)) for name, inputs in sequence]


#: The backend that stores 4-bit group scales in bf16 (lowering.backends.xnnpack.ops.quantized).
XNNPACK_ID = "XnnpackBackend"


def as_delegated(reference: Any, pte: Pte) -> Any:
    """The quantized ``reference`` (ExportedProgram) as ``pte``'s delegates run it: where
    XNNPACK runs the program, its 4-bit group scales rounded to bf16 as XNNPACK stores them
    (:func:`lowering.quantize.dynamic.bf16_group_scales`; with fp32 scales SmolLM2-135M 8da4w's
    30 layers drift past the tolerance, issue 27), else ``reference`` itself."""
    if reference is None or XNNPACK_ID not in delegate_backend_ids(pte):
        return reference
    from .quantize.dynamic import bf16_group_scales

    return bf16_group_scales(reference)


def nudged_reference(reference: Any) -> torch.nn.Module:
    """The quantized ``reference`` (an ExportedProgram, or a module of one) to run with its
    dynamic activation scales nudged by a rounding
    (:func:`lowering.quantize.dynamic.nudged_activation_scales`): how far its outputs move
    is part of a runtime's tolerance (:func:`lowering.accuracy.quantized_tolerance`)."""
    from .quantize.dynamic import nudged_activation_scales

    module = reference if isinstance(reference, torch.fx.GraphModule) else reference.module()
    return nudged_activation_scales(module)


def tied_references(programs: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """``{method: program.module()}`` with every buffer of one name one tensor (the first
    method's, in name order), so a buffer one method writes is what the others read."""
    modules = {name: programs[name].module() for name in sorted(programs)}
    seen: dict[str, torch.Tensor] = {}
    for module in modules.values():
        for fqn, buffer in list(module.named_buffers()):
            if fqn not in seen:
                seen[fqn] = buffer
                continue
            owner, _, leaf = fqn.rpartition(".")
            (module.get_submodule(owner) if owner else module)._buffers[leaf] = seen[fqn]
    return modules


def round_robin(methods: dict[str, tuple[Any, Sequence[Any]]], rounds: int = 2) -> list[tuple[str, Sequence[Any]]]:
    """Every method on its example inputs, in name (program) order, ``rounds`` times."""
    return [(name, methods[name][1]) for _ in range(rounds) for name in sorted(methods)]


def _run_lowerflow_sequence(pte: bytes, names: list[str], calls: list) -> list[list[torch.Tensor]]:
    program = load(pte, data_bytes(pte))
    for name in names:
        program.method(name)
    return [program.run(name, inputs) for name, inputs in calls]


def method_names(pte: Pte) -> list[str]:
    """The names of the program's methods, in program order (only its table is read)."""
    from .pte.format import decode_string, program_table

    return [decode_string(plan.name) for plan in program_table(pte).executionPlan or []]


def delegate_backend_ids(pte: Pte) -> list[str]:
    """The backend ids of the program's delegates, in order of first use (only its table is read)."""
    from .pte.format import decode_string, program_table

    ids = []
    for plan in program_table(pte).executionPlan or []:
        for delegate in plan.delegates or []:
            backend = decode_string(delegate.id)
            if backend not in ids:
                ids.append(backend)
    return ids


def _check(name, run, expected, atol, rtol, quantized: dict | None = None) -> RuntimeCheck:
    """Run and compare with ``expected`` (allclose; a quantized program: within
    :func:`~lowering.accuracy.quantized_tolerance` of its reference (``quantized["nudged"]``:
    the nudged reference's outputs, as ``expected``), then its error
    against ``quantized["fp32"]`` held to the thresholds)."""
    try:
        actual = run()
    except Exception as exc:
        return RuntimeCheck(name, False, error=f"{type(exc).__name__}: {exc}")
    worst = 0.0
    for i, (got_call, want_call) in enumerate(zip(actual, expected)):
        if len(got_call) != len(want_call):
            return RuntimeCheck(name, False, error=f"{len(got_call)} outputs, expected {len(want_call)}")
        for k, (got, want) in enumerate(zip(got_call, want_call)):
            if got.shape != want.shape or got.dtype != want.dtype:
                return RuntimeCheck(name, False, error=f"output {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}")
            if want.numel():
                worst = max(worst, (got.double() - want.double()).abs().max().item())
            if quantized is not None:
                tolerance = quantized_tolerance(want, quantized["nudged"][i][k])
                if want.numel() and (got.double() - want.double()).abs().max().item() > tolerance:
                    return RuntimeCheck(name, False, worst, error="outputs differ from the quantized eager reference "
                                        f"by more than {QUANT_STEPS} steps of the output's int8 grid and more than "
                                        "the reference moves with its activation scales nudged by a rounding "
                                        f"({tolerance:.3g})")
            elif not torch.allclose(got, want, atol=atol, rtol=rtol):
                return RuntimeCheck(name, False, worst, error="outputs differ from eager")
    if quantized is None:
        return RuntimeCheck(name, True, worst)
    accuracy = outputs_error(actual[0], quantized["fp32"][0])
    broken = threshold_error(accuracy, quantized["min_sqnr"], quantized["max_error"])
    return RuntimeCheck(name, broken is None, worst, error=broken, accuracy=accuracy)


def _missing_lowerflow_runtimes(backend_ids: list[str]) -> list[str]:
    from .runtime import ExecutorError, backend_runtime

    missing = []
    for backend in backend_ids:
        try:
            backend_runtime(backend)
        except ExecutorError:
            missing.append(backend)
    return missing


def _run_lowerflow(pte: bytes, inputs: list, calls: int, method_name: str = "forward") -> list[list[torch.Tensor]]:
    method = load(pte, data_bytes(pte)).method(method_name)
    return [method.execute(inputs) for _ in range(calls)]


class _LoadedOnce:
    """A program's bytes for lowerflow's runtime (which parses bytes), read from its file
    at most once, and only if asked for."""

    def __init__(self, pte: Pte) -> None:
        self.pte = pte
        self._bytes = pte if isinstance(pte, bytes) else None

    def bytes(self) -> bytes:
        if self._bytes is None:
            with open(self.pte, "rb") as f:
                self._bytes = with_data(f.read(), data_of(self.pte))
        return self._bytes
