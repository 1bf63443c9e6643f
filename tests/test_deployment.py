"""The scale-out deployment end to end, with real processes (issue 9):

* the Prefect server on PostgreSQL, started by ``deployments/server.sh`` (its own
  cluster in a temporary directory, on free loopback ports);
* the deployments of ``deployments/prefect.yaml`` (``prefect deploy --all``);
* two ``--work-queue models --limit 1`` workers (``prefect worker start`` and ``lowerflow
  worker``, whose flow runs fork from a warm parent) and one ``--work-queue fleet`` worker;
* a fleet run (``prefect deployment run 'lower-fleet/nightly-fleet' --watch``) fanned
  out to one ``lower-model`` run per model, on both model workers;
* a fleet with a model whose verify fails, then ``prefect flow-run retry``: only that
  model runs again, and it resumes at verify (every stage before it is a cache hit);
  the failed fleet is notified (``lowerflow automations install --notify-url``) to a
  real HTTP server of the test;
* a model worker's whole process group killed mid-run (a lost machine): Prefect's
  zombie automation marks the run Crashed, the fleet submits it again to the other
  worker, it resumes at its stage and the fleet completes;
* a fleet that times out: it fails naming the model still out;
* the fleet worker's process group killed mid-night (a lost fleet machine): the fleet
  run is Crashed, scheduled again by "retry a lost fleet", and its new try waits for the
  model run left running and completes;
* Redis down and S3 down (the moto server stopped): one line per model in every log,
  report and summary, no traceback at ERROR.

``server.sh start`` installs the automations (with a webhook to a real HTTP server of
the test).  The nightly's schedule (``0 2 * * *`` UTC) is paused once the scheduler's runs
of it are recorded (the schedule test checks them): a run crossing 02:00 UTC gets no real
night.  deployments/README.md's single-host trial is tests/test_deployment_trial.py's.

Everything shares one module-scoped setup (~25 s).  Every process is killed with its
process group, and the database stopped, in a ``finally``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.test_faults_processes import ROOT, TARGETS, fleet_manifest, finish, output_of, spawned, subprocess_env

SERVER_SH = ROOT / "deployments" / "server.sh"
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
POOL = "lowerflow-pool"
MODEL_WORKERS = ("models-1", "models-2")
#: Seconds the server and the workers may take to come up on a busy 2-core machine.
STARTUP = 180
#: Seconds one fleet run (or retry) may take.
FLEET_TIMEOUT = 300
#: The zombie automation's window here: heartbeats come every 30 s (the minimum), and a
#: lost run is Crashed 10-40 s after its last one (90 s, the default, in production).
ZOMBIE_WINDOW = 40


#: The nightly deployment's parameters (deployments/prefect.yaml).
NIGHTLY_PARAMETERS = {"manifest": "examples/nightly-fleet.yaml", "pool": POOL, "timeout_seconds": 43200, "crash_retries": 2}


@contextlib.contextmanager
def receiver() -> Iterator[tuple[list[dict], str]]:
    """A real HTTP server on a free loopback port collecting the JSON bodies POSTed to it:
    (the bodies so far, its URL).  The notification webhook of the fleet."""
    import http.server
    import threading

    received: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(json.loads(body or b"null"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield received, f"http://127.0.0.1:{server.server_address[1]}/lowerflow-hook"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class S3:
    """A moto S3 server on a loopback port, with one bucket; ``stop()`` is the outage."""
    server: Any
    port: int
    bucket: str
    env: dict[str, str]  # what a worker needs (deployments/README.md, step 5)

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()


@contextlib.contextmanager
def s3_server() -> Iterator[S3]:
    """A moto S3 server with the bucket ``lowerflow-nights``."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "lowerflow-test", "AWS_SECRET_ACCESS_KEY": "lowerflow-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_MAX_ATTEMPTS": "2"}
    s3 = S3(server, port, "lowerflow-nights", env)
    try:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket=s3.bucket)
        yield s3
    finally:
        with contextlib.suppress(Exception):
            s3.server.stop()


def postgres_bindir() -> str | None:
    """Where server.sh will find PostgreSQL's binaries (None: not installed)."""
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
        if out and Path(out, "initdb").exists():
            return out
    except OSError:
        pass
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return str(found[-1].parent) if found else shutil.which("initdb") and str(Path(shutil.which("initdb")).parent)


def no_postgres_user() -> bool:
    """Root runs PostgreSQL as the `postgres` user (it refuses to run as root)."""
    import pwd

    try:
        return os.geteuid() == 0 and not pwd.getpwnam("postgres")
    except KeyError:
        return True


pytestmark = [
    pytest.mark.skipif(postgres_bindir() is None, reason="PostgreSQL is not installed (CI installs it)"),
    pytest.mark.skipif(no_postgres_user(), reason="running as root and there is no `postgres` user to run PostgreSQL"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    """A command run to the end (killed with its group on timeout): (status, stdout, stderr)."""
    with spawned(args, env) as proc:
        out, err, _ = finish(proc, timeout=timeout)
    return proc.returncode, out, err


def prefect(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


@dataclass
class Deployment:
    api: str
    env: dict[str, str]          # what a client (prefect CLI) needs
    server_env: dict[str, str]   # what server.sh needs
    server: subprocess.Popen     # server.sh start
    workers: dict[str, subprocess.Popen]
    base: Path
    stack: contextlib.ExitStack
    notifications: list[dict]    # what the notification webhook received (JSON bodies)
    commands: dict[str, list[str]]  # how each worker was started
    s3: "S3"                     # the moto S3 server of the workers' AWS_ENDPOINT_URL_S3
    tmpdirs: dict[str, Path]     # each worker's TMPDIR (its warm socket's directory)
    nightly: Any = None          # lower-fleet/nightly-fleet as `prefect deploy` wrote it (its schedule active)
    scheduled: list = None       # the runs the server's scheduler made of its schedule, before it was paused

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api)

    def worker_output(self, name: str) -> str:
        return "".join(output_of(self.workers[name]))


def wait_until(condition, what: str, timeout: float, procs: dict[str, subprocess.Popen]):
    """Poll ``condition`` until it returns something true; fails if one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        for name, proc in procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}) before {what}: {''.join(output_of(proc))[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.25)


def healthy(api: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def kill_postmaster(pgdata: Path) -> None:
    """The last resort if ``server.sh stop`` failed: PostgreSQL is not in any test process group."""
    with contextlib.suppress(Exception):
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown, children included
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """server.sh (Prefect on PostgreSQL), the work pool, both deployments, three workers."""
    # A short path (PostgreSQL's socket lives in its data directory) that the `postgres`
    # user can reach when the tests run as root (mkdtemp makes it 0700).
    base = Path(tempfile.mkdtemp(prefix="lf-deploy-"))
    base.chmod(0o755)
    pg_port, api_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}/api"
    env = subprocess_env(api, PREFECT_HOME=str(base / "prefect"), PREFECT_WORKER_QUERY_SECONDS="1")
    # server.sh's later commands (status, psql, stop) get only LOWERFLOW_HOME: they act on
    # what `start` started (its data directory and ports, remembered in server.env).
    server_env = {**env, "LOWERFLOW_HOME": str(base), "PREFECT_SERVER_UI_ENABLED": "false",
                  "PREFECT": str(Path(sys.executable).with_name("prefect"))}  # this venv's, PATH or not
    server_env.pop("PREFECT_API_URL")
    start_env = {**server_env, "LOWERFLOW_PGDATA": str(base / "pg"), "LOWERFLOW_PG_PORT": str(pg_port),
                 "PORT": str(api_port), "HOST": "127.0.0.1"}
    with contextlib.ExitStack() as stack:
        notifications, webhook = stack.enter_context(receiver())
        # As the README says: `start` installs the zombie-run automation, and failure
        # notifications to a webhook (here the test's HTTP server).
        start_env.update(LOWERFLOW_ZOMBIE_WINDOW=str(ZOMBIE_WINDOW), LOWERFLOW_NOTIFY_URL=webhook)
        # The store of the S3 tests: a moto server with its bucket (step 3), and the
        # workers' environment of step 5.
        s3 = stack.enter_context(s3_server())
        env.update(s3.env)
        stack.callback(shutil.rmtree, base, True)
        stack.callback(kill_postmaster, base / "pg")
        server = stack.enter_context(spawned([str(SERVER_SH), "start"], start_env))
        # Runs before the server's group is killed: stops the server, then PostgreSQL.
        stack.callback(lambda: subprocess.run([str(SERVER_SH), "stop"], env=server_env, capture_output=True, timeout=120))
        wait_until(lambda: healthy(api), "healthy Prefect API", STARTUP, {"server.sh": server})
        out = output_of(server)[0]
        assert f"export PREFECT_API_URL={api}" in out, out

        status, out, err = cli(prefect("work-pool", "create", POOL, "--type", "process"), env)
        assert status == 0, out + err
        workers = {}
        # One plain Prefect worker and one `lowerflow worker` (flow runs forked warm): both kinds.
        commands = {
            MODEL_WORKERS[0]: prefect("worker", "start", "--pool", POOL, "--work-queue", "models", "--limit", "1"),
            MODEL_WORKERS[1]: [sys.executable, "-m", "flows.cli", "worker", "--pool", POOL, "--verbose"],
            # As the README: a lowerflow worker (polls every 0.5 s, stops cleanly at SIGTERM).
            "fleet": [sys.executable, "-m", "flows.cli", "worker", "--pool", POOL, "--work-queue", "fleet"],
        }
        for name, command in commands.items():
            (base / f"tmp-{name}").mkdir()  # each worker's temporary directory (the warm socket's)
            workers[name] = stack.enter_context(spawned([*command, "--name", name],
                                                        {**env, "TMPDIR": str(base / f"tmp-{name}")}))
        # Meanwhile (the workers take seconds to start): deploy, from the repository root.
        status, out, err = cli(prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_YAML)), env)
        assert status == 0, out + err
        deployed = Deployment(api, env, server_env, server, workers, base, stack, notifications, commands, s3,
                              {name: base / f"tmp-{name}" for name in workers})
        from flows.automations import (FAILED_FLEET_AUTOMATION, FLEET_ZOMBIE_AUTOMATION, LOST_FLEET_AUTOMATION,
                                       RECOVERED_FLEET_AUTOMATION, ZOMBIE_AUTOMATION)

        installed = wait_until(lambda: re.findall(r"installed automation '([^']+)'", "".join(output_of(server))),
                               "the automations installed by server.sh start", STARTUP, {"server.sh": server})
        assert sorted(installed) == sorted([ZOMBIE_AUTOMATION, FLEET_ZOMBIE_AUTOMATION, LOST_FLEET_AUTOMATION,
                                            FAILED_FLEET_AUTOMATION, RECOVERED_FLEET_AUTOMATION]), installed

        def online():
            with deployed.client() as client:
                return {w.name for w in client.read_workers_for_work_pool(POOL) if w.status == "ONLINE"} >= set(workers)
        wait_until(online, "3 workers online", STARTUP, {"server.sh": server, **workers})
        pause_the_nightly_schedule(deployed)
        yield deployed


def scheduled_nightlies(deployment: Deployment) -> list:
    """The Scheduled runs of lower-fleet/nightly-fleet."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterName, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    with deployment.client() as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly-fleet"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))


def pause_the_nightly_schedule(deployment: Deployment) -> None:
    """Records the nightly deployment as deployed and the runs the server's scheduler makes of
    its schedule (``0 2 * * *`` UTC; within 6 s of the deploy its "recent deployments"
    loop does, every 5 s; else the main loop, every 60 s), for
    test_server_runs_on_postgres… and test_nightly_schedule…, then pauses the schedule,
    which deletes those runs: a test run crossing 02:00 UTC gets no real night (whose
    failure would page the notification webhook and take the fleet's one slot)."""
    with deployment.client() as client:
        deployment.nightly = client.read_deployment_by_name("lower-fleet/nightly-fleet")
    start = time.monotonic()

    def scheduled():
        log = "".join(output_of(deployment.server))
        assert "Can't evaluate bulk DML statement" not in log, log[log.index("schedule_recent_deployments"):][:3000]
        return scheduled_nightlies(deployment)
    deployment.scheduled = wait_until(scheduled, "the scheduler's runs of lower-fleet/nightly-fleet", 90,
                                      {"server.sh": deployment.server})
    with deployment.client() as client:
        for schedule in deployment.nightly.schedules:
            client.update_deployment_schedule(deployment.nightly.id, schedule.id, active=False)
    wait_until(lambda: not scheduled_nightlies(deployment), "the nightly's scheduled runs deleted", 30,
               {"server.sh": deployment.server})
    print(f"the nightly's {len(deployment.scheduled)} scheduled runs recorded and the schedule paused "
          f"{time.monotonic() - start:.1f} s after the workers were online")


def test_server_runs_on_postgres_and_both_deployments_are_registered(deployment):
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    # Prefect's tables, and what `prefect deploy` just wrote, are in the cluster of server.sh.
    status, out, err = cli([str(SERVER_SH), "psql", "-tA", "-c",
                            "SELECT d.name, d.work_queue_name FROM deployment d ORDER BY d.name"], deployment.server_env)
    assert status == 0, out + err
    assert out.split() == [f"{POOL}|models", "nightly-fleet|fleet"], out
    assert not list(deployment.base.rglob("*.db")), "a SQLite database was created"
    status, out, err = cli([str(SERVER_SH), "status"], deployment.server_env)
    assert status == 0 and "postgres: running" in out and "prefect:  running" in out, out + err
    assert f"PREFECT_API_URL={deployment.api}" in out and str(deployment.base / "pg") in out, out

    # server.sh start installed the automations; installing them again replaces them.
    status, out, err = cli([sys.executable, "-m", "flows.cli", "automations", "install", "--zombie-window",
                            str(ZOMBIE_WINDOW)], deployment.env)
    assert status == 0 and out.count("installed automation") == 3, out + err
    status, out, err = cli([sys.executable, "-m", "flows.cli", "automations", "ls"], deployment.env)
    assert status == 0 and len(out.splitlines()) == 5, out + err
    assert all(line.count("enabled (") == 1 for line in out.splitlines()), out  # one of each

    with deployment.client() as client:
        fleet = client.read_deployment_by_name("lower-fleet/nightly-fleet")
        model = client.read_deployment_by_name(f"lower-model/{POOL}")
    assert (fleet.work_pool_name, fleet.work_queue_name) == (POOL, "fleet")
    assert fleet.parameters == NIGHTLY_PARAMETERS
    assert fleet.global_concurrency_limit.limit == 1
    assert fleet.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    # The schedule as deployed (active), and as the fixture left it: paused (pause_the_nightly_schedule).
    [schedule] = deployment.nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    assert [(s.id, s.schedule.cron, s.active) for s in fleet.schedules] == [(schedule.id, "0 2 * * *", False)]
    assert (model.work_pool_name, model.work_queue_name, model.schedules) == (POOL, "models", [])
    assert (fleet.entrypoint, model.entrypoint) == ("flows/lower_fleet.py:lower_fleet", "flows/lower_model.py:lower_model")
    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    assert model.job_variables == {"env": env}
    assert fleet.job_variables == {"env": {**env, "LOWERFLOW_HEARTBEAT_SECONDS": "10"}}  # a lost fleet: 30 s
    for d in (fleet, model):
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]


# --------------------------------------------------------------------------- fleets


def run_fleet(deployment: Deployment, manifest: Path) -> tuple[int, str, str]:
    """``prefect deployment run 'lower-fleet/nightly-fleet' --watch`` on ``manifest``:
    (exit status, fleet flow run id, output)."""
    status, out, err = cli(prefect("deployment", "run", "lower-fleet/nightly-fleet",
                                   "--param", f"manifest={manifest}", "--param", f"pool={POOL}", "--watch"),
                           deployment.env, timeout=FLEET_TIMEOUT)
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, out + err
    return status, match.group(1), out + err


def child_runs(deployment: Deployment, fleet_run_id: str) -> list:
    """The flow runs whose parent is the fleet run, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    with deployment.client() as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[fleet_run_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def completed_task_runs(deployment: Deployment, run_id) -> list:
    """The task runs of flow run ``run_id`` that the server has recorded as completed."""
    return task_runs_in(deployment, run_id, "COMPLETED")


def task_runs_in(deployment: Deployment, run_id, *state_types: str) -> list:
    """The task runs of flow run ``run_id`` in one of ``state_types`` (``"RUNNING"``, ...)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter,
                                                TaskRunFilterState, TaskRunFilterStateType)

    with deployment.client() as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=list(state_types)))))


def read_run(deployment: Deployment, run_id: str):
    with deployment.client() as client:
        return client.read_flow_run(run_id)


def stages_of(store: Path, model: str) -> dict[str, list[tuple[str, bool]]]:
    """Per target, (stage, cached) of each stage record of the model's manifest."""
    manifest = json.loads((store / "outputs" / model / "manifest.json").read_text())
    return {t: [(r["stage"], r["cached"]) for r in result["stages"]] for t, result in manifest["targets"].items()}


@pytest.fixture(scope="module")
def store(deployment) -> Path:
    """One store for the module's fleets (a model lowered by an earlier test is a cache hit later)."""
    return deployment.base / "store"


MEETING = textwrap.dedent(
    '''
    """examples.models' {models}, each built only once the other's build has begun (or
    after {patience} s): two model runs that overlap whenever two workers take them."""
    import time
    from pathlib import Path

    from examples.models import MODELS

    HERE = Path({here!r})


    def _meet(me, other):
        (HERE / f"{{me}}.started").touch()
        deadline = time.monotonic() + {patience}
        while not (HERE / f"{{other}}.started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    '''
)


def meeting_models(directory: Path, models: tuple[str, str], patience: int = 120) -> Path:
    """A models file whose two factories wait for each other (see MEETING)."""
    source = MEETING.format(models=" and ".join(models), patience=patience, here=str(directory))
    for me, other in (models, models[::-1]):
        source += f"\ndef {me}():\n    _meet({me!r}, {other!r})\n    return MODELS[{me!r}]()\n\n"
    path = directory / "meeting.py"
    path.write_text(source)
    return path


def test_fleet_fans_out_to_both_model_workers(deployment, store, tmp_path):
    models = ("mlp", "buffer_mutation")
    # Each model's build waits (up to 2 min) until the other's has begun.  A --limit 1
    # worker runs one model at a time, so the runs overlap only if both workers took one:
    # a worker that took both would finish late and show as the only worker in ran_on.
    meeting = meeting_models(tmp_path, models)
    fleet = fleet_manifest(store, models)
    for entry in fleet["models"]:
        entry["model"] = f"{meeting}:{entry['name']}"
    manifest = tmp_path / "fleet.json"
    manifest.write_text(json.dumps(fleet))

    status, fleet_id, out = run_fleet(deployment, manifest)
    assert status == 0, out[-5000:]
    fleet_run = read_run(deployment, fleet_id)
    assert fleet_run.state.is_completed() and fleet_run.work_queue_name == "fleet"

    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] is True and summary["failed"] == [] and set(summary["models"]) == set(models)
    for m in models:
        for t in TARGETS:
            assert (store / "outputs" / m / f"{t}.pte").read_bytes()[4:8] == b"ET12"
        assert set(stages_of(store, m)) == set(TARGETS)

    children = child_runs(deployment, fleet_id)
    assert sorted(r.parameters["name"] for r in children) == sorted(models), [r.name for r in children]
    with deployment.client() as client:
        model_deployment = client.read_deployment_by_name(f"lower-model/{POOL}")
    for run in children:
        assert run.deployment_id == model_deployment.id and run.work_queue_name == "models"
        assert run.state.is_completed(), (run.parameters["name"], run.state)
    # Which worker ran each: the two builds waited for each other, and a --limit 1 worker
    # never claims a second run while it runs one, so each model worker ran one.
    ran_on = {run.parameters["name"]: ran_by(deployment, run.id) for run in children}
    assert sorted(w for ws in ran_on.values() for w in ws) == sorted(MODEL_WORKERS), ran_on
    # The plain Prefect worker's run loaded its flow through the deployment's pull step;
    # lowerflow worker's run from the entrypoint, in the step's directory (no step, no event).
    pulled = pull_step_runs(deployment, {str(r.id) for r in children},
                            {str(r.id) for r in children if ran_on[r.parameters["name"]] == [MODEL_WORKERS[0]]})
    assert {str(r.id) for r in children if ran_on[r.parameters["name"]] == [MODEL_WORKERS[0]]} <= pulled
    assert not {str(r.id) for r in children if ran_on[r.parameters["name"]] == [MODEL_WORKERS[1]]} & pulled
    # server.sh batches the task-run recorder's writes (Prefect writes one event per
    # transaction): every computed stage of every model run is still recorded.
    environ = Path(f"/proc/{deployment.server.pid}/environ").read_bytes().split(b"\0")
    assert b"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=200" in environ
    for run in children:
        name = run.parameters["name"]
        computed = {(stage, None if stage == "export" else target)
                    for target, stages in stages_of(store, name).items() for stage, cached in stages if not cached}
        assert computed, name
        wait_until(lambda: len(completed_task_runs(deployment, run.id)) == len(computed),
                   f"{len(computed)} completed task runs of {name}", 30, {"server.sh": deployment.server})
    spans = sorted((r.start_time, r.end_time) for r in children)
    print(f"fleet run {fleet_run.start_time:%T}-{fleet_run.end_time:%T}, model runs "
          + ", ".join(f"{r.name} {r.start_time:%T}-{r.end_time:%T} on {ran_on[r.parameters['name']]}" for r in children)
          + f"; overlapping: {spans[1][0] < spans[0][1]}")


def test_cli_fleet_on_the_pool(deployment, store, tmp_path):
    """``lowerflow fleet MANIFEST --pool``: the fleet flow in the CLI's process, each model a
    ``lower-model`` run on the pool's workers; progress lines, the summary, exit 0."""
    models = ("mlp", "lifted_constant")
    manifest = tmp_path / "fleet.json"
    manifest.write_text(json.dumps(fleet_manifest(store, models)))
    status, out, err = cli([sys.executable, "-m", "flows.cli", "fleet", str(manifest), "--pool", POOL],
                           deployment.env, timeout=FLEET_TIMEOUT)
    assert status == 0, (out + err)[-5000:]
    assert f"lowering 2 models on work pool {POOL} (lower-model/{POOL})" in out, out
    assert re.search(r"\[2/2\] (mlp|lifted_constant) +ok", out), out
    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] is True and set(summary["models"]) == set(models)
    with deployment.client() as client:
        runs = {m: client.read_flow_run(summary["models"][m]["flow_run"]) for m in models}  # who wrote each manifest
        fleet_ids = {client.read_task_run(r.parent_task_run_id).flow_run_id for r in runs.values()}
    for m, run in runs.items():
        assert run.work_queue_name == "models" and run.state.is_completed() and run.name == m
        assert (store / "outputs" / m / "portable.pte").read_bytes()[4:8] == b"ET12"
    assert len(fleet_ids) == 1  # children of the CLI's one fleet run
    assert sorted(r.name for r in child_runs(deployment, str(fleet_ids.pop()))) == sorted(models)


def pull_step_runs(deployment: Deployment, runs: set[str], expected: set[str], timeout: float = 60) -> set[str]:
    """Which of flow runs ``runs`` have a ``prefect.flow-run.pull-step.executed`` event, once
    every run of ``expected`` has one (events are persisted in batches), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with deployment.client() as client:
            answer = client._client.post("/events/filter", json={"limit": 50, "filter": {
                "event": {"name": ["prefect.flow-run.pull-step.executed"]},
                "resource": {"id": [f"prefect.flow-run.{run}" for run in runs]}}})
        answer.raise_for_status()
        runs = {e["resource"]["prefect.resource.id"].removeprefix("prefect.flow-run.") for e in answer.json()["events"]}
        if expected <= runs or time.monotonic() > deadline:
            return runs
        time.sleep(1)


def ran_by(deployment: Deployment, run_id) -> list[str]:
    """The model workers that ran flow run ``run_id``.  Two workers may both pick up a
    run and log "submitting flow run"; the server lets one move it to Pending, the
    other logs "Aborted submission of flow run"."""
    return [w for w in MODEL_WORKERS
            if f"submitting flow run '{run_id}'" in (out := deployment.worker_output(w))
            and f"Aborted submission of flow run '{run_id}'" not in out]


SENSOR = textwrap.dedent(
    '''
    """A model whose eager forward fails while {flag} exists ("the sensor is offline");
    under torch.export it does not, so every stage up to verify succeeds."""
    import os

    import torch

    FLAG = {flag!r}


    class Sensor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            if not torch.compiler.is_exporting() and os.path.exists(FLAG):
                raise RuntimeError("sensor offline")
            return torch.relu(self.linear(x))


    def sensor():
        torch.manual_seed(0)
        return Sensor(), (torch.randn(2, 8),)
    '''
)


#: What a worker's console never shows for a handled failure (issue 31): Prefect's lines
#: repeating lowerflow's, tracebacks, the libraries' import-time warnings.
CONSOLE_NOISE = ("Traceback", "Encountered exception during execution", "Engine execution exited",
                 "exited with unexpected exception", "Failed to write result")
#: ... nor, unless it runs with --verbose, those of the libraries (torch's, torchao's).
LIBRARY_NOISE = ("Failed to load", "Detected no triton", "FutureWarning", "DeprecationWarning", "register_constant")


def test_failed_fleet_retried_resumes_the_failed_model_at_verify(deployment, store, tmp_path):
    flag = tmp_path / "sensor-offline"
    flag.write_text("")
    (tmp_path / "sensor.py").write_text(SENSOR.format(flag=str(flag)))
    manifest = tmp_path / "fleet.yaml"
    fleet = fleet_manifest(store, ("mlp",))
    fleet["models"].append({"name": "sensor", "model": f"{tmp_path / 'sensor.py'}:sensor"})
    manifest.write_text(json.dumps(fleet))

    status, fleet_id, out = run_fleet(deployment, manifest)
    assert status != 0, out[-5000:]
    assert read_run(deployment, fleet_id).state.is_failed()
    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] is False and summary["failed"] == ["sensor"], summary["failed"]
    sensor = summary["models"]["sensor"]["targets"]
    for t in TARGETS:
        assert not sensor[t]["ok"] and "sensor offline" in sensor[t]["error"], sensor[t]
        assert not (store / "outputs" / "sensor" / f"{t}.pte").exists()
        assert summary["models"]["mlp"]["targets"][t]["ok"]
    failed_stages = stages_of(store, "sensor")
    first_children = child_runs(deployment, fleet_id)
    assert sorted(r.parameters["name"] for r in first_children) == ["mlp", "sensor"]

    # The failed night was notified: the automation POSTed to the webhook (the test's server).
    notified = wait_until(lambda: [n for n in deployment.notifications if fleet_id in n["body"]],
                          "notification of the failed fleet", 60, {"server.sh": deployment.server})
    # Its cause, and what to run next with the whole id.
    cause = "1 of 2 models failed: sensor; verify: RuntimeError: sensor offline"
    assert cause in read_run(deployment, fleet_id).state.message, read_run(deployment, fleet_id).state.message
    assert "ended Failed" in notified[0]["body"] and cause in notified[0]["body"], notified
    assert f"prefect flow-run retry {fleet_id}" in notified[0]["body"], notified
    assert notified[0]["subject"].startswith("lowerflow: nightly fleet"), notified
    # Each console has lowerflow's one line about it: the worker that ran the model, the
    # fleet worker; no traceback, no Prefect line repeating it, no library warning.
    [sensor_run] = [r for r in first_children if r.parameters["name"] == "sensor"]
    for worker in [*ran_by(deployment, sensor_run.id), "fleet"]:
        console = deployment.worker_output(worker)
        told = [line for line in console.splitlines() if "sensor offline" in line]
        assert len(told) == 1 and "sensor/portable,reference FAILED verify: RuntimeError: sensor offline" in told[0], \
            (worker, told)
        verbose = "--verbose" in deployment.commands[worker]
        for noise in CONSOLE_NOISE + (() if verbose else LIBRARY_NOISE):
            assert noise not in console, (worker, noise, console[-5000:])
    for noise in LIBRARY_NOISE:  # the plain Prefect worker's runs, and the fleet's warm parent, are quiet too
        assert not [w for w, c in deployment.commands.items() if "--verbose" not in c
                    and noise in deployment.worker_output(w)], noise
    # `lowerflow nights`: the night, its state, cause and the whole retry command.
    status, out, err = cli([sys.executable, "-m", "flows.cli", "nights", "--limit", "3"], deployment.env)
    assert status == 0, out + err
    # (this night's lines, found by its retry command: a run crossing 02:00 UTC has a newer scheduled night)
    lines = out.splitlines()
    at = next((i for i, line in enumerate(lines) if line.strip() == f"next: prefect flow-run retry {fleet_id}"), None)
    assert at, out
    assert "Failed" in lines[at - 1] and cause in lines[at - 1] and "(nightly-fleet)" in lines[at - 1], out

    # The sensor is back; retry the fleet run (the same flow run, scheduled again).
    flag.unlink()
    status, out, err = cli(prefect("flow-run", "retry", fleet_id), deployment.env)
    assert status == 0, out + err
    assert "scheduled for retry" in out, out + err
    # Waited for through the API: `prefect flow-run watch` follows the run's event stream,
    # which replayed the first try's events and then closed ("stream closed unexpectedly").
    retried = wait_until(lambda: (run := read_run(deployment, fleet_id)).state.is_final() and run,
                         "final state of the retried fleet run", FLEET_TIMEOUT, deployment.workers)
    assert retried.state.is_completed(), retried.state
    assert retried.run_count == 2, retried.run_count

    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] is True and summary["failed"] == [], summary
    children = child_runs(deployment, fleet_id)
    new = [r for r in children if r.id not in {c.id for c in first_children}]
    assert [r.parameters["name"] for r in new] == ["sensor"], [(r.name, r.parameters["name"]) for r in children]
    assert new[0].state.is_completed()

    # The night healed: a follow-up says so.
    recovered = wait_until(lambda: [n for n in deployment.notifications if fleet_id in n["body"]
                                    and "recovered" in n["subject"]], "the recovered notification", 60,
                           {"server.sh": deployment.server})
    assert "recovered: completed by retry 1, 1 models re-run (sensor)" in recovered[0]["body"], recovered

    # The retried model resumed at verify: every stage before it was a cache hit.
    resumed = stages_of(store, "sensor")
    for t in TARGETS:
        *before, (last, cached) = resumed[t]
        assert last == "verify" and cached is False, resumed[t]
        assert before and all(c for _, c in before), resumed[t]
        assert [s for s, _ in before] == [s for s, _ in failed_stages[t]][:len(before)], (failed_stages[t], resumed[t])
        assert (store / "outputs" / "sensor" / f"{t}.pte").read_bytes()[4:8] == b"ET12"


def test_bad_manifest_is_one_line_on_the_fleet_worker(deployment):
    """The nightly's own manifest, its store still the placeholder: the fleet fails at once,
    its state says why, and the fleet worker's console has that one line, no traceback."""
    # (what the console prints from now on: a run crossing 02:00 UTC has the scheduled nightly's lines before)
    before = len(deployment.worker_output("fleet"))
    status, out, err = cli(prefect("deployment", "run", "lower-fleet/nightly-fleet", "--watch"), deployment.env,
                           timeout=FLEET_TIMEOUT)
    fleet_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    run = read_run(deployment, fleet_id)
    assert status != 0 and run.state.is_failed(), run.state
    assert "still has the placeholder <your-bucket>" in run.state.message, run.state.message
    console = deployment.worker_output("fleet")[before:]
    told = [line for line in console.splitlines() if "placeholder <your-bucket>" in line]
    assert len(told) == 1 and "Traceback" not in console, console[-5000:]
    for noise in CONSOLE_NOISE:
        assert noise not in console, (noise, console[-5000:])


# --------------------------------------------------------------------------- outages


def flow_run_logs(deployment: Deployment, run_id) -> list[tuple[int, str]]:
    """(level, message) of every log record of flow run ``run_id`` the server has."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with deployment.client() as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                sort=LogSort.TIMESTAMP_ASC, limit=200)
    return [(log.level, log.message) for log in logs]


def latest_artifact(deployment: Deployment, key: str) -> str:
    """The markdown of the latest artifact ``key``."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with deployment.client() as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    return found[0].data if found else ""


def assert_one_line_per_model(deployment: Deployment, fleet_id: str, models: tuple[str, ...], line: str) -> None:
    """The fleet's log and each model run's log say ``<model>/<targets> FAILED <line>…``
    once per model, and neither has a traceback at ERROR."""
    fleet_log = flow_run_logs(deployment, fleet_id)
    for name, logs in [("fleet", fleet_log)] + [(r.name, flow_run_logs(deployment, r.id))
                                                 for r in child_runs(deployment, fleet_id)]:
        assert not [m for level, m in logs if level >= 40 and "Traceback" in m], (name, logs)
        told = [m for _, m in logs if " FAILED " in m]
        expected = models if name == "fleet" else (name,)
        assert sorted(m.split("/")[0] for m in told) == sorted(expected), (name, told)
        for message in told:
            assert message.split(" FAILED ", 1)[1].startswith(line) and "\n" not in message, (name, message)
            assert message.split(" FAILED ")[0].endswith("/" + ",".join(TARGETS)), message


GATED = textwrap.dedent(
    '''
    """examples.models' models, each built only once {go} exists (its run marks {here}/<name>.started):
    a night under way, every model before its first stage."""
    import time
    from pathlib import Path

    from examples.models import MODELS


    def _gate(name):
        (Path({here!r}) / f"{{name}}.started").touch()
        while not Path({go!r}).exists():
            time.sleep(0.1)
        return MODELS[name]()

    '''
)


def gated_fleet(store: str, directory: Path, models: tuple[str, ...], locks: str | None = None) -> tuple[Path, Path]:
    """A fleet manifest of ``models`` whose builds wait for a file: (manifest, that file)."""
    go = directory / "go"
    source = GATED.format(go=str(go), here=str(directory))
    source += "".join(f"\ndef {m}():\n    return _gate({m!r})\n" for m in models)
    (directory / "gated.py").write_text(source)
    fleet = fleet_manifest(store, models)
    for entry in fleet["models"]:
        entry["model"] = f"{directory / 'gated.py'}:{entry['name']}"
    if locks:
        fleet["locks"] = locks
    manifest = directory / "fleet.json"
    manifest.write_text(json.dumps(fleet))
    return manifest, go


def night_with_an_outage(deployment: Deployment, directory: Path, manifest: Path, go: Path, stop) -> tuple[int, str]:
    """The fleet of ``manifest`` (gated_fleet) started; once a model run is under way, ``stop()``
    (the outage), then the models go on.  (exit status of `--watch`, fleet run id)."""
    with start_fleet(deployment, manifest) as proc:
        fleet_id = wait_until(lambda: fleet_run_id(proc), "the fleet run's id", 60, {"fleet": proc})
        wait_until(lambda: list(directory.glob("*.started")), "a model run under way", FLEET_TIMEOUT, {"fleet": proc})
        stop()
        go.touch()
        finish(proc, timeout=FLEET_TIMEOUT)
    return proc.returncode, fleet_id


def assert_notified_once(deployment: Deployment, fleet_id: str, sentence: str) -> None:
    """The failed night's notification has the cause ``sentence``, once, and the retry command;
    no worker's console has Prefect's repeats of it (``Failed to write result`` …) or a traceback."""
    [notified] = wait_until(lambda: [n for n in deployment.notifications if fleet_id in n["body"]],
                            "notification of the failed fleet", 60, {"server.sh": deployment.server})
    assert notified["body"].count(sentence) == 1, notified
    assert f"prefect flow-run retry {fleet_id}" in notified["body"], notified
    for worker in deployment.workers:
        console = deployment.worker_output(worker)
        assert not [noise for noise in CONSOLE_NOISE if noise in console], (worker, console[-5000:])


def test_redis_down_mid_night_fails_each_model_in_one_line(deployment, tmp_path):
    """The manifest's Redis (the stage locks) stops while the night runs: every model fails
    at once with one line naming the server, in every log and summary; the fleet's state
    and its notification say that cause once, with the models it hit; nothing waits."""
    from tests.test_locks import redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    models = ("mlp", "lifted_constant")
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as redis:
        manifest, go = gated_fleet(str(tmp_path / "store"), tmp_path, models, locks=redis)
        port = int(redis.rsplit(":", 1)[1].split("/")[0])
        stop = lambda: subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True)
        start = time.monotonic()
        status, fleet_id = night_with_an_outage(deployment, tmp_path, manifest, go, stop)
        print(f"Redis stopped mid-night: the fleet failed {time.monotonic() - start:.1f} s after it started")
    fleet_run = read_run(deployment, fleet_id)
    assert status != 0 and fleet_run.state.is_failed(), fleet_run.state
    line = f"cannot reach the stage locks' Redis {redis}"
    summary = json.loads((tmp_path / "store" / "outputs" / "fleet.json").read_text())
    assert summary["failed"] == list(models), summary["failed"]
    for m in models:
        assert summary["models"][m]["error"].startswith(line), summary["models"][m]
        assert "Connection refused" in summary["models"][m]["error"]
    sentence = summary["models"][models[0]]["error"]
    assert fleet_run.state.message.endswith(f": 2 of 2 models failed: {', '.join(models)}; {sentence}"), \
        fleet_run.state.message  # after Prefect's "Flow run encountered an exception: FleetFailed"
    assert_notified_once(deployment, fleet_id, sentence)
    assert_one_line_per_model(deployment, fleet_id, models, line)
    report = latest_artifact(deployment, "lowerflow-fleet")
    assert [l.split(": ", 1)[0] for l in report.splitlines() if l.startswith("- ")] == [f"- {m} / all" for m in models]
    assert report.count(f"all: {line}") == 2, report


def test_s3_down_fails_each_model_in_one_line(deployment, tmp_path):
    """The S3 store's endpoint is down (moto stopped): every model fails with the CLI's
    line naming the store and the endpoint, in the logs, the reports and the fleet's
    state; no traceback at ERROR."""
    models = ("mlp", "lifted_constant")
    store = f"s3://{deployment.s3.bucket}/down"
    manifest, go = gated_fleet(store, tmp_path, models)
    try:
        start = time.monotonic()
        status, fleet_id = night_with_an_outage(deployment, tmp_path, manifest, go, deployment.s3.stop)
        seconds = time.monotonic() - start
    finally:
        deployment.s3.start()
    print(f"S3 stopped mid-night: the fleet failed {seconds:.1f} s after it started")
    assert status != 0
    endpoint = deployment.s3.env["AWS_ENDPOINT_URL_S3"]
    line = f'cannot reach the artifact store {store}: Could not connect to the endpoint URL: "{endpoint}"; check'
    fleet_run = read_run(deployment, fleet_id)
    assert fleet_run.state.is_failed() and "FleetFailed: 2 of 2 models failed: mlp, lifted_constant; " + line \
        in fleet_run.state.message, fleet_run.state.message
    sentence = fleet_run.state.message.split("lifted_constant; ", 1)[1]
    assert fleet_run.state.message.count(line) == 1, fleet_run.state.message  # said once (fleet.json's too)
    assert_notified_once(deployment, fleet_id, sentence)
    assert_one_line_per_model(deployment, fleet_id, models, line)
    for m in models:  # each model's report, and the fleet's, say it once
        assert f"**error:** `{line}" in latest_artifact(deployment, f"lowerflow-model-{m}".replace("_", "-"))
    report = latest_artifact(deployment, "lowerflow-fleet")
    assert [l.split(": ", 1)[0] for l in report.splitlines() if l.startswith("- ")] == [f"- {m} / all" for m in models]
    assert report.count(line) == 2 and "objects/" not in report, report


HANG = textwrap.dedent(
    '''
    """A model whose eager forward (verify's) writes its process id to {pidfile}, then
    waits while {flag} exists: a run that hangs mid-lowering, after export and the
    targets' earlier stages."""
    import os
    import time

    import torch


    class Hang(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            if not torch.compiler.is_exporting() and os.path.exists({flag!r}):
                with open({pidfile!r}, "w") as f:
                    f.write(str(os.getpid()))
                while os.path.exists({flag!r}):
                    time.sleep(0.1)
            return torch.relu(self.linear(x))


    def {name}():
        torch.manual_seed(0)
        return Hang(), (torch.randn(2, 8),)
    '''
)


def hanging_fleet(store: Path, directory: Path, name: str, others: tuple[str, ...] = ()) -> tuple[Path, Path, Path]:
    """A fleet manifest with ``others`` and a model ``name`` that hangs in verify until its
    flag file is removed: (manifest, flag, pid file)."""
    flag, pidfile = directory / f"{name}.hang", directory / f"{name}.pid"
    flag.write_text("")
    (directory / f"{name}.py").write_text(HANG.format(flag=str(flag), pidfile=str(pidfile), name=name))
    fleet = fleet_manifest(store, others)
    fleet["models"].append({"name": name, "model": f"{directory / name}.py:{name}"})
    manifest = directory / "fleet.json"
    manifest.write_text(json.dumps(fleet))
    return manifest, flag, pidfile


def start_fleet(deployment: Deployment, manifest: Path, *params: str):
    """``prefect deployment run 'lower-fleet/nightly-fleet' --watch`` in the background."""
    args = prefect("deployment", "run", "lower-fleet/nightly-fleet", "--param", f"manifest={manifest}",
                   "--param", f"pool={POOL}", *[a for p in params for a in ("--param", p)], "--watch")
    return spawned(args, deployment.env)


def fleet_run_id(proc) -> str:
    match = re.search(r"UUID: ([0-9a-f-]{36})", output_of(proc)[0])
    return match.group(1) if match else ""


def test_fleet_timeout_fails_naming_the_model_still_out(deployment, store, tmp_path):
    """A fleet whose model hangs fails at its timeout, naming it; the next nightly, which
    waited for the deployment's one slot, then runs."""
    manifest, flag, _ = hanging_fleet(store, tmp_path, "stuck")
    (tmp_path / "next").mkdir()
    next_manifest = tmp_path / "next" / "fleet.json"
    next_manifest.write_text(json.dumps(fleet_manifest(tmp_path / "next" / "store", ("mlp",))))
    try:
        with start_fleet(deployment, manifest, "timeout_seconds=15") as proc:
            fleet_id = wait_until(lambda: fleet_run_id(proc), "the fleet run's id", 60, {"fleet": proc})
            with start_fleet(deployment, next_manifest) as later:
                later_id = wait_until(lambda: fleet_run_id(later), "the next fleet run's id", 60, {"fleet": later})
                run = wait_until(lambda: (r := read_run(deployment, fleet_id)).state.is_final() and r,
                                 "the fleet's end", FLEET_TIMEOUT, deployment.workers)
                assert read_run(deployment, later_id).start_time is None or \
                    read_run(deployment, later_id).start_time >= run.end_time  # it waited for the slot
                following = wait_until(lambda: (r := read_run(deployment, later_id)).state.is_final() and r,
                                       "the next fleet's end", FLEET_TIMEOUT, deployment.workers)
    finally:
        flag.unlink(missing_ok=True)
    assert following.state.is_completed(), following.state
    assert run.state.is_failed(), run.state
    assert "1 of 1 models failed: stuck (timed out waiting for stuck)" in run.state.message, run.state.message
    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["failed"] == ["stuck"] and summary["timed_out"] == ["stuck"], summary
    assert "timed out: the fleet waited 15 s" in summary["models"]["stuck"]["error"]
    # The model run was cancelled; it ends (its worker stops it) and frees its worker.
    [stuck] = [r for r in child_runs(deployment, fleet_id) if r.parameters["name"] == "stuck"]
    final = wait_until(lambda: (r := read_run(deployment, stuck.id)).state.is_final() and r,
                       "the timed-out model run's end", 60, deployment.workers)
    assert final.state.is_cancelled(), final.state


def test_lost_worker_machine_the_fleet_resubmits_its_model(deployment, store, tmp_path):
    """SIGKILL of a model worker's whole process group, its flow run included (a lost
    machine): the zombie automation marks the run Crashed, the fleet submits the model
    again, the other worker lowers it from where it was (cache hits), the fleet completes."""
    manifest, flag, pidfile = hanging_fleet(store, tmp_path, "doomed", ("mlp",))
    try:
        with start_fleet(deployment, manifest) as proc:
            fleet_id = wait_until(lambda: fleet_run_id(proc), "the fleet run's id", 60, {"fleet": proc})
            wait_until(lambda: pidfile.exists() and pidfile.read_text(), "the doomed model hanging in verify",
                       FLEET_TIMEOUT, {"fleet": proc})
            pid = int(pidfile.read_text())
            [hung] = [r for r in child_runs(deployment, fleet_id) if r.parameters["name"] == "doomed"]
            [lost] = ran_by(deployment, hung.id)
            # The machine is lost: its worker's process group, and the run's (a plain Prefect
            # worker starts each run in a session of its own; lowerflow worker's are in its group).
            for group in {deployment.workers[lost].pid, os.getpgid(pid)}:
                os.killpg(group, signal.SIGKILL)
            killed, killed_at = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
            flag.unlink()
            deployment.workers[lost].wait(timeout=30)
            survivors = {n: p for n, p in deployment.workers.items() if n != lost}
            run = wait_until(lambda: (r := read_run(deployment, fleet_id)).state.is_final() and r,
                             "the fleet's end after the lost worker", FLEET_TIMEOUT, survivors)
            recovered = time.monotonic() - killed
    finally:
        flag.unlink(missing_ok=True)
    assert run.state.is_completed(), run.state
    assert recovered < ZOMBIE_WINDOW + 60, recovered
    doomed = [r for r in child_runs(deployment, fleet_id) if r.parameters["name"] == "doomed"]
    assert [r.state.type.value for r in doomed] == ["CRASHED", "COMPLETED"], [(r.name, r.state) for r in doomed]
    assert "no heartbeat" in doomed[0].state.message, doomed[0].state.message
    # The crashed run's task runs do not read Running (verify was, when its machine was lost).
    wait_until(lambda: not task_runs_in(deployment, doomed[0].id, "RUNNING", "PENDING"),
               "no task run of the crashed model run Running", 30, {"server.sh": deployment.server})
    assert [t.name for t in task_runs_in(deployment, doomed[0].id, "CRASHED")], "no task run marked Crashed"
    print(f"worker {lost} killed; the fleet completed {recovered:.1f} s later (zombie window {ZOMBIE_WINDOW} s): "
          f"Crashed after {(doomed[0].state.timestamp - killed_at).total_seconds():.1f} s, the new run started "
          f"{(doomed[1].start_time - killed_at).total_seconds():.1f} s and ended "
          f"{(doomed[1].end_time - killed_at).total_seconds():.1f} s after the kill")
    assert ran_by(deployment, doomed[1].id) == [next(iter(survivors))]
    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] is True and summary["models"]["doomed"]["flow_run"] == str(doomed[1].id)
    # It resumed at its stage: export, and the stages of the target that hung before its
    # verify, were cache hits; every verify ran again.
    resumed = stages_of(store, "doomed")
    for t, stages in resumed.items():
        assert stages[0] == ("export", True) and stages[-1] == ("verify", False), (t, stages)
    assert any(all(c for _, c in stages[:-1]) for stages in resumed.values()), resumed
    # The lost machine comes back.
    deployment.workers[lost] = deployment.stack.enter_context(
        spawned([*deployment.commands[lost], "--name", lost], {**deployment.env, "TMPDIR": str(deployment.base / f"tmp-{lost}")}))


def test_lost_fleet_worker_machine_the_fleet_is_retried_and_completes(deployment, store, tmp_path):
    """SIGKILL of the fleet worker's process group, the fleet run included, while its model
    runs are out (a lost fleet machine): the zombie automation marks the fleet run
    Crashed, "retry a lost fleet" schedules it again, the fleet worker that comes back
    takes it, and the new try waits for the model run left running (not submitted
    again) and completes."""
    manifest, flag, pidfile = hanging_fleet(store, tmp_path, "orphan")
    try:
        with start_fleet(deployment, manifest) as proc:
            fleet_id = wait_until(lambda: fleet_run_id(proc), "the fleet run's id", 60, {"fleet": proc})
            wait_until(lambda: pidfile.exists() and pidfile.read_text(), "the model hanging in verify",
                       FLEET_TIMEOUT, {"fleet": proc})
            # The second fleet worker of the README (another machine's): ready before the first is lost.
            standby_tmp = deployment.base / "tmp-fleet-standby"
            standby_tmp.mkdir()
            standby = deployment.stack.enter_context(spawned([*deployment.commands["fleet"], "--name", "fleet"],
                                                             {**deployment.env, "TMPDIR": str(standby_tmp)}))
            wait_until(lambda: list(standby_tmp.glob("lowerflow-warm-*/warm.sock")), "the standby fleet worker",
                       STARTUP, {"standby": standby})
            worker = deployment.workers["fleet"]
            os.killpg(worker.pid, signal.SIGKILL)  # lowerflow worker's runs are in its group
            killed, killed_at = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
            worker.wait(timeout=30)
            flag.unlink()  # the model run, on its own machine, carries on and completes
            deployment.workers["fleet"], deployment.tmpdirs["fleet"] = standby, standby_tmp
            run = wait_until(lambda: (r := read_run(deployment, fleet_id)).state.is_final() and r.run_count > 1 and r,
                             "the retried fleet's end", FLEET_TIMEOUT, deployment.workers)
            recovered = time.monotonic() - killed
    finally:
        flag.unlink(missing_ok=True)
    assert run.state.is_completed(), run.state
    with deployment.client() as client:
        states = client.read_flow_run_states(fleet_id)
    crashed = [s for s in states if s.is_crashed()]
    assert len(crashed) == 1 and "no heartbeat" in crashed[0].message, [(s.name, s.message) for s in states]
    print(f"fleet worker killed; the fleet run was Crashed {(crashed[0].timestamp - killed_at).total_seconds():.1f} s "
          f"later, and completed {recovered:.1f} s after the kill (zombie window {ZOMBIE_WINDOW} s)")
    assert recovered < ZOMBIE_WINDOW + 30 + 60, recovered
    [orphan] = child_runs(deployment, fleet_id)  # waited for, never submitted again
    assert orphan.state.is_completed() and run.run_count == 2
    summary = json.loads((store / "outputs" / "fleet.json").read_text())
    assert summary["ok"] and summary["models"]["orphan"]["flow_run"] == str(orphan.id), summary
    # What the last model's end cost: the fleet's heartbeats (every 10 s) and its window (30 s).
    print(f"the last model run ended {(orphan.end_time - killed_at).total_seconds():.1f} s after the kill, the "
          f"fleet {(run.end_time - orphan.end_time).total_seconds():.1f} s after it; the fleet run's states after "
          "the kill: " + ", ".join(f"{s.name} {(s.timestamp - killed_at).total_seconds():.1f} s" for s in states
                                    if s.timestamp > killed_at))
    assert "its fleet worker or machine was lost" in crashed[0].message, crashed[0].message
    # The page said a retry was scheduled, and a follow-up says the night healed.
    mine = lambda: [n for n in deployment.notifications if fleet_id in n["body"]]  # noqa: E731
    crash_note, recovered = wait_until(lambda: len(mine()) >= 2 and mine(), "both notifications", 60,
                                       {"server.sh": deployment.server})[:2]
    assert "Crashed" in crash_note["subject"] and "a retry is scheduled" in crash_note["body"], crash_note
    assert "no heartbeat" in crash_note["body"], crash_note
    assert "recovered" in recovered["subject"], recovered
    # The orphan was waited for, or had completed when the retry began: no model ran again.
    assert "recovered: completed by retry 1, 0 models re-run" in recovered["body"], recovered


def test_nightly_schedule_creates_the_0200_utc_runs(deployment):
    """The runs the server's scheduler made of the nightly's schedule (recorded by the fixture
    before it paused the schedule, which deleted them): each at 02:00 UTC with the nightly's
    parameters."""
    runs = deployment.scheduled
    assert runs, "the scheduler created no run of lower-fleet/nightly-fleet"
    for run in runs:
        start = run.expected_start_time.astimezone(datetime.timezone.utc)
        assert (start.hour, start.minute) == (2, 0) and run.parameters == NIGHTLY_PARAMETERS


@pytest.mark.skipif(not os.environ.get("LOWERFLOW_MEASURE_NIGHTS"),
                    reason="a measurement (~1 min): LOWERFLOW_MEASURE_NIGHTS=1 runs it")
def test_demo_fleet_cold_and_warm_night(deployment, tmp_path):
    """The demo fleet (examples/fleet.yaml, a .pte per model and target) through the nightly deployment, on a
    fresh store (cold) and again (warm: every stage cached); prints both times."""
    import yaml

    fleet = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
    fleet["store"] = str(tmp_path / "store")
    for entry in fleet["models"]:  # model and calibration specs are relative to the manifest
        for key in ("model", "calibration"):
            if key in entry:
                entry[key] = str(ROOT / "examples" / entry[key])
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(yaml.safe_dump(fleet))
    times = []
    for night in ("cold", "warm"):
        start = time.monotonic()
        status, fleet_id, out = run_fleet(deployment, manifest)
        times.append(time.monotonic() - start)
        assert status == 0, out[-5000:]
    summary = json.loads((tmp_path / "store" / "outputs" / "fleet.json").read_text())
    stages = [r for m in summary["models"].values() for t in m["targets"].values() for r in t["stages"]]
    ptes = list((tmp_path / "store" / "outputs").glob("*/*.pte"))
    print(f"demo fleet through `prefect deployment run --watch`: cold {times[0]:.1f} s, warm {times[1]:.1f} s "
          f"({sum(r['cached'] for r in stages)}/{len(stages)} stages cached), {len(ptes)} .pte")
    assert len(ptes) == sum(len(m["targets"]) for m in summary["models"].values()) and all(r["cached"] for r in stages)


def test_sigterm_stops_a_lowerflow_worker_cleanly(deployment):
    """SIGTERM (systemd's stop) ends ``lowerflow worker`` at once, its warm parent and
    socket directory with it."""
    worker = deployment.workers["fleet"]
    tmp = deployment.tmpdirs["fleet"]
    assert [p.name for p in tmp.glob("lowerflow-warm-*/warm.sock")], list(tmp.iterdir())
    start = time.monotonic()
    os.kill(worker.pid, signal.SIGTERM)
    status = worker.wait(timeout=30)
    print(f"lowerflow worker stopped {time.monotonic() - start:.1f} s after SIGTERM (status {status})")
    assert status == 0, "".join(output_of(worker))[-3000:]
    assert not list(tmp.glob("lowerflow-warm-*")), list(tmp.iterdir())
    with contextlib.suppress(ProcessLookupError):  # nothing of its group is left
        os.killpg(worker.pid, 0)
        pytest.fail("the worker's process group outlived it")
