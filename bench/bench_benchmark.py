"""What the benchmark stage costs a night, and how steady its ratios are (issue 30).

1. The demo fleet (examples/fleet.yaml) through ``lowerflow fleet``, cold (a fresh store)
   with the benchmark stage and without it (``defaults: {benchmark: false}``), in turns,
   ``--rounds`` times each: the cold nights' wall-clock ratio with / without (target <= 1.20);
   then a warm night of each (target: the same).
2. Ten ``--ratio-runs`` of the stage's interleaved comparison between two IDENTICAL programs
   (the same bytes in two files) for each program the cold night published: every ratio
   new/old should be 1 (target 0.95-1.05 on this 2-core shared machine); min, max and spread.

The machine's load average is printed with the figures (other work on it moves them).

    python bench/bench_benchmark.py [--rounds 2] [--ratio-runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fleet_manifest(work: Path, name: str, benchmark: bool) -> Path:
    """examples/fleet.yaml with its own store under ``work`` and the benchmark on or off."""
    doc = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
    doc["store"] = str(work / f"store-{name}")
    doc.setdefault("defaults", {})["benchmark"] = benchmark
    for model in doc["models"]:
        for key in ("model", "calibration"):
            if key in model:
                model[key] = str(ROOT / "examples" / model[key])
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def night(manifest: Path, home: Path) -> float:
    """Wall-clock seconds of one ``lowerflow fleet`` (its own Prefect home: ephemeral server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "fleet", str(manifest)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(f"  ({manifest.name} failed: {done.stderr.strip().splitlines()[-1:]})")
    return seconds


def ratio_runs(store: Path, runs: int) -> dict[str, list[float]]:
    """Per published program: ``runs`` latency ratios of it against a copy of itself."""
    from lowering.benchmark import BenchmarkSettings, benchmark_pte, round_calls
    from tasks.model_spec import ModelSpec, load_model

    fleet = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
    out: dict[str, list[float]] = {}
    for entry in fleet["models"]:
        name = entry.get("name")
        loaded = load_model(ModelSpec.parse(str(ROOT / "examples" / entry["model"])))
        calls, prefill = round_calls(loaded.module, loaded.inputs, BenchmarkSettings())
        for pte in sorted((store / "outputs" / name).glob("*.pte")):
            copy = Path(tempfile.mkdtemp(prefix="lowerflow-bench-copy-")) / pte.name
            shutil.copyfile(pte, copy)
            ratios = []
            for _ in range(runs):
                report = benchmark_pte(str(pte), ["forward"], calls, BenchmarkSettings(), previous=str(copy),
                                       prefill_calls=prefill)
                if "ratios" not in report:
                    print(f"  {name}/{pte.stem}: {report.get('skipped')}")
                    break
                ratios.append(report["ratios"]["latency"])
            if ratios:
                out[f"{name}/{pte.stem}"] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ratio-runs", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lowerflow-bench-benchmark-"))
    cold: dict[str, list[float]] = {"with": [], "without": []}
    warm: dict[str, float] = {}
    for round_ in range(args.rounds):
        order = ("with", "without") if round_ % 2 == 0 else ("without", "with")
        for kind in order:
            name = f"{kind}-{round_}"
            manifest = fleet_manifest(work, name, benchmark=kind == "with")
            cold[kind].append(night(manifest, work / f"home-{name}"))
            print(f"cold night {kind:<7} benchmark: {cold[kind][-1]:6.1f} s (load {os.getloadavg()[0]:.1f})")
            if round_ == 0:
                warm[kind] = night(manifest, work / f"home-{name}")
                print(f"warm night {kind:<7} benchmark: {warm[kind]:6.1f} s (load {os.getloadavg()[0]:.1f})")
    ratio = sum(cold["with"]) / sum(cold["without"])
    print(f"cold: with / without benchmark = {ratio:.3f} (target <= 1.20); "
          f"warm: {warm['with'] / warm['without']:.3f} (target ~1.00)")
    ratios = ratio_runs(Path(yaml.safe_load(fleet_manifest(work, "with-0", True).read_text())["store"]),
                        args.ratio_runs)
    every = [r for rs in ratios.values() for r in rs]
    for program, rs in ratios.items():
        print(f"  {program:<28} ratio min {min(rs):.3f} max {max(rs):.3f}  {json.dumps(rs)}")
    print(f"identical programs, {len(ratios)} programs x {args.ratio_runs} runs: latency ratio "
          f"min {min(every):.3f} max {max(every):.3f} (target 0.95-1.05); "
          f"within: {sum(0.95 <= r <= 1.05 for r in every)}/{len(every)}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
