"""Warm starts (flows/warm_start.py): a child forked from the warm parent behaves as
``python -m MODULE`` would — the client's environment, directory, arguments, stdio
and exit status, signals forwarded — and the warm parent never runs stale code.

The probe module prints what the child sees as one JSON line; ``warm`` says whether
torch was already imported when it started (true only in a forked child).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_faults_processes import spawned

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    VERSION = 1
    WARM = "torch" in sys.modules  # at import: true in the warm parent only

    def main():
        warm = "torch" in sys.modules and WARM
        if sys.argv[1:2] == ["wait"]:  # wait for SIGTERM; say it came
            signal.signal(signal.SIGTERM, lambda *_: (print("TERM", flush=True), os._exit(43)))
            print("WAITING", os.getpid(), flush=True)
            time.sleep(60)
            sys.exit(1)
        if sys.argv[1:2] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        print(json.dumps({"warm": warm, "version": VERSION, "cwd": os.getcwd(), "argv": sys.argv[1:],
                          "probe_env": os.environ.get("PROBE_ENV"), "pid": os.getpid(), "ppid": os.getppid()}))
        sys.exit(int(os.environ.get("PROBE_EXIT", "0")))

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture(scope="module")
def warm_parent(tmp_path_factory):
    """A warm parent preloading the probe module too; yields (socket path, probe file, env)."""
    tmp = tmp_path_factory.mktemp("warm")
    probe = tmp / "warm_probe.py"
    probe.write_text(PROBE)
    sock = tmp / "warm.sock"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp}"}
    with spawned([sys.executable, "-m", "flows.warm_start", "serve", str(sock), "warm_probe"], env) as parent:
        deadline = time.monotonic() + 180
        while not sock.exists():
            assert parent.poll() is None, "the warm parent exited"
            assert time.monotonic() < deadline, "the warm parent was not ready in 180 s"
            time.sleep(0.1)
        yield sock, probe, {**env, "LOWERFLOW_WARM_SOCKET": str(sock)}, parent


def run_client(env: dict, *args: str, cwd: Path | None = None, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.warm_start", "run", "warm_probe", *args],
                          env={**env, **extra}, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_child_gets_the_clients_environment_directory_arguments_stdio_and_exit_status(warm_parent, tmp_path):
    sock, _probe, env, parent = warm_parent
    done = run_client(env, "a", "b c", cwd=tmp_path, PROBE_ENV="from-client", PROBE_EXIT="3")
    assert done.returncode == 3, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["warm"] is True  # forked from the parent that imported torch
    assert seen["ppid"] == parent.pid
    assert seen == {**seen, "cwd": str(tmp_path), "argv": ["a", "b c"], "probe_env": "from-client"}


def test_without_a_warm_parent_the_client_starts_cold(warm_parent, tmp_path):
    _sock, _probe, env, _parent = warm_parent
    done = run_client(env, "x", LOWERFLOW_WARM_SOCKET=str(tmp_path / "none.sock"))
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["warm"] is False and seen["argv"] == ["x"]


def test_a_child_killed_by_a_signal_gives_128_plus_the_signal(warm_parent):
    _sock, _probe, env, _parent = warm_parent
    assert run_client(env, "kill").returncode == 128 + signal.SIGKILL


def test_sigterm_to_the_client_reaches_the_child(warm_parent):
    _sock, _probe, env, _parent = warm_parent
    client = subprocess.Popen([sys.executable, "-m", "flows.warm_start", "run", "warm_probe", "wait"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().startswith("WAITING")
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 43
        assert client.stdout.read().strip() == "TERM"
    finally:
        client.kill()


def test_an_edited_module_is_never_served_stale(warm_parent):
    """Edit a preloaded module: the next run is a cold start with the new code, and once
    no child runs the parent reloads itself and serves the new code warm."""
    _sock, probe, env, _parent = warm_parent
    assert json.loads(run_client(env).stdout.splitlines()[-1])["version"] == 1
    probe.write_text(PROBE.replace("VERSION = 1", "VERSION = 2"))
    cold = json.loads(run_client(env).stdout.splitlines()[-1])
    assert (cold["warm"], cold["version"]) == (False, 2)
    deadline = time.monotonic() + 180
    while True:  # the parent re-executes itself and preloads again
        seen = json.loads(run_client(env).stdout.splitlines()[-1])
        assert seen["version"] == 2
        if seen["warm"]:
            break
        assert time.monotonic() < deadline, "the warm parent did not come back"
        time.sleep(0.5)
