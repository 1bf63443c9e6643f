"""Whole lowering, lowerflow vs ExecuTorch, on every model in ``examples.models``.

ExecuTorch: ``torch.export.export`` + ``to_edge`` + ``to_executorch``.
lowerflow: ``lowering.lower`` (export, memory plan, emit); until the emitter
lands (``lowering/emit.py``), export + memory plan only, and the .pte columns
stay empty.  Both run in this process; each figure is the median of
``--reps`` runs.  Targets: time <= 0.5x ExecuTorch, arena <= ExecuTorch.

Stage 1 options (``lowering.export``): ``--slow`` forces the full retrace
(``run_decompositions()``) instead of the fast path, ``--fold`` folds
view-copies of weights into constants; ``--before`` adds columns for
lowerflow with the slow path (what stage 1 did before the fast path), measured
in the same run so that the two ratios compare.

    python bench/bench_lower.py [--reps N] [--slow] [--fold] [--before] [model ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import MODELS  # noqa: E402
from lowering.export import export  # noqa: E402

# The module (``lowering.export`` the attribute is the function of that name).
stage1 = importlib.import_module("lowering.export")
from lowering.memory_plan import memory_plan  # noqa: E402

HAS_EMIT = importlib.util.find_spec("lowering.emit") is not None


@dataclass
class Run:
    seconds: float
    arena: int
    lower_bound: int | None
    pte_bytes: int | None
    export_seconds: float | None = None  # lowerflow only: the export stage alone


def run_executorch(name: str) -> Run:
    from executorch.exir import to_edge

    model, inputs = MODELS[name]()
    start = time.perf_counter()
    with torch.no_grad():
        program = to_edge(torch.export.export(model, inputs, strict=False)).to_executorch()
        pte = program.buffer
    seconds = time.perf_counter() - start
    sizes = program.executorch_program.execution_plan[0].non_const_buffer_sizes
    return Run(seconds, sizes[1] if len(sizes) > 1 else 0, None, len(pte))


def run_lowerflow(name: str, *, fast: bool | None = None, fold: bool | None = None) -> Run:
    saved = stage1.FAST_PATH, stage1.FOLD_CONSTANTS
    stage1.FAST_PATH = saved[0] if fast is None else fast
    stage1.FOLD_CONSTANTS = saved[1] if fold is None else fold
    try:
        return _run_lowerflow(name)
    finally:
        stage1.FAST_PATH, stage1.FOLD_CONSTANTS = saved


def _run_lowerflow(name: str) -> Run:
    model, inputs = MODELS[name]()
    start = time.perf_counter()
    with torch.no_grad():
        if HAS_EMIT:
            from lowering.lower import lower

            result = lower(model, inputs)
            plan, pte_bytes, export_seconds = result.memory_plan, len(result.pte), result.timings["export"]
        else:
            program = export(model, inputs)
            export_seconds = time.perf_counter() - start
            plan, pte_bytes = memory_plan(program), None
    seconds = time.perf_counter() - start
    return Run(seconds, plan.arena_bytes, plan.lower_bound, pte_bytes, export_seconds)


def median_run(fn, name: str, reps: int, **options) -> Run:
    runs = [fn(name, **options) for _ in range(reps)]
    last = runs[-1]
    export_seconds = (
        statistics.median(r.export_seconds for r in runs) if last.export_seconds is not None else None
    )
    return Run(
        statistics.median(r.seconds for r in runs), last.arena, last.lower_bound, last.pte_bytes, export_seconds
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slow", action="store_true", help="stage 1 by run_decompositions() (no fast path)")
    parser.add_argument("--fold", action="store_true", help="fold view-copies of weights into constants")
    parser.add_argument("--before", action="store_true", help="also time lowerflow with the slow path")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    options = {"fast": not args.slow, "fold": args.fold or None}

    mode = "lower()" if HAS_EMIT else "export + memory_plan (no emitter yet)"
    stage = f"stage 1 {'slow' if args.slow else 'fast'} path{', folded constants' if args.fold else ''}"
    print(f"lowerflow = {mode}, {stage}; median of {args.reps} runs; 'export' = share of LF time in stage 1")
    if args.before:
        print("'slow s' / 'slow' = lowerflow with the slow stage 1 (run_decompositions), same run")
    print()
    before = f" {'slow s':>7} {'slow':>6}" if args.before else ""
    header = (
        f"{'model':16} {'ET s':>7} {'LF s':>7} {'time':>6} {'export':>7}{before}   {'ET arena':>9} {'LF arena':>9} "
        f"{'arena':>6}   {'LF LB':>9} {'arena/LB':>8}   {'ET .pte':>8} {'LF .pte':>8} {'.pte':>6}"
    )
    print(header)
    print("-" * len(header))
    time_ratios, arena_ratios, lb_ratios, slow_ratios = [], [], [], []
    for name in args.models:
        et = median_run(run_executorch, name, args.reps)
        lf = median_run(run_lowerflow, name, args.reps, **options)
        if args.before:
            slow = median_run(run_lowerflow, name, args.reps, fast=False, fold=False)
            slow_ratios.append(slow.seconds / et.seconds)
            before = f" {slow.seconds:7.3f} {slow_ratios[-1]:6.3f}"
        t = lf.seconds / et.seconds
        a = lf.arena / et.arena if et.arena else 1.0
        lb = lf.arena / lf.lower_bound if lf.lower_bound else 1.0
        time_ratios.append(t)
        arena_ratios.append(a)
        lb_ratios.append(lb)
        pte = f"{lf.pte_bytes:>8} {lf.pte_bytes / et.pte_bytes:>6.3f}" if lf.pte_bytes else f"{'-':>8} {'-':>6}"
        print(
            f"{name:16} {et.seconds:7.3f} {lf.seconds:7.3f} {t:6.3f} {lf.export_seconds / lf.seconds:7.1%}{before}   "
            f"{et.arena:9} {lf.arena:9} "
            f"{a:6.3f}   {lf.lower_bound:9} {lb:8.3f}   {et.pte_bytes:8} {pte}"
        )
    print("-" * len(header))
    before = f" {'':7} {_geomean(slow_ratios):6.3f}" if args.before else ""
    print(
        f"{'geomean':16} {'':7} {'':7} {_geomean(time_ratios):6.3f} {'':7}{before}   {'':9} {'':9} "
        f"{_geomean(arena_ratios):6.3f}   {'':9} {_geomean(lb_ratios):8.3f}"
    )


def _geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else float("nan")


if __name__ == "__main__":
    main()
