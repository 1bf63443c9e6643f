"""Orchestration benchmark: the demo models as a fleet, through Prefect and the store.

Measured in one run, on a standalone ``prefect server start`` (what a nightly
deployment talks to; started here on a free loopback port, in a temporary home):

* cold fleet run (empty store) vs warm re-run (everything cached) — target warm <= 5% of cold;
* orchestrated cold run vs ``lowering.lower`` alone on the same models and targets:
  the orchestration overhead per model;
* resume after an injected emit failure vs the emit stage's own time.

    python bench/bench_fleet.py [--models mlp,cnn,...] [--targets portable,reference] [--ephemeral]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_MODELS = "mlp,cnn,lstm,transformer,buffer_mutation,lifted_constant,multi_output,integer_inputs"


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` on a free port; returns (process, API URL) once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api"
    if wait_healthy(url, 120):
        return proc, url
    proc.kill()
    raise RuntimeError("prefect server did not become healthy in 120 s")


def wait_healthy(url: str, timeout: float) -> bool:
    """True once the Prefect API at ``url`` answers its health check, False after ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def fleet(store: Path, models: list[str], targets: list[str]) -> dict:
    return {
        "store": str(store),
        "defaults": {"targets": targets},
        "models": [{"name": m, "model": f"{ROOT / 'examples' / 'models.py'}:{m}"} for m in models],
    }


def timed(fn, *args):
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:  # FleetFailed carries the summary
        result = getattr(exc, "summary", exc)
    return time.perf_counter() - start, result


def empty_flow_seconds(runs: int = 3) -> float:
    """Prefect's floor: the median wall time of a flow run that does nothing."""
    from prefect import flow

    @flow(name="empty")
    def empty() -> int:
        return 0

    empty()  # the first run pays one-time client setup
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        empty()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def direct_lowering(models: list[str], targets: list[str]) -> tuple[float, float]:
    """``lowering.lower`` on the same models and targets, no orchestration (no verify).

    Returns (total seconds, seconds in emit alone)."""
    from examples.models import MODELS
    from lowering import lower
    from lowering.targets import partitioner_for

    start = time.perf_counter()
    emit = 0.0
    for name in models:
        for target in targets:
            model, inputs = MODELS[name]()
            emit += lower(model, inputs, partitioner=partitioner_for(target)).timings["emit"]
    return time.perf_counter() - start, emit


def executed(summary: dict) -> tuple[dict[str, int], float]:
    """Stages that ran (not cached) in a fleet run: counts per stage, total seconds."""
    counts: dict[str, int] = {}
    seconds = 0.0
    for model in summary.get("models", {}).values():
        for result in model["targets"].values():
            for r in result["stages"]:
                if not r["cached"]:
                    counts[r["stage"]] = counts.get(r["stage"], 0) + 1
                    seconds += r["seconds"]
    return counts, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--targets", default="portable,reference")
    parser.add_argument("--ephemeral", action="store_true", help="use Prefect's ephemeral server instead")
    args = parser.parse_args()
    models, targets = args.models.split(","), args.targets.split(",")

    work = Path(tempfile.mkdtemp(prefix="lowerflow-bench-"))
    server = None
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if not args.ephemeral:
        server, url = start_server(work / "prefect-home")
        os.environ["PREFECT_API_URL"] = url
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    try:
        from flows.lower_fleet import lower_fleet
        from tasks import stages

        floor = empty_flow_seconds()
        direct, emit_s = direct_lowering(models, targets)
        cold_s, cold = timed(lower_fleet, fleet(work / "store", models, targets))
        stages.LIVE.clear()
        warm_s, warm = timed(lower_fleet, fleet(work / "store", models, targets))

        stages.FAULTS.add("emit")
        prefect_logger = logging.getLogger("prefect")
        level = prefect_logger.level
        prefect_logger.setLevel(logging.CRITICAL)  # the failure is the point: no traceback
        try:
            timed(lower_fleet, fleet(work / "resume", models, targets))
        finally:
            prefect_logger.setLevel(level)
            stages.FAULTS.clear()
        stages.LIVE.clear()
        resume_s, resumed = timed(lower_fleet, fleet(work / "resume", models, targets))
        n = len(models)
        print(f"fleet: {n} models x {targets} on {'ephemeral' if args.ephemeral else 'standalone'} Prefect server")
        print(f"{'':38}{'seconds':>9} {'ratio':>8}")
        print(f"{'lowering.lower alone (no verify)':38}{direct:9.2f}")
        print(f"{'orchestrated cold (with verify)':38}{cold_s:9.2f} {cold_s / direct:8.2f}  (vs lower alone)")
        print(f"{'orchestrated warm (all cached)':38}{warm_s:9.2f} {warm_s / cold_s:8.3f}  (vs cold; target <= 0.05)")
        print(f"{'  an empty flow run (Prefect floor)':38}{floor:9.2f} {floor / cold_s:8.3f}  (vs cold)")
        print(f"{'  warm above the floor':38}{warm_s - floor:9.2f} {(warm_s - floor) / cold_s:8.3f}  (vs cold)")
        load_s = sum(m.get("load_seconds", 0.0) for m in warm.get("models", {}).values())
        print(f"{'  of which factories + fingerprints':38}{load_s:9.2f} {load_s / cold_s:8.3f}  (vs cold; "
              "the price of keying export on what is exported)")
        print(f"{'orchestration overhead per model':38}{(cold_s - direct) / n:9.2f}")
        ran, ran_s = executed(resumed)
        print(f"{'resume after emit failure':38}{resume_s:9.2f} {resume_s / max(emit_s, 1e-9):8.1f}  (vs emit alone, {emit_s:.3f} s)")
        print(f"{'  stages the resume executed':38}{ran_s:9.2f}           {ran}")
        failed = set(cold.get("failed", [])) | set(warm.get("failed", [])) | set(resumed.get("failed", []))
        if failed:
            print(f"FAILED models: {sorted(failed)}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
