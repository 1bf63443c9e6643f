"""Warm cost of the demo fleet (examples/fleet.yaml) in process: what a re-run of
``./run demo`` / ``lowerflow fleet`` costs once everything is cached.

One cold run into a fresh store, then ``--runs`` warm runs (each in the same
process, live objects cleared, so every stage is read back from the cache as a
new process would), on Prefect's ephemeral server (the demo's) or a standalone
``prefect server start`` (``--server``).

    python bench/bench_fleet_warm.py [--runs 3] [--server]
"""

from __future__ import annotations

import argparse
import warnings
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def demo_fleet(store: Path) -> dict:
    """examples/fleet.yaml with its store in ``store`` (model paths made absolute)."""
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
    doc["store"] = str(store)
    for model in doc["models"]:
        model["model"] = str(ROOT / "examples" / model["model"])
    return doc


def timed(fn, *args) -> float:
    start = time.perf_counter()
    try:
        fn(*args)
    except Exception as exc:  # FleetFailed: still a timing, but say so
        print(f"  (failed: {type(exc).__name__}: {str(exc)[:200]})")
    return time.perf_counter() - start


def main() -> None:
    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server", action="store_true", help="a standalone prefect server instead of the ephemeral one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lowerflow-bench-warm-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    server = None
    if args.server:
        from bench_fleet import start_server

        server, url = start_server(work / "server-home")
        os.environ["PREFECT_API_URL"] = url
    try:
        from flows.lower_fleet import lower_fleet
        from tasks import stages

        manifest = demo_fleet(work / "store")
        print(f"cold: {timed(lower_fleet, manifest):.2f} s", flush=True)
        warm = []
        for _ in range(args.runs):
            stages.LIVE.clear()
            warm.append(timed(lower_fleet, manifest))
            print(f"warm: {warm[-1]:.2f} s", flush=True)
        print(f"warm median of {len(warm)}: {sorted(warm)[len(warm) // 2]:.2f} s "
              f"({len(manifest['models'])} models)")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
