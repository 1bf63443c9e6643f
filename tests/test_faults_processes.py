"""The fault suite, process-level cases (issue 7): real processes killed with SIGKILL,
concurrent fleets on one store, an S3 store (moto server) that goes away and comes
back, and an ``-o`` destination that cannot be written.

Each case checks what ``tests/test_faults.py`` checks in process: a clear one-line
error naming the cause (and the model where there is one), the other fleet members
finishing, nothing partial or wrong under ``<store>/outputs/`` (a failed target has
no ``.pte`` there; every ``.pte`` there is byte-equal to a clean run's), and a rerun
completing.

Every process and server a test starts is stopped in a ``finally`` (see :func:`spawned`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from flows.lower_fleet import lower_fleet
from tasks import stages

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"
FLEET = ("mlp", "buffer_mutation")  # small; buffer_mutation has state, delegated
TARGETS = ("portable", "reference")
#: Seconds any one subprocess may take before the test fails (a hang is a failure).
TIMEOUT = 240


def fleet_manifest(store, models=FLEET) -> dict:
    return {
        "store": str(store),
        "defaults": {"targets": list(TARGETS)},
        "models": [{"name": m, "model": f"{MODELS}:{m}"} for m in models],
    }


def subprocess_env(prefect_api: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_", "AWS_"))}
    env.update(PREFECT_API_URL=prefect_api, PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


@contextlib.contextmanager
def spawned(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """A subprocess (its own process group) killed, with its group, on the way out.

    Its stdout and stderr go to temporary files (a pipe nobody reads while the test
    waits for a marker could fill and block the process): see :func:`output_of`.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        proc.output_files = (out, err)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):  # anything the process itself started
                os.killpg(proc.pid, signal.SIGKILL)


def output_of(proc: subprocess.Popen) -> tuple[str, str]:
    """What ``proc`` (from :func:`spawned`) wrote so far: (stdout, stderr)."""
    texts = []
    for f in proc.output_files:
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[str, str, float]:
    """Wait for ``proc``; (stdout, stderr, seconds waited).  A process still running after
    ``timeout`` (e.g. waiting on a lock forever) fails the test."""
    start = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args[:4]} did not finish in {timeout} s (waiting on a lock?): {output_of(proc)[1][-3000:]}")
    return (*output_of(proc), time.monotonic() - start)


# --------------------------------------------------------------------------- the fleet script

#: ``python -c FLEET_SCRIPT MANIFEST_JSON [OPTIONS_JSON]``: lower_fleet, then one line
#: ``RESULT={ok, failed, executions, started, finished}`` (started/finished: the flow's
#: wall-clock span).  OPTIONS_JSON may have
#:
#: * ``"block": {"model", "marker", "others"}``: the emit stage body of that model (its
#:   first target, portable) blocks: it lets the other models' stage bodies run (it
#:   releases the per-process body lock), waits until every other model has written
#:   its manifest, writes the marker file (its pid) and sleeps, inside the emit task
#:   with its transaction lock held, until SIGKILLed;
#: * ``"wait_marker": path``: the file is written when the process first waits for a
#:   stage lock another process holds.
FLEET_SCRIPT = textwrap.dedent(
    """
    import functools, json, os, sys, threading, time
    from pathlib import Path
    import flows.lower_fleet as fleet_flow
    from flows.lower_fleet import FleetFailed, lower_fleet
    from tasks import stages
    from tasks.locks import FileLockManager
    from tasks.torch_lock import TORCH_LOCK

    manifest = json.loads(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if "block" in options:
        block = options["block"]
        current = threading.local()
        lower_member, run_emit = fleet_flow.lower_member, stages.run_emit

        def named_member(params):  # remember which model this thread lowers
            current.model = params["name"]
            return lower_member(params)

        @functools.wraps(run_emit)  # the task's parameters, and so its cache keys, stay emit's
        def blocking_emit(store, *args, **kwargs):
            if getattr(current, "model", None) != block["model"]:
                return run_emit(store, *args, **kwargs)
            TORCH_LOCK.release()  # the other models' stages may run meanwhile
            outputs = Path(manifest["store"]) / "outputs"
            while not all((outputs / m / "manifest.json").exists() for m in block["others"]):
                time.sleep(0.05)
            Path(block["marker"]).write_text(str(os.getpid()))
            time.sleep(3600)

        fleet_flow.lower_member, stages.run_emit = named_member, blocking_emit
    if "wait_marker" in options:
        wait_for_lock = FileLockManager.wait_for_lock

        def marked_wait(self, key, timeout=None):
            Path(options["wait_marker"]).write_text(key)
            return wait_for_lock(self, key, timeout)

        FileLockManager.wait_for_lock = marked_wait
    started = time.time()
    try:
        summary, ok = lower_fleet(manifest), True
    except FleetFailed as exc:
        summary, ok = exc.summary, False
    print("RESULT=" + json.dumps({"ok": ok, "failed": summary["failed"], "executions": dict(stages.EXECUTIONS),
                                  "started": started, "finished": time.time()}))
    """
)


def wait_for_file(path: Path, proc: subprocess.Popen, what: str) -> str:
    """The content of ``path`` once ``proc`` has written it; fails if proc exits first."""
    deadline = time.monotonic() + TIMEOUT
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            pytest.fail(f"the fleet exited ({proc.returncode}) before {what}: {output_of(proc)[1][-3000:]}")
        assert time.monotonic() < deadline, f"the fleet never got to {what}"
        time.sleep(0.1)
    time.sleep(0.1)
    return path.read_text()


def run_fleet_result(out: str) -> dict:
    line = next((l for l in out.splitlines() if l.startswith("RESULT=")), None)
    assert line is not None, out[-2000:]
    return json.loads(line.split("=", 1)[1])


# --------------------------------------------------------------------------- outputs


def local_outputs(store: Path) -> dict[str, bytes]:
    """Every file under <store>/outputs by relative path."""
    root = store / "outputs"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_outputs_clean(files: dict[str, bytes], clean: dict[str, bytes], absent: set[str] = frozenset()) -> None:
    """No partial file (temporary names) under outputs/; each .pte equals the clean run's
    bytes; the ``absent`` programs (failed or unfinished targets) are not there."""
    partial = [name for name in files if ".tmp-" in name or ".probe-" in name]
    assert not partial, partial
    ptes = {name: data for name, data in files.items() if name.endswith(".pte")}
    for name, data in ptes.items():
        assert name in clean, f"{name} is not a program of a clean run"
        assert data == clean[name], f"outputs/{name} differs from a clean run's"
    assert not absent & set(ptes), sorted(absent & set(ptes))


def result_records(store: Path) -> collections.Counter:
    """How many stage result records each stage has in the store (one per computed key)."""
    root = store / "prefect" / "results"
    names = [p.name for p in root.iterdir()] if root.is_dir() else []
    return collections.Counter(n.rsplit("-", 1)[0] for n in names)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, prefect_api) -> dict:
    """A cold fleet run in a fresh store (in this process): its .pte bytes by
    ``<model>/<target>.pte`` and how many times each stage body ran."""
    store = tmp_path_factory.mktemp("clean") / "store"
    stages.LIVE.clear()
    before = stages.EXECUTIONS.copy()
    try:
        summary = lower_fleet(fleet_manifest(store))
    finally:
        stages.LIVE.clear()
    assert summary["ok"], summary["failed"]
    ptes = {k: v for k, v in local_outputs(store).items() if k.endswith(".pte")}
    assert set(ptes) == {f"{m}/{t}.pte" for m in FLEET for t in TARGETS}
    executions = stages.EXECUTIONS - before
    # Each execution of a cold run is one result record (the key of every computation differs).
    assert result_records(store) == executions
    return {"pte": ptes, "executions": dict(executions)}


# --------------------------------------------------------------------------- 1. SIGKILL mid-stage


BLOCKED = "buffer_mutation"  # the model whose emit stage is mid-way when the fleet is killed


def blocked_fleet(tmp_path: Path, manifest: str) -> tuple[list[str], Path]:
    """The fleet's command line with :data:`BLOCKED`'s emit blocking, and the marker path."""
    others = [m for m in FLEET if m != BLOCKED]
    marker = tmp_path / "blocked"
    options = {"block": {"model": BLOCKED, "marker": str(marker), "others": others}}
    return [sys.executable, "-c", FLEET_SCRIPT, manifest, json.dumps(options)], marker


def kill_when_blocked(proc: subprocess.Popen, marker: Path) -> None:
    assert wait_for_file(marker, proc, f"{BLOCKED}'s emit stage") == str(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def assert_blocked_state(store: Path, pid: int, clean_run: dict) -> collections.Counter:
    """Once the fleet blocked (and after it was killed): its emit lock is there; the
    other models finished and published clean programs, the blocked one nothing.
    Returns the finished stages (result records) by stage."""
    locks = [json.loads(p.read_text()) | {"file": p.name} for p in (store / "prefect" / "locks").glob("*.lock")]
    dead = [lock["file"] for lock in locks if lock.get("pid") == pid]
    assert any(name.startswith("emit-") for name in dead), locks
    after_kill = local_outputs(store)
    assert {f"{m}/{t}.pte" for m in FLEET if m != BLOCKED for t in TARGETS} <= set(after_kill)
    assert_outputs_clean(after_kill, clean_run["pte"], absent={f"{BLOCKED}/{t}.pte" for t in TARGETS})
    finished = result_records(store)
    assert finished["export"] == len(FLEET)
    return finished


def assert_resumed(store: Path, result: dict, err: str, dead_pid: int, finished: collections.Counter, clean_run: dict):
    """The run after the kill: ok, ran exactly what had not finished (no export again),
    removed the dead process's lock, and every program equals a clean run's."""
    assert result["ok"] and result["failed"] == []
    expected = {s: n - finished[s] for s, n in clean_run["executions"].items() if n - finished[s]}
    assert result["executions"] == expected, (result["executions"], finished)
    assert "export" not in result["executions"]  # every export had finished: reused
    assert result["executions"]["emit"] >= 1  # the killed stage ran again
    assert "removing stale lock" in err and f"of dead process {dead_pid}" in err, err[-3000:]
    assert not [p.name for p in (store / "prefect" / "locks").glob("*.lock")]
    files = local_outputs(store)
    assert_outputs_clean(files, clean_run["pte"])
    assert {k for k in files if k.endswith(".pte")} == set(clean_run["pte"])
    assert json.loads(files["fleet.json"])["ok"] is True


def test_fleet_sigkilled_mid_stage_then_rerun(tmp_path, prefect_api, clean_run):
    store = tmp_path / "store"
    manifest = json.dumps(fleet_manifest(store))
    env = subprocess_env(prefect_api)
    command, marker = blocked_fleet(tmp_path, manifest)
    with spawned(command, env) as proc:
        kill_when_blocked(proc, marker)
    finished = assert_blocked_state(store, proc.pid, clean_run)  # the dead process's lock remains

    # Rerun: no wait on the stale lock (a wait would never end: the timeout fails it),
    # only what had not finished runs, and every program equals a clean run's.
    with spawned([sys.executable, "-c", FLEET_SCRIPT, manifest], env) as rerun:
        out, err, _ = finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    assert_resumed(store, run_fleet_result(out), err, proc.pid, finished, clean_run)


def test_fleet_waiting_on_a_lock_whose_holder_is_sigkilled_finishes(tmp_path, prefect_api, clean_run):
    """A second fleet started meanwhile waits for the blocked emit's lock; the holder is
    killed: the waiter sees the holder is gone, takes the lock and finishes the fleet."""
    store = tmp_path / "store"
    manifest = json.dumps(fleet_manifest(store))
    env = subprocess_env(prefect_api)
    command, marker = blocked_fleet(tmp_path, manifest)
    waiting = tmp_path / "waiting"
    with spawned(command, env) as holder:
        assert wait_for_file(marker, holder, f"{BLOCKED}'s emit stage") == str(holder.pid)
        finished = assert_blocked_state(store, holder.pid, clean_run)
        waiter_command = [sys.executable, "-c", FLEET_SCRIPT, manifest, json.dumps({"wait_marker": str(waiting)})]
        with spawned(waiter_command, env) as waiter:
            assert wait_for_file(waiting, waiter, "a lock wait").startswith("emit-")
            kill_when_blocked(holder, marker)
            out, err, _ = finish(waiter)
    assert waiter.returncode == 0, err[-3000:]
    assert_resumed(store, run_fleet_result(out), err, holder.pid, finished, clean_run)


# --------------------------------------------------------------------------- 2. concurrent fleets


def test_two_concurrent_fleets_on_one_store_compute_each_stage_once(tmp_path, prefect_api, clean_run):
    store = tmp_path / "store"
    manifest = json.dumps(fleet_manifest(store))
    env = subprocess_env(prefect_api)
    totals: collections.Counter = collections.Counter()
    spans = []
    with spawned([sys.executable, "-c", FLEET_SCRIPT, manifest], env) as first, \
            spawned([sys.executable, "-c", FLEET_SCRIPT, manifest], env) as second:
        for proc in (first, second):
            out, err, _ = finish(proc)
            assert proc.returncode == 0, err[-3000:]
            result = run_fleet_result(out)
            assert result["ok"] and result["failed"] == []
            totals.update(result["executions"])
            spans.append((result["started"], result["finished"]))
    (start1, end1), (start2, end2) = spans
    assert start1 < end2 and start2 < end1, f"the two fleets did not run at the same time: {spans}"
    assert dict(totals) == clean_run["executions"]
    files = local_outputs(store)
    assert_outputs_clean(files, clean_run["pte"])
    assert {k for k in files if k.endswith(".pte")} == set(clean_run["pte"])
    assert not list((store / "prefect" / "locks").glob("*.lock"))


# --------------------------------------------------------------------------- 3. the store goes away


#: What bounds a run against an unreachable S3 endpoint.  botocore's default (legacy
#: mode, 5 attempts, backoff up to 8 s) spends ~10 s per S3 call, and a run that
#: finds the store gone still makes 6 calls (3 result-record lookups, the export's
#: put, the previous manifest, unpublishing): 60-75 s.  With 2 attempts: ~5 s.
#: ``AWS_MAX_ATTEMPTS=2`` alone does the same; fsspec's per-protocol configuration
#: (``FSSPEC_S3``, JSON kwargs of every S3FileSystem, the store's and the Prefect
#: result block's alike) also bounds the connect timeout (botocore's default: 60 s
#: per attempt), which matters when the endpoint drops packets instead of refusing.
BOUNDED_RETRIES = {"FSSPEC_S3": json.dumps({"config_kwargs": {"connect_timeout": 5, "read_timeout": 30,
                                                              "retries": {"max_attempts": 2, "mode": "legacy"}}})}


def test_s3_store_unavailable_then_back(tmp_path, prefect_api, clean_run):
    pytest.importorskip("s3fs")
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}/store"
    out_dir = tmp_path / "out"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    running = [server]  # stopped in the finally
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        aws = {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "lowerflow-test",
               "AWS_SECRET_ACCESS_KEY": "lowerflow-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=aws["AWS_ACCESS_KEY_ID"], aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket=bucket)
        running.pop().stop()

        env = subprocess_env(prefect_api, **aws, **BOUNDED_RETRIES)
        cli = [sys.executable, "-m", "flows.cli", "lower", "examples/models.py:mlp",
               "--target", "portable", "--target", "reference", "-o", f"{out_dir}/", "--store", url]
        with spawned(cli, env) as down:
            _, err, seconds = finish(down, timeout=120)
        assert down.returncode == 1, err[-3000:]
        errors = [l for l in err.splitlines() if l.startswith("lowerflow: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert f"cannot reach the artifact store {url}" in errors[0], errors[0]
        assert endpoint in errors[0], errors[0]  # the cause: which endpoint did not answer
        assert seconds < 60, f"a run against a stopped store took {seconds:.0f} s"
        assert not out_dir.exists() or not list(out_dir.iterdir())

        # The server comes back on the same port.  moto keeps its state in-process
        # (module-level backends), so the bucket is still there.
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        running.append(server)
        assert bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]
        fs = s3fs.S3FileSystem(key=aws["AWS_ACCESS_KEY_ID"], secret=aws["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
        assert not fs.find(f"{bucket}/store/outputs")  # the failed run published nothing

        with spawned(cli, env) as back:
            out, err, _ = finish(back)
        assert back.returncode == 0, err[-3000:]
        for target in TARGETS:
            assert f"{target}: wrote {out_dir}/mlp.{target}.pte" in out, out
            assert (out_dir / f"mlp.{target}.pte").read_bytes() == clean_run["pte"][f"mlp/{target}.pte"]
        fs.invalidate_cache()
        prefix = f"{bucket}/store/outputs/"
        published = {p[len(prefix):]: fs.cat_file(p) for p in fs.find(prefix)}
        assert_outputs_clean(published, clean_run["pte"])
        assert {k for k in published if k.endswith(".pte")} == {f"mlp/{t}.pte" for t in TARGETS}
    finally:
        for server in running:
            server.stop()


# --------------------------------------------------------------------------- 4. read-only -o


@contextlib.contextmanager
def unwritable_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory no one can write into, even root (the tests run as root, so a
    chmod would not stop a write), and the reason a write there fails:

    * where ``mount`` works (root with CAP_SYS_ADMIN, as in CI and here): a read-only
      tmpfs mounted on it, EROFS;
    * elsewhere: a path whose parent is a regular file, so mkdir fails with ENOTDIR.
    """
    target = tmp_path / "ro"
    target.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(target)],
                                 capture_output=True, text=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    if not mounted:
        (tmp_path / "file").write_text("")
        yield tmp_path / "file" / "sub", "Not a directory"
        return
    try:
        yield target, "Read-only file system"
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_unwritable_output_fails_before_lowering(tmp_path, prefect_api):
    store = tmp_path / "store"
    with unwritable_dir(tmp_path) as (where, reason):
        destination = where / "x.pte"
        cli = [sys.executable, "-m", "flows.cli", "lower", "examples/models.py:mlp", "-o", str(destination),
               "--store", str(store)]
        with spawned(cli, subprocess_env(prefect_api)) as proc:
            out, err, _ = finish(proc, timeout=120)
        assert proc.returncode == 2, err[-3000:]
        errors = [l for l in err.splitlines() if l.startswith("lowerflow: error:")]
        assert errors == [f"lowerflow: error: -o '{destination}': cannot write there: {reason}"], err[-3000:]
        assert "Traceback" not in err and out == ""
        assert not destination.exists()
    assert not store.exists()  # no lowering ran: nothing was stored
