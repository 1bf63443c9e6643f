"""Scale-out benchmark (issue 9): a 12-model fleet fanned out to a work pool.

Everything is measured in one run on this machine, against a standalone ``prefect
server start`` (temporary home, loopback), with ``lowerflow worker`` processes
(one model at a time each, flow runs forked from a warm parent that preloads the
fleet's transformers model classes, ``--preload``).  This machine's run-to-run noise
is about +-20%, so each measure runs ``--repeats`` times (default 3), in turns, and
medians are reported with every run's figure:

* ``lowering.lower`` alone, in a fresh process, on the same models and targets (the
  model factories are timed separately): the reference;
* cold fleet, verify off, with 1 worker and with 2 workers (new workers, new store,
  each turn) — targets: 2 workers >= 1.8x faster than 1; orchestrated cold <= 1.5x
  ``lowering.lower``;
* cold fleet with verify, 2 workers: verify's cost, reported separately;
* warm fleet (everything cached), 2 workers, vs the fan-out floor: the same fleet
  flow submitting the same runs to a deployment of an empty flow, in turns — target:
  warm above the floor <= 2% of cold;
* two "machines" (two processes, separate lock directories) lowering the same fleet
  at once on one S3 store (moto server) with Redis stage locks (redis-server):
  every stage computed once, counted.

    python bench/bench_scale.py [--models a,b,...] [--targets portable,xnnpack] [--skip-redis] [--sqlite] [--repeats N]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import socket
import statistics
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
from bench_fleet import start_server, wait_healthy  # noqa: E402  (one way to start a server)

SMALL = ["mlp", "cnn", "lstm", "transformer", "buffer_mutation", "lifted_constant", "multi_output", "integer_inputs"]
HF = ["mobilenet_v2", "resnet", "bert", "gpt2"]
POOL, FLOOR_POOL = "bench-pool", "bench-floor"

#: The floor's member: a flow named like lower-model, with its parameters, doing nothing,
#: run by the same engine as lowerflow's (its heartbeats included: flows/heartbeats.py).
EMPTY_MEMBER = textwrap.dedent(
    """
    from prefect import flow

    from flows import heartbeats

    heartbeats.install()

    @flow(name="lower-model")
    def lower_model(model, targets, store=None, options=None, name=None, version=None, verify=True, locks=None):
        return None
    """
)


@contextmanager
def prefect_server(work: Path, sqlite: bool) -> Iterator[str]:
    """The API URL of a standalone Prefect server: on PostgreSQL through deployments/server.sh
    (what a fleet on N machines runs; SQLite serializes the fan-out's writes), or SQLite."""
    if sqlite:
        server, url = start_server(work / "prefect-home")
        try:
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)
        return
    work.chmod(0o755)  # PostgreSQL runs as `postgres` when we are root
    port = free_port()
    env = {**os.environ, "LOWERFLOW_HOME": str(work / "pg"), "LOWERFLOW_PG_PORT": str(free_port()),
           "PORT": str(port), "HOST": "127.0.0.1", "PREFECT_HOME": str(work / "prefect-home"),
           "PREFECT": str(Path(sys.executable).with_name("prefect"))}
    script = str(ROOT / "deployments" / "server.sh")
    url = f"http://127.0.0.1:{port}/api"
    try:
        with process([script, "start"], env, work / "server.log"):
            if not wait_healthy(url, 180):
                raise RuntimeError(f"server.sh did not start: see {work / 'server.log'}")
            yield url
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)


def spec(name: str) -> str:
    module = "hf_models.py" if name in HF else "models.py"
    return f"{ROOT / 'examples' / module}:{name}"


def fleet(store: str, models: list[str], targets: list[str], verify: bool) -> dict:
    return {"store": store, "defaults": {"targets": targets, "verify": verify},
            "models": [{"name": m, "model": spec(m)} for m in models]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process(args: list[str], env: dict | None = None, log: Path | None = None) -> Iterator[subprocess.Popen]:
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        if log:
            out.close()


# --------------------------------------------------------------------------- measurements


def direct_lowering_fresh(models: list[str], targets: list[str]) -> tuple[float, float]:
    """:func:`direct_lowering` in a fresh process (torch's first-lowering costs included,
    as for anyone lowering a fleet with ``lowering.lower`` in one process)."""
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'bench')!r}]; "
            f"from bench_scale import direct_lowering; "
            f"print('DIRECT=' + json.dumps(direct_lowering({models!r}, {targets!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lowering, factories = json.loads(next(l for l in out.splitlines() if l.startswith("DIRECT="))[len("DIRECT="):])
    return lowering, factories


def direct_lowering(models: list[str], targets: list[str]) -> tuple[float, float]:
    """Seconds of ``lowering.lower`` (no verify) and of the factories, in this process."""
    from examples.hf_models import MODELS as HF_MODELS
    from examples.models import MODELS
    from lowering import lower
    from lowering.targets import partitioner_for

    registry = {**MODELS, **HF_MODELS}
    lowering = factories = 0.0
    for name in models:
        for target in targets:
            start = time.perf_counter()
            model, inputs = registry[name]()
            factories += time.perf_counter() - start
            start = time.perf_counter()
            lower(model, inputs, partitioner=partitioner_for(target))
            lowering += time.perf_counter() - start
    return lowering, factories


def run_fleet(manifest: dict, pool: str | None) -> tuple[float, dict]:
    """Wall seconds of the fleet flow on ``pool`` (this process waits, as the CLI does;
    None: every model in this process).  ``summary["cpu"]``: CPU seconds by role meanwhile."""
    from flows.lower_fleet import FleetFailed, lower_fleet

    before = cpu_seconds()
    start = time.perf_counter()
    try:
        summary = lower_fleet(manifest, pool=pool)
    except FleetFailed as exc:
        summary = exc.summary
    seconds = time.perf_counter() - start
    after = cpu_seconds()
    summary["cpu"] = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in ROLES}
    return seconds, summary


#: Who used the CPU, by command line: a flow run's CPU is its warm parent's (which reaps it).
ROLES = {"flow runs": ("flows.warm_start serve", "prefect.engine", "flows.warm_start run"),
         "Prefect workers": ("flows.cli worker",), "Prefect server": ("prefect server start", "uvicorn"),
         "PostgreSQL": ("postgres",), "fleet flow (this process)": ()}


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system, with reaped children's) of every process now, by :data:`ROLES`."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = collections.defaultdict(float)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        used = sum(int(f) for f in fields[11:15]) / tick
        if int(pid) == os.getpid():
            seconds["fleet flow (this process)"] += sum(int(f) for f in fields[11:13]) / tick
            continue
        role = next((r for r, keys in ROLES.items() if any(k in command for k in keys)), None)
        if role is not None:
            seconds[role] += used
    return seconds


def cpu_line(summary: dict) -> str:
    cpu = summary.get("cpu", {})
    return ", ".join(f"{role} {cpu[role]:.1f}" for role in ROLES if cpu.get(role, 0) >= 0.05)


def stage_seconds(summary: dict, stage: str) -> float:
    return sum(r["seconds"] for m in summary["models"].values() if "targets" in m
               for t in m["targets"].values() for r in t["stages"] if r["stage"] == stage and not r["cached"])


def computed_keys(summary: dict) -> collections.Counter:
    """How many times each stage key was computed (not a cache hit) in a fleet run.  A
    model's export record is in each of its targets' lists: it counts once per model."""
    return collections.Counter(
        done for m in summary["models"].values()
        for done in {(r["stage"], r.get("key")) for t in m["targets"].values()
                     for r in t["stages"] if not r["cached"] and r["state"] == "Completed"})


#: The transformers modules the HF models' classes live in: a fleet's model zoo, which a
#: worker preloads (``lowerflow worker --preload``, as deployments/README.md advises).
ZOO = {"mobilenet_v2": "transformers.models.mobilenet_v2.modeling_mobilenet_v2",
       "resnet": "transformers.models.resnet.modeling_resnet",
       "bert": "transformers.models.bert.modeling_bert", "gpt2": "transformers.models.gpt2.modeling_gpt2"}


@contextmanager
def workers(pool: str, count: int, env: dict, logs: Path, preload: tuple[str, ...] = ()) -> Iterator[None]:
    """``count`` ``lowerflow worker --pool`` processes, each running one flow run at a time."""
    flags = [arg for module in preload for arg in ("--preload", module)]
    names = [f"{pool}-{os.getpid()}-{next(_WORKER_SERIAL)}" for _ in range(count)]
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(process([sys.executable, "-m", "flows.cli", "worker", "--pool", pool, "--name", name,
                                         *flags], env, logs / f"{name}.log"))
        wait_for_workers(pool, names)
        yield


_WORKER_SERIAL = itertools.count()


def wait_for_workers(pool: str, names: list[str], timeout: float = 300) -> None:
    """Until the workers called ``names`` are online: these, not ones stopped a moment ago
    (the server lists a stopped worker as online until its heartbeats are overdue, and a
    fleet timed meanwhile would include the new workers' start-up)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            online = {w.name for w in client.read_workers_for_work_pool(pool) if str(w.status).endswith("ONLINE")}
            if online >= set(names):
                time.sleep(2)  # their warm parents are ready before they poll
                return
            time.sleep(1)
    raise RuntimeError(f"workers {names} of {pool} did not come online in {timeout} s")


def create_pools(work: Path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.lower_fleet import ensure_model_deployment

    with get_client(sync_client=True) as client:
        for pool in (POOL, FLOOR_POOL):
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    ensure_model_deployment(POOL)
    (work / "floor").mkdir()
    (work / "floor" / "empty_member.py").write_text(EMPTY_MEMBER)
    flow.from_source(source=str(work / "floor"), entrypoint="empty_member.py:lower_model").to_deployment(
        name=FLOOR_POOL, work_pool_name=FLOOR_POOL, work_queue_name="models").apply(work_pool_name=FLOOR_POOL)


# --------------------------------------------------------------------------- two machines, Redis locks

MACHINE = textwrap.dedent(
    """
    import json, sys
    from flows.lower_fleet import FleetFailed, lower_fleet
    try:
        summary = lower_fleet(json.loads(sys.argv[1]))
    except FleetFailed as exc:
        summary = exc.summary
    print("SUMMARY=" + json.dumps(summary))
    """
)


def two_machines(work: Path, models: list[str], targets: list[str], env: dict) -> tuple[float, collections.Counter]:
    """Two processes, each its own HOME (so its own file-lock directory), one S3 store,
    Redis locks: the wall time and how often each stage key was computed in all."""
    from moto.server import ThreadedMotoServer

    moto_port, redis_port = free_port(), free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    moto.start()
    try:
        with process(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(work)], log=work / "redis.log"):
            s3 = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                  "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{moto_port}", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}"}
            import boto3

            boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL_S3"], aws_access_key_id="bench",
                         aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket="fleet")
            time.sleep(0.5)
            manifest = json.dumps({**fleet("s3://fleet/store", models, targets, verify=False),
                                   "locks": f"redis://127.0.0.1:{redis_port}/0"})
            procs = []
            start = time.perf_counter()
            for machine in ("a", "b"):
                home = work / f"machine-{machine}"
                home.mkdir()
                procs.append(subprocess.Popen([sys.executable, "-c", MACHINE, manifest], cwd=ROOT,
                                              env={**env, **s3, "HOME": str(home)}, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True))
            computed: collections.Counter = collections.Counter()
            for proc in procs:
                out, _ = proc.communicate(timeout=1800)
                line = next(l for l in out.splitlines() if l.startswith("SUMMARY="))
                computed.update(computed_keys(json.loads(line[len("SUMMARY="):])))
            return time.perf_counter() - start, computed
    finally:
        moto.stop()


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(SMALL + HF))
    parser.add_argument("--targets", default="portable,xnnpack")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--sqlite", action="store_true", help="a SQLite server instead of server.sh's PostgreSQL")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each measure, in turns; medians reported (default 3)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    models, targets = args.models.split(","), args.targets.split(",")

    work = Path(tempfile.mkdtemp(prefix="lowerflow-scale-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    with prefect_server(work, args.sqlite) as url:
        os.environ["PREFECT_API_URL"] = url
        measure(args, work, models, targets)


def measure(args, work: Path, models: list[str], targets: list[str]) -> None:
    """Every figure ``--repeats`` times, in turns (this machine's run-to-run noise is
    +-20%: one run of each says little), medians reported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    zoo = tuple(ZOO[m] for m in models if m in ZOO)
    directs = [direct_lowering_fresh(models, targets) for _ in range(args.repeats)]
    direct, factories = statistics.median(d[0] for d in directs), statistics.median(d[1] for d in directs)
    in_process = run_fleet(fleet(str(work / "cold-0"), models, targets, verify=False), None)
    create_pools(work)
    cold: dict[int, list[tuple[float, dict]]] = {1: [], 2: []}
    for turn in range(args.repeats):
        for count in (1, 2):
            with workers(POOL, count, env, work, zoo):
                cold[count].append(run_fleet(fleet(str(work / f"cold-{count}-{turn}"), models, targets, verify=False), POOL))
                if count == 2 and turn == args.repeats - 1:  # on the same workers: verify's cost alone
                    verified = run_fleet(fleet(str(work / "cold-verify"), models, targets, verify=True), POOL)
    with workers(POOL, 2, env, work, zoo):
        # Warm and floor in turns, each on its own 2 workers (all four up throughout): a
        # warm fleet is within the floor's run-to-run noise, so one of each says little.
        with workers(FLOOR_POOL, 2, env, work):
            warms, floors = [], []
            for _ in range(args.repeats):
                warms.append(run_fleet(fleet(str(work / "cold-2-0"), models, targets, verify=False), POOL)[0])
                floors.append(run_fleet(fleet(str(work / "floor-store"), models, targets, verify=False), FLOOR_POOL)[0])
    machines = None if args.skip_redis else two_machines(work, models, targets, env)

    def median_run(runs: list[tuple[float, dict]]) -> tuple[float, dict]:
        return sorted(runs, key=lambda r: r[0])[len(runs) // 2]

    def listed(values) -> str:
        return ", ".join(f"{v:.2f}" for v in values)

    n = len(models)
    cold1, cold2 = median_run(cold[1]), median_run(cold[2])
    print(f"fleet: {n} models x {targets}, standalone Prefect server on "
          f"{'SQLite' if args.sqlite else 'PostgreSQL'}, `lowerflow worker` processes"
          f"{' preloading ' + ', '.join(m.rsplit('.', 1)[1] for m in zoo) if zoo else ''}; "
          f"medians of {args.repeats} runs in turns")
    print(f"{'':44}{'seconds':>9} {'ratio':>8}")
    print(f"{'lowering.lower alone (no verify)':44}{direct:9.2f}  {'':8}(fresh processes: {listed(d[0] for d in directs)})")
    print(f"{'  (model factories, not in the above)':44}{factories:9.2f}")
    print(f"{'cold, verify off, in process (no pool)':44}{in_process[0]:9.2f} {in_process[0] / direct:8.2f}  "
          "(vs lower alone, target <= 1.5; threads of one process)")
    for count, (seconds, summary) in ((1, cold1), (2, cold2)):
        failed = sorted({m for _, s in cold[count] for m in s["failed"]})
        print(f"{f'cold, verify off, {count} worker(s)':44}{seconds:9.2f} {seconds / direct:8.2f}  "
              f"(vs lower alone; target <= 1.5; runs: {listed(r[0] for r in cold[count])})"
              f"{'  FAILED: ' + ','.join(failed) if failed else ''}")
    for count, (seconds, summary) in ((1, cold1), (2, cold2)):
        print(f"{f'  CPU seconds, {count} worker(s), median run':44}{sum(summary['cpu'].values()):9.2f}  ({cpu_line(summary)})")
    print(f"{'  CPU seconds, in process':44}{sum(in_process[1]['cpu'].values()):9.2f}  ({cpu_line(in_process[1])})")
    print(f"{'  per model run, 1 worker, beyond lowering':44}{(cold1[0] - direct - factories) / n:9.2f}")
    pairs = [one[0] / two[0] for one, two in zip(cold[1], cold[2])]
    print(f"{'  2 workers vs 1 (speed-up)':44}{'':9} {cold1[0] / cold2[0]:8.2f}  (target >= 1.8; "
          f"turn by turn: {listed(pairs)})")
    print(f"{'cold, verify on, 2 workers':44}{verified[0]:9.2f} {verified[0] / cold2[0]:8.2f}  (vs verify off)")
    print(f"{'  verify stage seconds (sum over models)':44}{stage_seconds(verified[1], 'verify'):9.2f}")
    warm, floor = statistics.median(warms), statistics.median(floors)
    above = [w - f for w, f in zip(warms, floors)]
    print(f"{'warm (all cached), 2 workers, median':44}{warm:9.2f} {warm / cold2[0]:8.3f}  (vs cold; "
          f"{len(warms)} runs: {listed(warms)})")
    print(f"{'  fan-out floor (empty members), median':44}{floor:9.2f} {floor / cold2[0]:8.3f}  (vs cold; "
          f"{listed(floors)})")
    print(f"{'  warm above the floor, median of pairs':44}{statistics.median(above):9.2f} "
          f"{statistics.median(above) / cold2[0]:8.3f}  (vs cold; target <= 0.02; pairs "
          f"{', '.join(f'{a:+.2f}' for a in above)})")
    if machines is not None:
        seconds, computed = machines
        twice = {k: c for k, c in computed.items() if c > 1}
        print(f"{'two machines, one S3 store, Redis locks':44}{seconds:9.2f}")
        print(f"{'  stage computations / distinct stages':44}{sum(computed.values()):9d} {len(computed):8d}  "
              f"(computed twice: {len(twice)}{': ' + ', '.join(sorted(s for s, _ in twice)) if twice else ''})")


if __name__ == "__main__":
    main()
