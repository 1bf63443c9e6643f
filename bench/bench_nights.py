"""Where a night's time goes (issue 23, point 4): the flow runs' state timelines.

A fleet of ten small unseen models (portable only, a fresh store each run: cold) through
``prefect deployment run 'lower-fleet/nightly-fleet' --watch``, as deployments/README.md
runs it: a standalone Prefect server (SQLite, or server.sh's PostgreSQL with
``--postgres``), deployments/prefect.yaml deployed, one ``fleet`` worker and 1 or 2
``models`` workers (``lowerflow worker``), in turns, ``--repeats`` times each.

For every run it prints the wall time of the command and, from each flow run's state
history (Prefect API), where that time went:

    fleet  sched→run   the fleet run's Scheduled → Running (the fleet worker's pickup + start)
           run→end     the fleet run's Running → final (submitting, waiting, fleet.json)
    models pickup      per model run: Scheduled → Pending (a models worker claimed it), max and sum
           start       Pending → Running (its process forked and the flow loaded), max and sum
           work        Running → final, sum; busy: the sum over the wall time of the fan-out
           idle        the longest time no model run was Running while some were Scheduled

    python bench/bench_nights.py [--repeats 4] [--workers 1,2] [--postgres]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_fleet import wait_healthy  # noqa: E402
from bench_scale import free_port, prefect_server, process, wait_for_workers  # noqa: E402

POOL = "lowerflow-pool"  # deployments/prefect.yaml's

#: Ten small models no store has seen: tiny MLPs of their own widths (seeded per run).
MODELS = textwrap.dedent(
    """
    import torch

    SEED = {seed}

    def _mlp(width):
        torch.manual_seed(SEED + width)
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)), \\
            (torch.randn(2, 16),)
    """
) + "".join(f"\ndef m{i}():\n    return _mlp({24 + 4 * i})\n" for i in range(10))


def deploy(env: dict) -> None:
    for args in (["work-pool", "create", POOL, "--type", "process"],
                 ["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"]):
        subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=ROOT, check=True,
                       capture_output=True, timeout=300)


def night(work: Path, env: dict, serial: int) -> tuple[float, str]:
    """One cold night: (seconds of `prefect deployment run --watch`, fleet run id)."""
    (work / f"night{serial}").mkdir()
    models = work / f"night{serial}" / "models.py"
    models.write_text(MODELS.format(seed=serial * 1000))
    manifest = work / f"night{serial}" / "fleet.json"
    manifest.write_text(json.dumps({
        "store": str(work / f"night{serial}" / "store"), "defaults": {"targets": ["portable"]},
        "models": [{"name": f"m{i}", "model": f"{models}:m{i}"} for i in range(10)]}))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "lower-fleet/nightly-fleet",
                          "--param", f"manifest={manifest}", "--param", f"pool={POOL}", "--watch"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"the night failed: {out.stdout[-3000:]}{out.stderr[-3000:]}")
    return seconds, match.group(1)


def timeline(client, run_id) -> dict[str, float]:
    """State type → first timestamp (epoch seconds) in the run's history."""
    first: dict[str, float] = {}
    for state in sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp):
        first.setdefault(state.type.value, state.timestamp.timestamp())
        if state.is_final():
            first.setdefault("FINAL", state.timestamp.timestamp())
    return first


def breakdown(fleet_id: str) -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        fleet = timeline(client, fleet_id)
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[fleet_id])))
        models = [timeline(client, c.id) for c in children]
    pickup = [m["PENDING"] - m["SCHEDULED"] for m in models]
    start = [m["RUNNING"] - m["PENDING"] for m in models]
    work = [m["FINAL"] - m["RUNNING"] for m in models]
    first, last = min(m["SCHEDULED"] for m in models), max(m["FINAL"] for m in models)
    # The longest stretch in which no model run was Running though one was still waiting.
    events = sorted([(m["RUNNING"], 1) for m in models] + [(m["FINAL"], -1) for m in models])
    running, idle, since = 0, 0.0, first
    for t, step in events:
        if running == 0 and t > since:
            idle = max(idle, t - since)
        running += step
        since = t
    return {"sched→run": fleet["RUNNING"] - fleet["SCHEDULED"], "run→end": fleet["FINAL"] - fleet["RUNNING"],
            "submit": first - fleet["RUNNING"], "fan-out": last - first, "after": fleet["FINAL"] - last,
            "pickup max": max(pickup), "pickup sum": sum(pickup), "start max": max(start), "start sum": sum(start),
            "work sum": sum(work), "idle": idle, "starts": sorted(start)}


def locks_in(log: Path) -> int:
    """How many times the server's log says its database was locked (SQLite's lock waits)."""
    return log.read_text(errors="replace").count("database is locked") if log.exists() else 0


@contextmanager
def sqlite_server(work: Path) -> Iterator[str]:
    """``prefect server start`` on SQLite (Prefect's default), its log in work/server.log."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{work / 'prefect.db'}"}
    with process([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 env, work / "server.log"):
        url = f"http://127.0.0.1:{port}/api"
        if not wait_healthy(url, 180):
            raise RuntimeError(f"the server did not start: see {work / 'server.log'}")
        yield url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-nights-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        url = stack.enter_context(prefect_server(work, sqlite=False) if args.postgres else sqlite_server(work))
        log = work / "server.log"  # the Prefect server's
        env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PYTHONPATH": str(ROOT)}
        os.environ.update(PREFECT_API_URL=url)
        deploy(env)
        fleet_worker = [sys.executable, "-m", "flows.cli", "worker", "--pool", POOL, "--work-queue", "fleet"]
        stack.enter_context(process([*fleet_worker, "--name", "fleet"], env, work / "fleet.log"))
        serial, seen = 0, set()
        for repeat in range(args.repeats):
            for count in counts:
                with ExitStack() as workers:
                    names = [f"models-{repeat}-{count}-{i}" for i in range(count)]
                    for name in names:
                        workers.enter_context(process([sys.executable, "-m", "flows.cli", "worker", "--pool", POOL,
                                                       "--name", name], env, work / f"{name}.log"))
                    wait_for_workers(POOL, [*names, "fleet"])
                    serial += 1
                    locked = locks_in(log)
                    seconds, fleet_id = night(work, env, serial)
                    parts = breakdown(fleet_id)
                    print(f"{count} worker(s), repeat {repeat + 1}: {seconds:5.1f} s  "
                          + "  ".join(f"{k} {v:.1f}" for k, v in parts.items() if k != "starts")
                          + f"  'database is locked' {locks_in(log) - locked}", flush=True)
                    print("    Pending→Running per model run: " + " ".join(f"{v:.1f}" for v in parts["starts"]),
                          flush=True)
                    for worker_log in sorted(work.glob("*.log")):  # a warm parent that saw a source change
                        for line in worker_log.read_text(errors="replace").splitlines():
                            if "lowerflow warm parent:" in line and line not in seen:
                                seen.add(line)
                                print(f"    {worker_log.stem}: {line}", flush=True)


if __name__ == "__main__":
    main()
