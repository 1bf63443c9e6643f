"""Stage locks chosen by a lock URL (issue 9): ``file`` / ``file:///dir`` / ``redis://``.

* unit level: URLs → lock managers, clear errors, precedence (explicit > ``$LOWERFLOW_LOCKS``
  > ``file``), manifests, and cache keys that never depend on where locks live;
* two "machines" (processes with their own HOME and lock directories) lowering one fleet
  concurrently on one S3 store (moto) with ``LOWERFLOW_LOCKS=redis://...``: every stage
  is computed once in total; the control with separate file locks computes one twice;
* a SIGKILLed holder of a Redis stage lock: its lock expires within its lease, and a run
  of the same stage waiting for it then finishes.

A real ``redis-server`` (Debian package) runs on 127.0.0.1 for the module, with no
persistence, and is killed in a ``finally``.  Subprocesses are stopped by :func:`spawned`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from flows.manifest import ManifestError, load_manifest
from tasks.cache import CacheConfig
from tasks.locks import (
    LOCKS_ENV,
    FileLockManager,
    LeasedRedisLockManager,
    LockConfigError,
    lock_manager_for,
    parse_lock_url,
    resolve_lock_url,
)
from tests.conftest import S3_KEY, S3_SECRET
from tests.test_faults_processes import (  # noqa: F401 - clean_run is a fixture used here
    FLEET_SCRIPT,
    MODELS,
    assert_outputs_clean,
    clean_run,
    finish,
    fleet_manifest,
    output_of,
    run_fleet_result,
    spawned,
    subprocess_env,
    wait_for_file,
)


# --------------------------------------------------------------------------- a real Redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """``redis-server`` on 127.0.0.1 (a free port, no persistence, files in ``directory``);
    yields ``redis://127.0.0.1:<port>/0``; killed on the way out."""
    import redis

    port = _free_port()
    log = open(directory / "redis.log", "w")
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        cwd=directory, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (directory / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server did not start in 30 s"
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_client(redis_url):
    """A client of the test server; every lock key is gone at the start of a test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter("lock:*"):
        client.delete(key)
    yield client
    client.close()


@pytest.fixture
def no_locks_env(monkeypatch):
    monkeypatch.delenv(LOCKS_ENV, raising=False)


# --------------------------------------------------------------------------- unit level


def test_lock_urls_choose_the_lock_manager(tmp_path, redis_url, no_locks_env):
    default = lock_manager_for("file", default_dir=tmp_path / "d")
    assert type(default) is FileLockManager and default.lock_files_directory == tmp_path / "d"
    assert lock_manager_for(None, default_dir=tmp_path / "d") is default  # the default URL, once per process
    explicit = lock_manager_for(f"file://{tmp_path}/e")
    assert type(explicit) is FileLockManager and explicit.lock_files_directory == tmp_path / "e"
    assert lock_manager_for(f"file://{tmp_path}/e", default_dir=tmp_path / "d") is explicit  # the URL's dir wins

    manager = lock_manager_for(redis_url)
    assert isinstance(manager, LeasedRedisLockManager) and manager.lease == 30.0
    assert lock_manager_for(redis_url) is manager  # one connection pool per URL and process
    assert lock_manager_for(f"{redis_url}?lease=5").lease == 5.0
    assert manager.acquire_lock("unit-key", "me", acquire_timeout=1)
    assert manager.is_locked("unit-key") and manager.is_lock_holder("unit-key", "me")
    assert not manager.acquire_lock("unit-key", "other", acquire_timeout=0.3)
    manager.release_lock("unit-key", "me")
    assert not manager.is_locked("unit-key")

    # rediss:// is TLS (no connection is made until a lock is taken)
    from redis.connection import SSLConnection

    tls = lock_manager_for("rediss://user:secret@127.0.0.1:6380/1")
    assert tls.client.connection_pool.connection_class is SSLConnection
    assert "secret" not in repr(tls)
    assert parse_lock_url("redis://h:1/2?lease=0.5&socket_timeout=3").lease == 0.5


def test_cache_config_uses_the_lock_url(tmp_path, redis_url, no_locks_env):
    store = tmp_path / "store"
    local = CacheConfig.for_store(str(store))
    assert type(local.locks()) is FileLockManager
    assert local.locks().lock_files_directory == store / "prefect" / "locks"  # as before
    policy = CacheConfig.for_store(str(store), locks=redis_url).policy("emit", "1")
    assert isinstance(policy.lock_manager, LeasedRedisLockManager) and policy.isolation_level == "SERIALIZABLE"
    shared = CacheConfig.for_store(str(store), locks=f"file://{tmp_path}/shared")
    assert shared.locks().lock_files_directory == tmp_path / "shared"
    # An explicit lock manager object still wins over every URL.
    mine = FileLockManager(tmp_path / "mine")
    assert CacheConfig(store_url=str(store), lock_manager=mine, lock_url=redis_url).locks() is mine


@pytest.mark.parametrize("value, cause", [
    ("", ""),
    ("redis", "no scheme"),
    ("./locks", "no scheme"),
    ("http://127.0.0.1:6379", "unknown scheme http://"),
    ("file://relative/dir", "file:///"),
    ("file:///", "absolute directory"),
    ("redis://", "no host"),
    ("redis://127.0.0.1:99999/0", "Port out of range"),
    ("redis://127.0.0.1:6379/zero", "database 'zero' is not a number"),
    ("redis://127.0.0.1:6379/0?lease=0", "lease '0' is not a positive number"),
    ("redis://127.0.0.1:6379/0?lease=soon", "lease 'soon' is not a positive number"),
    ("redis://127.0.0.1:6379/0?leese=5", "unknown option 'leese'"),
    ("redis://127.0.0.1:6379/0?socket_timeout=x", "socket_timeout"),
    ("redis://user:hunter2@127.0.0.1:6379/x", "database 'x'"),
])
def test_bad_lock_urls_are_one_clear_line(value, cause):
    with pytest.raises(LockConfigError) as info:
        parse_lock_url(value)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert cause in message
    assert "accepted: 'file', 'file:///absolute/dir', 'redis://[user:password@]host[:port][/db]" in message
    assert "rediss://" in message
    assert "hunter2" not in message  # passwords never appear
    if "hunter2" in value:
        assert "redis://user:***@127.0.0.1:6379/x" in message
    else:
        assert repr(value) in message


def test_bad_lock_url_fails_before_any_work(tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.delenv(LOCKS_ENV, raising=False)
    with pytest.raises(LockConfigError, match="lock URL 'redis:/oops'"):
        CacheConfig.for_store(str(store), locks="redis:/oops")
    monkeypatch.setenv(LOCKS_ENV, "memcached://127.0.0.1")
    with pytest.raises(LockConfigError, match=f"{LOCKS_ENV} 'memcached://127.0.0.1' is not a lock URL"):
        CacheConfig.for_store(str(store))
    # a remote store would save a results block (Prefect API) next: it never got there
    with pytest.raises(LockConfigError, match=LOCKS_ENV):
        CacheConfig.for_store("s3://no-such-bucket/x")
    assert not store.exists()


def test_lock_url_precedence(tmp_path, monkeypatch, redis_url):
    monkeypatch.delenv(LOCKS_ENV, raising=False)
    assert resolve_lock_url() == ("file", "default lock URL")
    monkeypatch.setenv(LOCKS_ENV, "   ")
    assert resolve_lock_url()[0] == "file"
    monkeypatch.setenv(LOCKS_ENV, redis_url)
    assert resolve_lock_url() == (redis_url, LOCKS_ENV)
    assert resolve_lock_url("file") == ("file", "lock URL")
    store = str(tmp_path / "store")
    assert isinstance(CacheConfig.for_store(store).locks(), LeasedRedisLockManager)  # the environment
    assert type(CacheConfig.for_store(store, locks="file").locks()) is FileLockManager  # explicit wins
    assert type(CacheConfig(store_url=store, lock_url="file").locks()) is FileLockManager
    monkeypatch.setenv(LOCKS_ENV, f"file://{tmp_path}/from-env")
    assert CacheConfig.for_store(store).locks().lock_files_directory == tmp_path / "from-env"


def test_cache_keys_do_not_depend_on_the_lock_url(tmp_path, redis_url, monkeypatch):
    from tasks.store import ArtifactRef

    monkeypatch.delenv(LOCKS_ENV, raising=False)
    ref = ArtifactRef("file:///a/objects/ab/cd", "ab" * 32, 3, "program")
    inputs = {"program": ref, "target": "reference", "options": {"max": 3}}
    store = str(tmp_path / "store")
    policies = [
        CacheConfig.for_store(store).policy("partition", "1"),
        CacheConfig.for_store(store, locks=f"file://{tmp_path}/other").policy("partition", "1"),
        CacheConfig.for_store(store, locks=redis_url).policy("partition", "1"),
        CacheConfig.for_store(store, locks=f"{redis_url}?lease=7").policy("partition", "1"),
    ]
    monkeypatch.setenv(LOCKS_ENV, redis_url)
    policies.append(CacheConfig.for_store(store).policy("partition", "1"))
    assert len({type(p.lock_manager) for p in policies}) == 2
    documents = [p.key_document(inputs) for p in policies]
    assert all(d == documents[0] for d in documents)
    assert set(documents[0]) <= {"key_format", "stage", "stage_version", "inputs", "torch", "lowerflow",
                                 "lowerflow_source", "backend_distributions"}
    assert "lock" not in json.dumps(documents[0])
    assert len({p.key_for(inputs) for p in policies}) == 1


def test_manifest_locks(tmp_path, redis_url):
    base = {"models": [{"name": "mlp", "model": f"{MODELS}:mlp"}]}
    assert load_manifest(base).locks is None
    assert load_manifest({**base, "locks": redis_url}).locks == redis_url
    assert load_manifest({**base, "locks": "file"}).locks == "file"
    path = tmp_path / "fleet.yaml"
    path.write_text(f"locks: redis://127.0.0.1:6379/db0\nmodels:\n  - {MODELS}:mlp\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert message.startswith(f"manifest {str(path)!r}: locks 'redis://127.0.0.1:6379/db0' is not a lock URL")
    assert "database 'db0' is not a number" in message and "accepted: 'file'" in message
    with pytest.raises(ManifestError, match="manifest: locks 5 is not a lock URL"):
        load_manifest({**base, "locks": 5})


def test_prefect_redis_alone_would_keep_a_dead_holders_lock(redis_client, redis_url):
    """Why the lease: Prefect's transactions pass no hold timeout, and prefect-redis's
    manager then sets a key with no expiry (TTL -1); ours expires within the lease."""
    from prefect_redis.locking import RedisLockManager

    plain = RedisLockManager(connection_url=redis_url)
    assert plain.acquire_lock("plain-key", "holder")  # what ResultStore.acquire_lock calls
    assert redis_client.pttl("lock:plain-key") == -1
    plain.release_lock("plain-key", "holder")

    leased = lock_manager_for(f"{redis_url}?lease=3")
    assert leased.acquire_lock("leased-key", "holder")
    assert 0 < redis_client.pttl("lock:leased-key") <= 3000
    # a waiter only watches: a killed waiter leaves nothing behind
    assert not leased.wait_for_lock("leased-key", timeout=0.2)
    leased.release_lock("leased-key", "holder")
    assert leased.wait_for_lock("leased-key", timeout=0.2)
    assert not list(redis_client.scan_iter("lock:*"))


# --------------------------------------------------------------------------- a SIGKILLed holder

#: The lease of the SIGKILL test: short, so the test is (a dead holder's lock lasts this long).
SHORT_LEASE = 1.5

#: ``python -c HOLDER_SCRIPT STORE LOCK_URL MARKER``: runs the ``locks_probe`` stage, whose
#: body writes MARKER (its pid) and sleeps, inside the stage's transaction (lock held), until killed.
HOLDER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from prefect import flow
    from tasks.cache import CacheConfig, stage_task

    store, locks, marker = sys.argv[1:4]

    @stage_task("locks_probe", "1", config=CacheConfig(store_url=store, lock_url=locks))
    def probe(text: str) -> dict:
        Path(marker).write_text(str(os.getpid()))
        time.sleep(3600)

    @flow
    def hold():
        probe("one key")

    hold()
    """
)


def test_sigkilled_holder_lock_expires_within_its_lease(tmp_path, prefect_api, redis_url, redis_client):
    from prefect import flow

    from tasks.cache import stage_task

    store, marker = tmp_path / "store", tmp_path / "holding"
    locks = f"{redis_url}?lease={SHORT_LEASE}"
    config = CacheConfig(store_url=str(store), lock_url=locks)
    lock_key = "lock:" + config.policy("locks_probe", "1").key_for({"text": "one key"})
    started: list[float] = []

    @stage_task("locks_probe", "1", config=config)
    def probe(text: str) -> dict:
        started.append(time.monotonic())
        return {"text": text.upper()}

    @flow
    def again():
        return probe("one key")

    command = [sys.executable, "-c", HOLDER_SCRIPT, str(store), locks, str(marker)]
    with spawned(command, subprocess_env(prefect_api)) as holder:
        assert wait_for_file(marker, holder, "the stage body") == str(holder.pid)
        token = redis_client.get(lock_key)
        assert token is not None, list(redis_client.scan_iter("lock:*"))
        # Alive, the holder keeps its lock past its lease (the heartbeat renews it).
        time.sleep(SHORT_LEASE + 0.5)
        assert redis_client.get(lock_key) == token and 0 < redis_client.pttl(lock_key) <= SHORT_LEASE * 1000
        ttl = redis_client.pttl(lock_key) / 1000
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    assert redis_client.get(lock_key) == token  # the dead holder's lock is still there ...
    assert again() == {"text": "ONE KEY"}  # ... and the same stage, run again, waits it out
    waited = started[0] - killed
    print(f"lock expired {waited:.2f} s after the kill (TTL then {ttl:.2f} s, lease {SHORT_LEASE} s)")
    assert len(started) == 1
    assert ttl - 0.3 <= waited <= SHORT_LEASE + 2.0, (waited, ttl)
    assert redis_client.get(lock_key) is None


# --------------------------------------------------------------------------- two machines


def s3_environment(s3_endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL_S3": s3_endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}


def machine_env(tmp_path: Path, name: str, prefect_api: str, s3_endpoint: str, locks: str) -> dict[str, str]:
    """A "machine": its own HOME (so its default ``file`` lock directory,
    ``~/.cache/lowerflow/locks``, is its own) and the given lock URL."""
    home = tmp_path / name
    home.mkdir()
    return subprocess_env(prefect_api, HOME=str(home), **{LOCKS_ENV: locks}, **s3_environment(s3_endpoint))


def s3_outputs(s3_options: dict, url: str) -> dict[str, bytes]:
    """Every file under ``<url>/outputs`` by relative path."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    prefix = f"{url.removeprefix('s3://')}/outputs/"
    return {p[len(prefix):]: fs.cat_file(p) for p in fs.find(prefix)}


def s3_records(s3_options: dict, url: str) -> collections.Counter:
    """How many stage result records each stage has under ``<url>/prefect/results``."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    records = fs.find(f"{url.removeprefix('s3://')}/prefect/results")
    return collections.Counter(Path(p).name.rsplit("-", 1)[0] for p in records)


def unverified_fleet(url: str, **changes) -> dict:
    """The fleet of tests/test_faults_processes.py (or ``changes`` to it) in store ``url``,
    without the verify stage (it compares with eager: nothing to do with locks, and it
    costs each process an ExecuTorch import)."""
    manifest = fleet_manifest(url) | changes
    manifest["defaults"] = {**manifest["defaults"], "verify": False}
    return manifest


#: Run before FLEET_SCRIPT (the same ``python -c``): import everything, write ``$READY``,
#: and start when ``$GO`` exists, so the two machines start lowering within milliseconds
#: of each other (without a shared lock they then compute most stages both: measured).
TOGETHER = textwrap.dedent(
    """
    import os as _os, time as _time
    import flows.lower_fleet

    open(_os.environ["READY"], "w").write(str(_os.getpid()))
    while not _os.path.exists(_os.environ["GO"]):
        _time.sleep(0.01)
    """
)


def test_two_machines_one_s3_store_redis_locks_compute_each_stage_once(
    tmp_path, prefect_api, s3_endpoint, s3_options, redis_url, redis_client, clean_run
):
    url = f"s3://lowerflow/{uuid.uuid4().hex}"
    command = [sys.executable, "-c", TOGETHER + FLEET_SCRIPT, json.dumps(unverified_fleet(url))]
    go = tmp_path / "go"
    envs = {name: machine_env(tmp_path, name, prefect_api, s3_endpoint, redis_url)
            | {"READY": str(tmp_path / f"ready-{name}"), "GO": str(go)} for name in ("a", "b")}
    totals: collections.Counter = collections.Counter()
    spans = []
    with spawned(command, envs["a"]) as a, spawned(command, envs["b"]) as b:
        for name, proc in (("a", a), ("b", b)):
            wait_for_file(Path(envs[name]["READY"]), proc, "its imports")
        go.write_text("")
        for proc in (a, b):
            out, err, _ = finish(proc)
            assert proc.returncode == 0, err[-3000:]
            result = run_fleet_result(out)
            assert result["ok"] and result["failed"] == [], result
            totals.update(result["executions"])
            spans.append((result["started"], result["finished"]))
    (start_a, end_a), (start_b, end_b) = spans
    assert start_a < end_b and start_b < end_a, f"the two machines did not run at the same time: {spans}"
    # Each stage once over both machines: as many as a clean run, one per cache record.
    assert dict(totals) == {stage: n for stage, n in clean_run["executions"].items() if stage != "verify"}
    assert s3_records(s3_options, url) == totals
    files = s3_outputs(s3_options, url)
    assert_outputs_clean(files, clean_run["pte"])
    assert {k for k in files if k.endswith(".pte")} == set(clean_run["pte"])
    assert not list(redis_client.scan_iter("lock:*"))  # every lock released
    for name in ("a", "b"):  # and no file lock was ever taken
        assert not list((tmp_path / name).rglob("*.lock"))


def test_control_two_machines_with_their_own_file_locks_compute_a_stage_twice(
    tmp_path, prefect_api, s3_endpoint, s3_options, monkeypatch, fresh_stages
):
    """The same setup with ``file`` locks, each machine its own directory: while machine
    a (a process) is inside buffer_mutation's emit stage, its file lock held, machine b
    (this process) computes that same stage and finishes: nothing made it wait."""
    from flows.lower_fleet import lower_fleet

    url = f"s3://lowerflow/{uuid.uuid4().hex}"
    manifest = unverified_fleet(url, models=[{"name": "buffer_mutation", "model": f"{MODELS}:buffer_mutation"}])
    manifest["defaults"]["targets"] = ["portable"]
    marker = tmp_path / "blocked"
    block = {"block": {"model": "buffer_mutation", "marker": str(marker), "others": []}}
    command = [sys.executable, "-c", FLEET_SCRIPT, json.dumps(manifest), json.dumps(block)]
    with spawned(command, machine_env(tmp_path, "a", prefect_api, s3_endpoint, "file")) as a:
        assert wait_for_file(marker, a, "buffer_mutation's emit stage") == str(a.pid)
        for name, value in {**s3_environment(s3_endpoint), LOCKS_ENV: f"file://{tmp_path}/b-locks"}.items():
            monkeypatch.setenv(name, value)
        before = fresh_stages.EXECUTIONS.copy()
        summary = lower_fleet(manifest)
        executions = fresh_stages.EXECUTIONS - before
        assert a.poll() is None, output_of(a)[1][-3000:]  # a is still inside the stage ...
        assert list((tmp_path / "a").rglob("emit-*.lock"))  # ... with its own lock held
    assert summary["ok"], summary["failed"]
    # export and memory_plan were a's (cached); emit, which a was computing, ran here too
    assert dict(executions) == {"emit": 1}
