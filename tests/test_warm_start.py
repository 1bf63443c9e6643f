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
import warnings
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
                          "probe_env": os.environ.get("PROBE_ENV"), "pid": os.getpid(), "ppid": os.getppid(),
                          "entrypoint": os.environ.get("PREFECT__FLOW_ENTRYPOINT")}))
        sys.exit(int(os.environ.get("PROBE_EXIT", "0")))

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture(scope="module")
def warm_parent(tmp_path_factory, prefect_api):
    """A warm parent preloading the probe module too, its API the session's Prefect server;
    yields (socket path, probe file, env)."""
    tmp = tmp_path_factory.mktemp("warm")
    probe = tmp / "warm_probe.py"
    probe.write_text(PROBE)
    sock = tmp / "warm.sock"
    # OMP_NUM_THREADS as `lowerflow worker` (--threads 1) sets it: OpenBLAS (numpy's, and
    # scipy's that transformers imports) then starts no thread servers of its own either.
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp}", "PREFECT_API_URL": prefect_api,
           "OMP_NUM_THREADS": "1"}
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


def test_the_warm_parent_forks_with_no_thread_but_torchs_after_its_warm_up_lowering(warm_parent):
    """It lowered a small model to warm torch up (tensor ops on one thread): still only its
    main thread and the one torch's import starts, so a forked child inherits no pool."""
    _sock, _probe, _env, parent = warm_parent
    assert len(os.listdir(f"/proc/{parent.pid}/task")) <= 2


def test_a_flow_entrypoint_in_a_module_the_parent_imported_is_loaded_as_that_module(warm_parent, tmp_path):
    """Prefect runs a ``path.py:flow`` entrypoint as a new module in every run; a warm child
    names the module the parent imported from that same file instead.  The same file
    name elsewhere, or a file the parent never imported, keeps its path."""
    _sock, probe, env, _parent = warm_parent

    def entrypoint(cwd: Path, given: str) -> str:
        done = run_client(env, cwd=cwd, PREFECT__FLOW_ENTRYPOINT=given)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["entrypoint"]

    assert entrypoint(probe.parent, "warm_probe.py:main") == "warm_probe:main"
    assert entrypoint(ROOT, "flows/lower_model.py:lower_model") == "flows.lower_model:lower_model"
    (tmp_path / "warm_probe.py").write_text(PROBE)  # another copy: not what the parent imported
    assert entrypoint(tmp_path, "warm_probe.py:main") == "warm_probe.py:main"
    assert entrypoint(probe.parent, "nowhere.py:main") == "nowhere.py:main"
    assert entrypoint(probe.parent, "warm_probe:main") == "warm_probe:main"


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


TLS_PROBE = textwrap.dedent(
    """
    import json, sys
    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    def context(client):
        return client._client._transport._pool._ssl_context

    a, b = SyncPrefectClient("http://127.0.0.1:9/api"), PrefectClient("http://127.0.0.1:9/api")
    print(json.dumps({"shared": context(a) is context(b), "verifies": context(a).check_hostname,
                      "modeling_utils": "transformers.modeling_utils" in sys.modules}))
    """
)


def test_a_warm_childs_api_clients_share_one_verified_tls_context(warm_parent, tmp_path):
    """Prefect builds a TLS context per API client (35-40 ms each, ~8 a flow run); a warm
    child's clients share the one made for the same CA file, and a child whose settings
    name another CA file, or no verification, gets what Prefect itself would make."""
    _sock, probe, env, _parent = warm_parent
    (probe.parent / "warm_tls_probe.py").write_text(TLS_PROBE)  # on the warm parent's sys.path

    def seen(**extra):
        done = subprocess.run([sys.executable, "-m", "flows.warm_start", "run", "warm_tls_probe"],
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    default = seen()
    assert default == {"shared": True, "verifies": True, "modeling_utils": True}  # transformers: a test extra
    import certifi

    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    assert seen(PREFECT_API_SSL_CERT_FILE=str(bundle))["verifies"] is True
    insecure = seen(PREFECT_API_TLS_INSECURE_SKIP_VERIFY="true")
    assert (insecure["shared"], insecure["verifies"]) == (False, False)  # Prefect's own, per client


VERSION_PROBE = textwrap.dedent(
    """
    import json, os, prefect
    from prefect._internal import version_checking as checks

    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.events.filters import EventFilter

    url = os.environ["PREFECT_API_URL"]
    print(json.dumps({"checked": checks._is_api_version_check_cached(checks._api_version_check_key(url, prefect.__version__)),
                      "schemas": [m.__pydantic_complete__ for m in (FlowRun, DeploymentResponse, EventFilter)]}))
    """
)


def test_a_warm_child_inherits_the_parents_server_version_check_for_its_api_only(warm_parent, prefect_api):
    """Prefect asks the server its version once per process and API URL before a run
    starts (a GET, and a TLS context of its own); the warm parent asked once for its API,
    so a child on that API does not ask again, and a child on another API still does."""
    _sock, probe, env, _parent = warm_parent
    (probe.parent / "warm_version_probe.py").write_text(VERSION_PROBE)

    assert seen(env, prefect_api)["checked"] is True
    assert seen(env, "http://127.0.0.1:9/api")["checked"] is False


def seen(env: dict, api: str, **extra: str) -> dict:
    """What VERSION_PROBE, run through the warm parent on ``api``, reports."""
    done = subprocess.run([sys.executable, "-m", "flows.warm_start", "run", "warm_version_probe"],
                          env={**env, "PREFECT_API_URL": api, **extra}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_child_has_prefects_client_schemas_built(warm_parent, prefect_api, tmp_path):
    """Prefect's client models build their validators on first use (30-40 ms each, in
    every run); a warm child has them built, where a cold process does not."""
    _sock, probe, env, _parent = warm_parent
    (probe.parent / "warm_version_probe.py").write_text(VERSION_PROBE)
    assert seen(env, prefect_api)["schemas"] == [True, True, True]
    assert seen(env, prefect_api, LOWERFLOW_WARM_SOCKET=str(tmp_path / "none.sock"))["schemas"] == [False, False, False]


def test_the_worker_renders_its_settings_for_a_run_once_and_again_when_they_change():
    """The environment every run gets from the worker's settings (Prefect renders every
    setting for every run) is rendered once per settings object, and never stale."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessJobConfiguration

    from flows.warm_worker import warm_worker_class

    configuration = warm_worker_class().job_configuration
    first = configuration._base_environment()
    assert first == ProcessJobConfiguration._base_environment()
    first["MUTATED"] = "1"  # a caller's copy: the next run's is untouched
    assert "MUTATED" not in configuration._base_environment()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/other-api"}):
        changed = configuration._base_environment()
        assert changed["PREFECT_API_URL"] == "http://127.0.0.1:9/other-api"
        assert changed == ProcessJobConfiguration._base_environment()
    assert configuration._base_environment() == ProcessJobConfiguration._base_environment()


def test_worker_preload_of_a_missing_module_is_refused_before_any_work():
    done = subprocess.run([sys.executable, "-m", "flows.cli", "worker", "--pool", "p", "--preload", "no_such_zoo.models"],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": "http://127.0.0.1:9/api"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--preload: no module 'no_such_zoo.models'" in done.stderr, done.stderr[-2000:]


def deployment_with(pull_steps, entrypoint="flows/lower_model.py:lower_model", **fields):
    from uuid import uuid4

    from prefect.client.schemas.responses import DeploymentResponse

    return DeploymentResponse(id=uuid4(), name="d", flow_id=uuid4(), entrypoint=entrypoint,
                              pull_steps=pull_steps, **fields)


def test_local_entrypoint_only_for_code_already_on_this_machine(tmp_path):
    """A deployment whose one pull step is ``set_working_directory`` to a directory here
    loads its flow straight from the entrypoint; anything else runs its pull steps."""
    from flows.warm_worker import SET_WORKING_DIRECTORY, local_entrypoint

    here = [{SET_WORKING_DIRECTORY: {"directory": str(tmp_path)}}]
    assert local_entrypoint(deployment_with(here)) == (str(tmp_path), "flows/lower_model.py:lower_model")
    assert local_entrypoint(deployment_with(
        [{"prefect.deployments.steps.pull.set_working_directory": {"directory": str(tmp_path)}}]))[0] == str(tmp_path)
    refused = {
        "no pull steps": deployment_with(None),
        "a git clone": deployment_with([{"prefect.deployments.steps.git_clone": {"repository": "https://x/y.git"}}]),
        "two steps": deployment_with(here + [{"prefect.deployments.steps.run_shell_script": {"script": "true"}}]),
        "a module path": deployment_with(here, entrypoint="flows.lower_model.lower_model"),
        "a directory elsewhere": deployment_with([{SET_WORKING_DIRECTORY: {"directory": str(tmp_path / "gone")}}]),
        "a templated directory": deployment_with([{SET_WORKING_DIRECTORY: {"directory": "{{ clone.directory }}"}}]),
    }
    assert {why: local_entrypoint(d) for why, d in refused.items()} == dict.fromkeys(refused)


def test_a_full_worker_does_not_poll_and_polls_as_soon_as_a_run_ends(prefect_api):
    """``lowerflow worker``'s Prefect worker asks the server for runs only when it has a free
    slot, and at once when one frees (not at its next poll)."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.warm_worker import warm_worker_class

    warnings.filterwarnings("ignore", message=".*WarmProcessWorker.*matches existing registered type")
    pool = f"warm-poll-{os.getpid()}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))

    async def main():
        async with warm_worker_class()(work_pool_name=pool, limit=1) as worker:
            await worker.sync_with_backend()
            asked = []
            real = worker._get_scheduled_flow_runs

            async def counted(*args, **kwargs):
                asked.append(1)
                return await real(*args, **kwargs)

            worker._get_scheduled_flow_runs = counted
            await worker.get_and_submit_flow_runs()
            assert len(asked) == 1  # a free slot: it asks
            worker._limiter.acquire_on_behalf_of_nowait("a run")
            assert await worker.get_and_submit_flow_runs() == [] and len(asked) == 1  # full: it does not
            worker._limiter.release_on_behalf_of("a run")
            worker._poll_soon()  # what run() does when the run's process has ended
            with anyio.fail_after(30):
                while len(asked) < 2:
                    await anyio.sleep(0.05)

    try:
        anyio.run(main)
    finally:  # the class registered itself as Prefect's "process" worker type: put Prefect's back
        from prefect.utilities.dispatch import register_type
        from prefect.workers.process import ProcessWorker

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            register_type(ProcessWorker)


def test_a_child_ends_without_unregistering_torch_libraries_one_by_one():
    """At a warm child's exit, torch.library's unregistering finalizers are skipped (0.1 s
    a run); every other finalizer still runs at exit."""
    import weakref

    import torch

    from flows.warm_start import _keep_torch_libraries

    class Anything:
        pass

    library, anything = torch.library.Library(f"lowerflow_exit_{os.getpid()}", "DEF"), Anything()
    other = weakref.finalize(anything, print, "an exit function of someone else")
    try:
        ours = [f for f, info in weakref.finalize._registry.items() if len(info.args) > 2 and info.args[-2] is library.m]
        assert len(ours) == 1 and ours[0].atexit
        _keep_torch_libraries()
        assert not ours[0].atexit and other.atexit
    finally:
        other.detach()


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


def _source_watch_case(tmp_path: Path):
    from flows.source_watch import SourceWatch

    (tmp_path / "pkg").mkdir(exist_ok=True)
    module = tmp_path / "pkg" / "module.py"
    module.write_text("A = 1\n")
    watch = SourceWatch([str(module), str(tmp_path / "pkg" / "later.py"), str(tmp_path / "site")])
    return watch, module


@pytest.mark.parametrize("change", ["write", "touch", "replace", "delete", "create_missing", "new_entry_in_dir"])
def test_the_source_watch_sees_every_kind_of_change_without_stat_ing_each_time(tmp_path, change):
    """The warm parent's staleness check: an inotify watch per directory (no stat of every
    file before every fork), and any change to a watched file or directory is seen."""
    (tmp_path / "site").mkdir()
    watch, module = _source_watch_case(tmp_path)
    assert watch.fd is not None, "inotify is there on this machine"
    assert sorted(watch.polled) == [str(tmp_path / "pkg" / "later.py")]  # missing: stat-ed each time
    assert watch.changed() is False
    (tmp_path / "pkg" / "unrelated.txt").write_text("x")  # an event, but no watched file changed
    assert watch.changed() is False and watch.fd is not None
    if change == "write":
        with module.open("a") as f:
            f.write("B = 2\n")
    elif change == "touch":
        os.utime(module, ns=(1, 1))
    elif change == "replace":
        other = tmp_path / "pkg" / "module.py.new"
        other.write_text("A = 3\n")
        os.utime(other, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns))  # same size, same mtime
        os.replace(other, module)
        assert watch.changed() is False  # (size, mtime) as before: nothing to reload for
        module.write_text("A = 33\n")
    elif change == "delete":
        module.unlink()
    elif change == "create_missing":
        (tmp_path / "pkg" / "later.py").write_text("")
    else:  # a distribution installed: the site-packages directory's own stamp changes
        time.sleep(0.01)
        (tmp_path / "site" / "new-1.0.dist-info").mkdir()
    assert watch.changed() is True
    assert watch.changed() is True  # and stays so until the parent reloads


def test_the_source_watch_stats_what_inotify_cannot_watch(tmp_path):
    from flows.source_watch import SourceWatch

    target = tmp_path / "elsewhere.py"
    target.write_text("A = 1\n")
    link = tmp_path / "link.py"
    link.symlink_to(target)
    watch = SourceWatch([str(link)])
    assert list(watch.polled) == [str(link)]
    target.write_text("A = 22\n")
    assert watch.changed() is True

    class Remote(SourceWatch):  # as if every file system were NFS
        LOCAL_FILE_SYSTEMS = frozenset()

    remote = Remote([str(target)])
    assert list(remote.polled) == [str(target)]
    assert remote.changed() is False
    target.write_text("A = 333\n")
    assert remote.changed() is True


def test_the_source_watch_stats_everything_once_a_watched_directory_goes(tmp_path):
    import shutil

    (tmp_path / "site").mkdir()
    watch, module = _source_watch_case(tmp_path)
    shutil.rmtree(tmp_path / "site")
    assert watch.changed() is True and watch.fd is None
