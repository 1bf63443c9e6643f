"""ExecuTorch's own backends as lowerflow targets vs ExecuTorch's own lowering, per model, one run.

Lowering time (export included in both): lowerflow's
``lowering.lower(model, inputs, partitioner=partitioner_for(target))`` vs ExecuTorch's
``to_edge_transform_and_lower(torch.export.export(...), partitioner=[the same ExecuTorch
partitioner]).to_executorch().buffer``, each warmed up once first (first-in-process imports
and pattern builds left out), same machine, same run.  For ``openvino``: latency on the stock
runtime of lowerflow's program vs ExecuTorch's OpenVINO program vs lowerflow's XNNPACK program,
interleaved call by call (median of ``--calls`` after 20 warm-up calls), and max |error| vs eager;
lowerflow's ``precision: f32`` OpenVINO program is timed with them.  ``ethos-u`` is lowered int8
on both sides, each quantizing with Arm's EthosUQuantizer on the one calibration batch.

Targets whose compiler or runtime is missing here are left out with the reason.

    python bench/bench_backends.py [--calls N] [--targets openvino,vulkan,coreml,ethos-u] [model ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import MODELS  # noqa: E402
from lowering.errors import BackendError  # noqa: E402
from lowering.lower import lower  # noqa: E402
from lowering.targets import check_target, partitioner_for  # noqa: E402


#: Targets lowered int8 (as the backend requires), with its own quantizer on both sides.
INT8 = {"ethos-u"}


def lowerflow_lower(model, inputs, target: str, options: dict | None = None) -> bytes:
    quantize = {"quantize": "int8", "calibration": [inputs]} if target in INT8 else {}
    return lower(model, inputs, partitioner=partitioner_for(target, options), **quantize).pte


def executorch_lower(model, inputs, target: str) -> bytes:
    """ExecuTorch's own lowering; ``ethos-u``: Arm's quantizer first (prepare, calibrate, convert)."""
    from executorch.exir import to_edge_transform_and_lower

    from lowering.backends.executorch.options import QUANTIZERS, check_options, make_et_partitioner
    from lowering.backends.executorch.targets import TARGETS
    from lowering.quantize import parse_recipe

    options = check_options(TARGETS[target], {})
    exported = torch.export.export(model, inputs)
    if target in INT8:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        prepared = prepare_pt2e(exported.module(check_guards=False), QUANTIZERS[target](options, parse_recipe("int8")))
        prepared(*inputs)
        exported = torch.export.export(convert_pt2e(prepared), inputs)
    et = make_et_partitioner(TARGETS[target], options)
    program = to_edge_transform_and_lower(exported, partitioner=[et])
    return program.to_executorch().buffer


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def interleaved(methods: dict, inputs, calls: int) -> dict[str, float]:
    """Median microseconds per call of each loaded method, calls interleaved."""
    for _ in range(20):
        for method in methods.values():
            method.execute(list(inputs))
    samples = {name: [] for name in methods}
    for _ in range(calls):
        for name, method in methods.items():
            start = time.perf_counter()
            method.execute(list(inputs))
            samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--targets", default="openvino,vulkan,coreml,ethos-u")
    parser.add_argument("models", nargs="*", default=["mlp", "cnn"])
    args = parser.parse_args()
    targets = []
    for target in args.targets.split(","):
        try:
            check_target(target)
            targets.append(target)
        except BackendError as exc:
            print(f"# {target}: left out: {exc}")
    print(f"# load average {os.getloadavg()[0]:.1f} (1 min) at start")
    print("model   target    lowerflow s  executorch s  ratio   lowerflow B  executorch B")
    for name in args.models:
        model, inputs = MODELS[name]()
        programs = {}
        for target in targets:
            try:
                lowerflow_lower(model, inputs, target)  # warm-up
                executorch_lower(model, inputs, target)
                ours_s, ours = timed(lowerflow_lower, model, inputs, target)
                theirs_s, theirs = timed(executorch_lower, model, inputs, target)
            except Exception as exc:  # (Core ML's CNN: coremltools 9.0 fails for both, on max_pool2d)
                print(f"{name:7s} {target:9s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            programs[target] = (ours, theirs)
            print(f"{name:7s} {target:9s} {ours_s:11.2f}  {theirs_s:12.2f}  {ours_s / theirs_s:5.2f}  "
                  f"{len(ours):11,d}  {len(theirs):12,d}")
        if "openvino" in programs:
            from executorch.runtime import Runtime

            runtime = Runtime.get()
            xnnpack = lowerflow_lower(model, inputs, "xnnpack")
            f32 = lowerflow_lower(model, inputs, "openvino", {"precision": "f32"})
            loaded = {label: runtime.load_program(pte) for label, pte in (
                ("lowerflow openvino", programs["openvino"][0]), ("executorch openvino", programs["openvino"][1]),
                ("lowerflow openvino f32", f32), ("lowerflow xnnpack", xnnpack))}
            # Keep each Program referenced: a Method does not keep its Program alive (a segfault otherwise).
            methods = {label: program.load_method("forward") for label, program in loaded.items()}
            eager = model(*inputs)
            for label, method in methods.items():
                error = (method.execute(list(inputs))[0] - eager).abs().max().item()
                print(f"{name:7s} {label:22s} max |error| vs eager {error:.2e}")
            for label, micros in interleaved(methods, inputs, args.calls).items():
                print(f"{name:7s} {label:22s} median {micros:8.1f} us")


if __name__ == "__main__":
    main()
