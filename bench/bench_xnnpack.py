"""The ``xnnpack`` target, lowerflow vs ExecuTorch's own XNNPACK lowering, per model, one run.

ExecuTorch: ``torch.export.export`` + ``to_edge_transform_and_lower(ep,
partitioner=[XnnpackPartitioner()])`` + ``to_executorch()`` + ``.buffer``.
lowerflow: ``lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack"))``
(export included, as both columns include it).  Both flows are warmed up once
first (ExecuTorch's first XNNPACK lowering in a process builds pattern graphs for
~6 s; that one-time cost is left out).

Columns: lowering seconds and ratio; KernelCall instructions left outside
delegates (and DelegateCalls); latency on the ExecuTorch runtime of both .pte
files, interleaved call by call (median of ``--calls`` calls each, after 20
warm-up calls); .pte bytes.  Models: ``examples.models`` and, when
``transformers`` is installed, ``examples.hf_models``.

Targets: KernelCalls <= ExecuTorch's on every model; latency <= 1.05x (geomean),
<= 1.25x each; lowering time <= 0.25x (geomean).

    python bench/bench_xnnpack.py [--calls N] [model ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import MODELS  # noqa: E402
from lowering.lower import lower  # noqa: E402
from lowering.pte import deserialize, schema  # noqa: E402
from lowering.targets import partitioner_for  # noqa: E402


def _all_models() -> dict:
    from examples.models import gru

    models = {**MODELS, "gru": gru}  # a GRU beside the fleet's LSTM (recurrent nets, issue 20)
    try:
        from examples import hf_models
    except ImportError:
        return models
    models.update({f"hf_{k}": v for k, v in hf_models.MODELS.items()})
    return models


@dataclass
class Lowered:
    seconds: float
    pte: bytes


def lower_executorch(factory) -> Lowered:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model, inputs = factory()
    start = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model, inputs, strict=False)
        pte = bytes(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    return Lowered(time.perf_counter() - start, pte)


def lower_lowerflow(factory) -> Lowered:
    model, inputs = factory()
    start = time.perf_counter()
    with torch.no_grad():
        pte = lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte
    return Lowered(time.perf_counter() - start, pte)


def instruction_counts(pte: bytes) -> tuple[int, int]:
    """(KernelCalls, DelegateCalls) of ``forward``."""
    plan = deserialize(pte).program.executionPlan[0]
    kinds = [i.instrArgsType for c in plan.chains for i in c.instructions]
    return kinds.count(schema.InstructionArguments.KernelCall), kinds.count(schema.InstructionArguments.DelegateCall)


def latencies(ptes: list[bytes], inputs, calls: int) -> list[float]:
    """Median ms per call of each program on ExecuTorch's runtime, calls interleaved."""
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    programs = [runtime.load_program(p) for p in ptes]  # kept alive: a Method needs its Program
    methods = [p.load_method("forward") for p in programs]
    args = list(inputs)
    for _ in range(20):
        for m in methods:
            m.execute(args)
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(calls):
        for m, t in zip(methods, times):
            start = time.perf_counter()
            m.execute(args)
            t.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def check_outputs(pte: bytes, factory, inputs) -> float:
    """max |Δ| of ExecuTorch's runtime running ``pte`` against eager."""
    from executorch.runtime import Runtime

    model, _ = factory()
    with torch.no_grad():
        expected = torch.utils._pytree.tree_leaves(model(*inputs))
    got = Runtime.get().load_program(pte).load_method("forward").execute(list(inputs))
    return max(float((a - e).abs().max()) for a, e in zip(got, expected) if e.dtype.is_floating_point)


def main(argv: list[str] | None = None) -> None:
    models = _all_models()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("models", nargs="*", default=list(models))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    lower_executorch(MODELS["mlp"])  # warm-ups: one-time costs of both flows
    lower_lowerflow(MODELS["mlp"])
    print(f"one run per model; latency = median of {args.calls} interleaved calls on ExecuTorch's runtime\n")
    header = (
        f"{'model':16} {'ET s':>7} {'LF s':>7} {'time':>6}   {'ET kc':>5} {'LF kc':>5} {'ET dc':>5} {'LF dc':>5}   "
        f"{'ET ms':>7} {'LF ms':>7} {'lat':>6}   {'ET .pte':>9} {'LF .pte':>9} {'.pte':>6}   {'LF max|Δ|':>9}"
    )
    print(header)
    print("-" * len(header))
    time_ratios, latency_ratios, kc_ok = [], [], []
    for name in args.models:
        factory = models[name]
        et = lower_executorch(factory)
        lf = lower_lowerflow(factory)
        et_kc, et_dc = instruction_counts(et.pte)
        lf_kc, lf_dc = instruction_counts(lf.pte)
        _, inputs = factory()
        et_ms, lf_ms = latencies([et.pte, lf.pte], inputs, args.calls)
        error = check_outputs(lf.pte, factory, inputs)
        time_ratios.append(lf.seconds / et.seconds)
        latency_ratios.append(lf_ms / et_ms)
        kc_ok.append(lf_kc <= et_kc)
        print(
            f"{name:16} {et.seconds:7.2f} {lf.seconds:7.2f} {time_ratios[-1]:6.3f}   "
            f"{et_kc:5} {lf_kc:5} {et_dc:5} {lf_dc:5}   {et_ms:7.3f} {lf_ms:7.3f} {latency_ratios[-1]:6.3f}   "
            f"{len(et.pte):9,} {len(lf.pte):9,} {len(lf.pte) / len(et.pte):6.3f}   {error:9.2e}"
        )
        sys.stdout.flush()
    print("-" * len(header))
    print(
        f"{'geomean':16} {'':7} {'':7} {_geomean(time_ratios):6.3f}   "
        f"{'':5} {'':5} {'':5} {'':5}   {'':7} {'':7} {_geomean(latency_ratios):6.3f}"
    )
    print(
        f"\ntargets: time <= 0.25x geomean: {_geomean(time_ratios) <= 0.25}; "
        f"latency <= 1.05x geomean: {_geomean(latency_ratios) <= 1.05}, <= 1.25x each: "
        f"{max(latency_ratios) <= 1.25}; KernelCalls <= ExecuTorch's on every model: {all(kc_ok)}"
    )


def _geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else float("nan")


if __name__ == "__main__":
    main()
