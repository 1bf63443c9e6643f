"""deployments/README.md's single-host trial, both its blocks as written, from a ``git
clone`` of this checkout (issue 31): its own PostgreSQL, Prefect server, Redis, moto S3
and three workers, and a cold night; the stop block leaves nothing running.

Apart from tests/test_deployment.py (the deployment's tests on their own server): --dist
loadfile runs it beside other files, on the other worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_deployment import free_port, kill_postmaster, no_postgres_user, postgres_bindir
from tests.test_faults_processes import ROOT

pytestmark = [
    pytest.mark.skipif(postgres_bindir() is None, reason="PostgreSQL is not installed (CI installs it)"),
    pytest.mark.skipif(no_postgres_user(), reason="running as root and there is no `postgres` user to run PostgreSQL"),
]


# deployments/README.md's "Try it on one machine" runs as written, from a `git clone` of
# this checkout (its HEAD: uncommitted changes are not in the clone).  Everything it starts
# is its own (HOME, free ports, a mark in the environment), so it runs beside
# tests/test_deployment.py's deployment.  What the test changes, and nothing else:
#
# * `<lowerflow>` in the clone line: this checkout's path;
# * the environment: HOME a temporary directory (so `$TRIAL` and server.sh's state are
#   there; TMPDIR in it too), PORT, LOWERFLOW_PG_PORT, REDIS_PORT and S3_PORT free ports
#   (the block's own variables), PATH the system's, PIP_* below;
# * `bash -ex` runs the lines (the first that fails stops it, and the output says which),
#   with a PS4 that times each line;
# * after the clone line, the clone's `.venv` is created layered on this test environment
#   (:func:`layered_venv`), so `./run setup demo` and the pip line run for real but find
#   every requirement installed: pip runs with PIP_NO_INDEX (nothing is downloaded; a
#   requirement missing from the layer fails the line) and without build isolation (the
#   build backend, setuptools, comes from the layer too).  Nothing is installed into this
#   environment: pip installs lowerflow into the clone's .venv.
#
# The stop block runs in a second shell, in the clone, with `$TRIAL` set (as from another
# terminal).  Whatever outlives it fails the test, and is killed in a finally (found by a
# mark in its environment; Redis and PostgreSQL by their pid files).

TRIAL_MARK = "LF_TRIAL_TEST_RUN"
#: Seconds for the whole trial, from the clone to the last line of its block: a first
#: PostgreSQL cluster, the server, three workers and a cold night (5 small models, 12 .pte).
TRIAL_TIMEOUT = 600


def trial_blocks(readme: Path) -> tuple[list[str], list[str]]:
    """The lines of the two ```bash blocks of the README's "Try it on one machine": (the
    trial, the stop block)."""
    text = readme.read_text()
    section = text[text.index("## Try it on one machine"):]
    section = section[:section.index("\n## ", 1)]
    setup, stop = [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    return setup, stop


def layered_venv(venv: Path, layer: Path) -> list[str]:
    """``python -m venv --without-pip venv``, then a layer of this environment under it:
    ``layer`` gets a link to each installed file and directory of the distributions
    lowerflow's base and ``deploy`` extra require (their closure, by this environment's
    metadata, markers evaluated here), plus pip and setuptools (what ``./run setup demo``
    and ``pip install -e '.[deploy]'`` would install); a ``.pth`` in the venv adds it
    (``site.addsitedir``: its own ``.pth`` files run), and ``venv/bin`` gets their
    console scripts (``prefect``, ``moto_server``, ``pip`` ...).  lowerflow itself is
    not in the layer: the clone's setup installs it.  Returns the distributions' names."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        installed.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    wanted = [Requirement("pip"), Requirement("setuptools")]
    wanted += [r for r in map(Requirement, installed["lowerflow"].requires or [])
               if r.marker is None or r.marker.evaluate({"extra": "deploy"})]
    extras: dict[str, set[str]] = {}
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        assert name in installed, f"{req} (lowerflow's base or deploy requirements) is not installed here"
        if name in extras and set(req.extras) <= extras[name]:
            continue
        extras[name] = extras.get(name, set()) | set(req.extras)
        wanted += [r for r in map(Requirement, installed[name].requires or [])
                   if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras[name] | {""})]
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    layer.mkdir()
    for name in extras:
        dist = installed[name]
        site = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []} | {Path(dist._path).name}
        for top in tops - {"..", "__pycache__"}:
            if (site / top).exists() and not (layer / top).exists():
                (layer / top).symlink_to(site / top)
        for entry in dist.entry_points.select(group="console_scripts"):
            script = venv / "bin" / entry.name
            if not script.exists():
                script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {entry.module} import {entry.attr.split('.')[0]}\n"
                                  f"sys.exit({entry.attr}())\n")
                script.chmod(0o755)
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    (site_packages / "lowerflow-test-layer.pth").write_text(f"import site; site.addsitedir({str(layer)!r})\n")
    return sorted(extras)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked_processes(mark: str) -> set[int]:
    """Live processes whose environment has ``TRIAL_MARK=mark``: what the trial started
    (not Redis: its process title overwrites its environment)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"{TRIAL_MARK}={mark}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.add(int(proc.name))
        except OSError:
            pass
    return {pid for pid in pids if alive(pid)}


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_single_host_trial_runs_from_a_fresh_clone():
    """deployments/README.md's "Try it on one machine", as written, from a fresh clone
    (the substitutions above): the night completes (``--watch``, the API, ``lowerflow
    nights``), every model's and target's .pte is in the moto bucket, each worker's
    console has lowerflow's lines only, and the stop block leaves no process and no port."""
    import uuid

    import boto3
    import yaml

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()) != ROOT:
        pytest.fail(f"{ROOT} is not a git checkout: this test runs the README's trial from a `git clone` of it "
                    f"({top.stderr.strip()})")
    base = Path(tempfile.mkdtemp(prefix="lf-trial-"))
    base.chmod(0o755)  # PostgreSQL's OS user (`postgres` when root) reaches $HOME/.lowerflow/postgres
    clone = base / "lowerflow"
    mark = uuid.uuid4().hex
    ports = {name: free_port() for name in ("PORT", "LOWERFLOW_PG_PORT", "REDIS_PORT", "S3_PORT")}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "LOWERFLOW_", "AWS_", "REDIS", "PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update({name: str(port) for name, port in ports.items()}, HOME=str(base), TMPDIR=str(base / "tmp"),
               PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **{TRIAL_MARK: mark},
               # No index: nothing is downloaded.  PIP_NO_BUILD_ISOLATION=0 is pip's "build isolation
               # off" (it sets build_isolation=0): the build backend comes from the layer.
               PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    (base / "tmp").mkdir()
    trial = base / ".lowerflow" / "trial"
    stop: list[str] = []
    stopped = False
    daemons: set[int] = set()  # Redis and PostgreSQL, from their pid files

    def left() -> set[int]:
        """The trial's processes still running."""
        return marked_processes(mark) | {pid for pid in daemons if alive(pid)}

    def logs() -> str:
        """The end of each service's log in ``$TRIAL``, for a failure's message."""
        return "".join(f"\n---- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(trial.glob("*.log"))
                       if log.name != "moto.log")

    def bash(lines: list[str], log: str, cwd: Path, timeout: float) -> tuple[int | None, str]:
        """``lines`` in ``bash -ex`` (stops at the first line that fails, says which): (status, its output);
        killed with its process group after ``timeout`` s (status None)."""
        with open(base / log, "w+") as out:
            script = "\n".join(["PS4='+ ${SECONDS}s '", *lines])  # each line as it runs, and when
            proc = subprocess.Popen(["bash", "-exc", script], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            return proc.returncode, out.read()

    try:
        start = time.monotonic()
        setup, stop = trial_blocks(ROOT / "deployments" / "README.md")
        assert setup[0] == "git clone <lowerflow> lowerflow && cd lowerflow", setup[0]
        status, out = bash([setup[0].replace("<lowerflow>", shlex.quote(str(ROOT)))], "clone.log", base, 120)
        assert status == 0, out
        # The clone's own README from here on: what its HEAD says is what runs.
        setup, stop = trial_blocks(clone / "deployments" / "README.md")
        layered = layered_venv(clone / ".venv", base / "layer")
        assert "moto" in layered and "torch" in layered and "executorch" not in layered, layered
        status, out = bash(["cd lowerflow", *setup[1:]], "trial.log", base, TRIAL_TIMEOUT)
        ran = time.monotonic() - start
        assert status == 0, f"the trial stopped at a line that failed (the last `+ ` line):\n{out[-8000:]}{logs()}"
        for line in ("setup: torch 2.13.0 is installed", "setup: done", "Successfully installed lowerflow"):
            assert line in out, (line, out[:5000])

        # The night completed: --watch says so, and so does the API.
        assert "Flow run finished successfully in 'Completed'." in out, out[-5000:]
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.split("prefect deployment run", 1)[1]).group(1)
        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(f"http://127.0.0.1:{ports['PORT']}/api") as client:
            night = client.read_flow_run(run_id)
        assert night.state.is_completed(), night.state
        # `lowerflow nights`: the night, Completed.
        [line] = [l for l in out.splitlines() if "(nightly-fleet)" in l]
        assert " Completed " in line and "next:" not in out, line
        # Every model's and target's .pte: in the block's listing and in the bucket.
        manifest = yaml.safe_load((clone / "examples" / "trial-fleet.yaml").read_text())
        prefix = "lowerflow-artifacts/lowerflow/nightly/outputs"
        expected = {f"{prefix}/{m['name']}/{t}.pte" for m in manifest["models"]
                    for t in m.get("targets", manifest["defaults"]["targets"])}
        assert len(expected) == 12 and expected <= set(out.splitlines()), out[-3000:]
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['S3_PORT']}", region_name="us-east-1",
                          aws_access_key_id="trial", aws_secret_access_key="trial")
        objects = s3.list_objects_v2(Bucket="lowerflow-artifacts", Prefix="lowerflow/nightly/outputs/")["Contents"]
        ptes = {f"lowerflow-artifacts/{o['Key']}": o["Size"] for o in objects if o["Key"].endswith(".pte")}
        assert set(ptes) == expected and all(size > 100 for size in ptes.values()), ptes

        # The stop block: nothing left, every port free.
        daemons.update({int((trial / "redis.pid").read_text()),
                        int((base / ".lowerflow" / "postgres" / "postmaster.pid").read_text().split()[0])})
        started = {int(pid) for name in ("workers.pid", "moto.pid") for pid in (trial / name).read_text().split()}
        started.add(int((base / ".lowerflow" / "prefect-server.pid").read_text()))
        assert all(map(alive, daemons)) and started <= marked_processes(mark), (daemons, started, left())
        stopped = True
        status, out = bash([f"export TRIAL={shlex.quote(str(trial))}", *stop], "stop.log", clone, 180)
        assert status == 0, out + logs()
        # Each worker's console: lowerflow's lines only (a good night has no line of its own).
        for name, queue in (("models-1", "models"), ("models-2", "models"), ("fleet", "fleet")):
            console = (trial / f"{name}.log").read_text().splitlines()
            assert console == [f"worker on pool lowerflow-pool (queues {queue}, 1 run(s) at once) at "
                               f"http://127.0.0.1:{ports['PORT']}/api; Ctrl-C stops it",
                               f"lowerflow worker {name}: polling", f"lowerflow worker {name}: stopped (SIGTERM)"], console
        deadline = time.monotonic() + 60
        while (left() or any(map(listening, ports.values()))) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left(), [Path(f"/proc/{p}/cmdline").read_bytes() for p in left()]
        assert not [name for name, port in ports.items() if listening(port)], ports
        print(f"the trial from a fresh clone: {ran:.0f} s to its last line, stopped {time.monotonic() - start - ran:.0f} s later")
    finally:
        if not stopped:
            with contextlib.suppress(Exception):
                bash([f"export TRIAL={shlex.quote(str(trial))}", *stop], "stop.log", clone, 120)
        kill_postmaster(base / ".lowerflow" / "postgres")
        with contextlib.suppress(OSError, ValueError):  # a Redis the test did not get to record
            redis = int((trial / "redis.pid").read_text())
            if b"redis-server" in Path(f"/proc/{redis}/cmdline").read_bytes():
                daemons.add(redis)
        for pid in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
