"""Prefect caching for lowering stages: content keys, JSON results, locks.

A stage is a Prefect task made with :func:`stage_task`::

    @stage_task("partition", version="3")
    def partition(program: ArtifactRef, backend: str, options: dict) -> ArtifactRef:
        ...

Its cache key (:meth:`StageCachePolicy.key_for`) is the sha256 of canonical JSON of

* the stage name and stage version (bump the version when the stage's code changes),
* every task parameter, with each :class:`~tasks.store.ArtifactRef` replaced by its
  sha256 (content, not location) and everything else as canonical JSON,
* the torch and lowerflow versions, a digest of lowerflow's own source, and the
  versions of distributions that register backends (:func:`environment_versions`).

It is never keyed on torch objects (a parameter that is not JSON or an ArtifactRef
is an error unless listed in ``ignore``), on run ids or on source code, so the
same inputs give the same key in every process and flow run.

Results are persisted with a JSON serializer that only knows ArtifactRefs and
plain JSON (no pickle).  On a cache hit, the ArtifactRefs of the cached result are
checked in the artifact store first; if one is missing or corrupt the stale
record is deleted with a warning and the stage recomputes.

Concurrent runs of the same stage on the same inputs compute once: the policy
uses SERIALIZABLE isolation with a lock manager, chosen by a *lock URL*
(:func:`lock_manager_for`; an explicit value, else ``$LOWERFLOW_LOCKS``, else ``file``):

* ``file`` (default): :class:`FileLockManager`, a hardened Prefect
  ``FileSystemLockManager`` that serializes the processes of one machine, in
  ``<root>/prefect/locks`` for a local store, ``~/.cache/lowerflow/locks`` for a remote one;
* ``file:///some/dir``: the same, in that directory (a shared filesystem only if it
  has atomic hard links, e.g. not S3 mounts);
* ``redis://[user:password@]host[:port][/db][?lease=SECONDS]`` (``rediss://`` for TLS;
  redis-py's connection options such as ``socket_timeout`` or ``ssl_ca_certs`` may
  follow in the query): :class:`LeasedRedisLockManager`, prefect-redis's
  ``RedisLockManager`` with leases, which serializes the processes of every machine
  using that Redis database.

A dead holder's Redis lock expires within its *lease* (default
:data:`DEFAULT_LOCK_LEASE` = 30 s).  Prefect's transactions never pass a hold timeout
(``ResultStore.acquire_lock(key, holder, timeout)`` passes only ``acquire_timeout``, and
waits without limit), and prefect-redis then sets a key that never expires: a
SIGKILLed holder would block every later run of that stage for good.  Here the key
expires ``lease`` seconds after it was last renewed, and a heartbeat thread of the
holder process renews it every ``lease / 3`` while the stage runs, so a stage may run
for hours.  The trade-off of the lease length: a waiter on a dead holder's lock waits
up to ``lease`` (+0.1 s of polling); a holder that cannot renew for ``lease`` seconds
(Redis unreachable, process stopped) loses the lock, and another run may compute the
same stage meanwhile: duplicate work, never a wrong output (artifacts are written by
content atomically, and both runs write the same result record).  Waiting for a lock
never takes it (prefect-redis's wait briefly sets a key without expiry).

Lock managers are built once per process and URL (they hold connections), and are
never part of a cache key: where a lock lives does not change what a stage computes.

Local layout next to the store (``<root>`` a local directory)::

    <root>/prefect/results/<stage>-<sha256>   Prefect result records (JSON)
    <root>/prefect/locks/<stage>-<sha256>.lock
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional

import torch
from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.locking.protocol import LockManager
from prefect.serializers import JSONSerializer
from prefect_redis.locking import RedisLockManager

from .store import ArtifactCorrupt, ArtifactMissing, ArtifactRef, ArtifactStore

logger = logging.getLogger("lowerflow.cache")

#: Bumped when the key document changes shape (invalidates every cached stage).
KEY_FORMAT = 1
#: Marker of an ArtifactRef inside a persisted JSON result.
_REF_TAG = "__lowerflow_artifact__"

Verify = Literal["digest", "exists", "none"]


class CacheKeyError(TypeError):
    """A stage parameter cannot be part of a cache key (names the parameter)."""


# --------------------------------------------------------------------------- keys


@lru_cache(maxsize=1)
def environment_versions() -> dict[str, str]:
    """What every key includes besides the stage's own inputs: the code that computes it.

    * torch's and lowerflow's versions;
    * ``lowerflow_source``: a digest of lowerflow's own compiler and stage code (every
      ``.py`` and ``.fbs`` file of ``lowering/`` and ``tasks/``), so an edited pass
      never serves a program cached by the code before it, version bump or not;
    * the distributions that register backends (``lowerflow.backends`` entry points),
      ``name==version``: an upgraded third-party backend re-lowers what it delegates.
    """
    try:
        lowerflow = importlib.metadata.version("lowerflow")
    except importlib.metadata.PackageNotFoundError:
        lowerflow = "unknown"
    backends = sorted({
        f"{ep.dist.name}=={ep.dist.version}"
        for ep in importlib.metadata.entry_points(group="lowerflow.backends")
        if ep.dist is not None and ep.dist.name != "lowerflow"
    })
    return {
        "torch": torch.__version__,
        "lowerflow": lowerflow,
        "lowerflow_source": source_digest(),
        **({"backend_distributions": ",".join(backends)} if backends else {}),
    }


def source_digest() -> str:
    """sha256 over the relative paths and bytes of lowerflow's ``lowering`` and ``tasks`` sources."""
    digest = hashlib.sha256()
    for package, path in source_files():
        digest.update(f"{package.name}/{path.relative_to(package).as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def source_files() -> list[tuple[Path, Path]]:
    """(package directory, file) of every source :func:`source_digest` reads, in order."""
    import lowering

    return [
        (package, path)
        for package in (Path(lowering.__file__).parent, Path(__file__).parent)
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".fbs") and p.is_file())
    ]


def key_json(value: Any, where: str = "value") -> Any:
    """``value`` as canonical-JSON-ready data; ArtifactRefs become their digest.

    Accepts None, bool, int, finite float, str, ArtifactRef, Enum, dataclasses,
    and lists/tuples/dicts (str keys) of those.  Anything else (tensors, modules,
    programs) raises :class:`CacheKeyError` naming ``where``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CacheKeyError(f"{where}: non-finite float {value!r} cannot be a cache key")
        return value
    if isinstance(value, ArtifactRef):
        return {"artifact": value.sha256}
    if isinstance(value, enum.Enum):
        return key_json(value.value, where)
    if isinstance(value, (list, tuple)):
        return [key_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CacheKeyError(f"{where}: dict key {k!r} is not a string")
            out[k] = key_json(v, f"{where}[{k!r}]")
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__qualname__, "fields": key_json(fields, where)}
    raise CacheKeyError(
        f"{where}: cannot key a cache on a {type(value).__module__}.{type(value).__qualname__}; "
        "pass an ArtifactRef (content digest) or JSON data, or list the parameter in ignore="
    )


def _canonical(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces, ASCII): what keys are hashed from."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text) or "stage"


# --------------------------------------------------------------------------- policy


@dataclass
class StageCachePolicy(CachePolicy):
    """Cache key = stage, version, input digests, JSON parameters, torch/lowerflow versions.

    ``ignore`` names task parameters left out of the key (e.g. a live object passed
    alongside the ArtifactRef it was loaded from).  ``verify`` is how cached
    ArtifactRefs are checked before a hit is used: ``"digest"`` (read and hash,
    including every blob of program manifests), ``"exists"`` (objects present)
    or ``"none"``.  ``store_url``/``storage_options`` name the artifact store.
    """

    stage: str = ""
    version: str = "1"
    ignore: tuple[str, ...] = ()
    verify: Verify = "digest"
    store_url: Optional[str] = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def key_document(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """What the key hashes: stage, version, parameters (refs as digests), versions."""
        if not self.stage:
            raise ValueError("StageCachePolicy needs a stage name")
        params = {k: v for k, v in inputs.items() if k not in self.ignore}
        return {
            "key_format": KEY_FORMAT,
            "stage": self.stage,
            "stage_version": str(self.version),
            "inputs": {k: key_json(v, f"stage {self.stage!r} parameter {k!r}") for k, v in params.items()},
            **environment_versions(),
        }

    def key_for(self, inputs: Mapping[str, Any]) -> str:
        """The cache key for these task parameters: ``<stage>-<sha256 hex>``."""
        digest = hashlib.sha256(_canonical(self.key_document(inputs))).hexdigest()
        return f"{_slug(self.stage)}-{digest}"

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> Optional[str]:
        """Prefect hook: the key, after dropping a cached record whose artifacts are gone."""
        key = self.key_for(inputs)
        result_store = getattr(task_ctx, "result_store", None)
        if result_store is not None and self.verify != "none":
            self._drop_unusable_record(result_store, key)
        return key

    def store(self) -> ArtifactStore:
        """The artifact store the stage's ArtifactRefs live in."""
        return ArtifactStore(self.store_url, **self.storage_options)

    def check_refs(self, result: Any) -> None:
        """Raise ArtifactMissing/ArtifactCorrupt unless every ref in ``result`` is usable."""
        store = self.store()
        for ref in iter_refs(result):
            if self.verify == "digest":
                store.verify(ref, deep=True)
            elif not store.exists(ref):
                raise ArtifactMissing(f"{ref.kind} artifact {ref.sha256} is missing from store {store.url}")

    def _drop_unusable_record(self, result_store: Any, key: str) -> None:
        if not result_store.exists(key):
            return
        try:
            record = result_store.read(key)
        except Exception as exc:  # unreadable record: it would never be replaced otherwise
            problem = f"unreadable record: {type(exc).__name__}: {exc}"
        else:
            try:
                self.check_refs(record.result)
                return
            except (ArtifactMissing, ArtifactCorrupt) as exc:
                problem = str(exc)
        _warn(f"stage {self.stage!r}: cached result {key} is unusable ({problem}); recomputing")
        delete_record(result_store, key)


def iter_refs(value: Any) -> Iterator[ArtifactRef]:
    """Every ArtifactRef in a task result (nested in lists, tuples and dicts)."""
    if isinstance(value, ArtifactRef):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from iter_refs(v)


def delete_record(result_store: Any, key: str) -> None:
    """Remove the persisted result record ``key`` (and its in-memory copy) from a ResultStore."""
    storage = result_store.result_storage
    path = storage._resolve_path(key)
    result_store.cache.pop(str(path), None)
    fs = getattr(storage, "filesystem", None)
    if fs is not None:  # RemoteFileSystem block: any fsspec URL
        fs.rm(str(path))
    else:  # LocalFileSystem block
        Path(path).unlink(missing_ok=True)


def _warn(message: str) -> None:
    logger.warning(message)
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # no run context
        pass


# --------------------------------------------------------------------------- JSON results


def encode_json_object(obj: Any) -> Any:
    """``json.dumps(default=...)`` hook of the result serializer: ArtifactRefs only."""
    if isinstance(obj, ArtifactRef):
        return {_REF_TAG: obj.to_json()}
    raise TypeError(
        f"a stage result contains a {type(obj).__qualname__}; stages return ArtifactRefs "
        "and JSON data (store bytes in the ArtifactStore, not in the result)"
    )


def decode_json_object(obj: dict[str, Any]) -> Any:
    """``json.loads(object_hook=...)`` hook: rebuilds ArtifactRefs, imports nothing."""
    if len(obj) == 1 and _REF_TAG in obj:
        return ArtifactRef.from_json(obj[_REF_TAG])
    return obj


def result_serializer() -> JSONSerializer:
    """Prefect serializer for stage results: JSON with ArtifactRefs, never pickle."""
    return JSONSerializer(
        object_encoder=f"{__name__}.encode_json_object",
        object_decoder=f"{__name__}.decode_json_object",
        dumps_kwargs={"sort_keys": True},
    )


# --------------------------------------------------------------------------- locks


class _BlockingAcquire:
    """``aacquire_lock`` as the blocking ``acquire_lock`` on a worker thread: the lock
    managers below wait by polling, which must not block the event loop."""

    async def aacquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: Optional[float] = None,
        hold_timeout: Optional[float] = None,
    ) -> bool:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)


class FileLockManager(_BlockingAcquire, FileSystemLockManager):
    """Prefect's FileSystemLockManager, made safe for processes that crash or race.

    * A lock file appears complete (written to a temporary name, then hard-linked
      into place), never empty: Prefect's version creates an empty file and then
      writes it, and a concurrent reader of the empty file fails.
    * It records the holder's host and pid; a lock whose process on this host is
      gone is stale and removed, so a killed worker does not block a stage forever.
    """

    def acquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: Optional[float] = None,
        hold_timeout: Optional[float] = None,
    ) -> bool:
        self._ensure_lock_files_directory_exists()
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            if self.is_locked(key) and not self.is_lock_holder(key, holder):
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not self.wait_for_lock(key, remaining):
                    return False
            if self._create_lock_file(key, holder, hold_timeout) or self.is_lock_holder(key, holder):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        try:
            info = self._get_lock_info(key, use_cache=use_cache)
        except ValueError:  # a lock file written by another manager, mid-write
            return True
        if info is not None and _holder_process_gone(info):
            logger.warning("removing stale lock %s of dead process %s", info["path"], info.get("pid"))
            Path(info["path"]).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return super().is_locked(key, use_cache=use_cache)

    def _create_lock_file(self, key: str, holder: str, hold_timeout: Optional[float]) -> bool:
        """Atomically create the lock file with its content; False if it exists."""
        lock_path = self._lock_path_for_key(key)
        expiration = None
        if hold_timeout is not None:
            expiration = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=hold_timeout)
        content = {
            "holder": holder,
            "expiration": str(expiration) if expiration is not None else None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        tmp = lock_path.with_name(f"{lock_path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(json.dumps(content).encode())
        try:
            os.link(tmp, lock_path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._locks[key] = {"holder": holder, "expiration": expiration, "path": lock_path}
        return True


def _holder_process_gone(info: Mapping[str, Any]) -> bool:
    """Whether the lock's holder process was on this host and no longer runs."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# --------------------------------------------------------------------------- lock URLs

#: The environment variable that chooses the stage lock manager (a lock URL).
LOCKS_ENV = "LOWERFLOW_LOCKS"
#: Seconds a Redis stage lock outlives its holder process (see the module docstring).
DEFAULT_LOCK_LEASE = 30.0
#: Where ``file`` locks live for a remote store.
DEFAULT_LOCK_DIR = Path("~/.cache/lowerflow/locks")
#: The accepted forms, as every lock URL error states them.
LOCK_URL_FORMS = (
    "'file', 'file:///absolute/dir', 'redis://[user:password@]host[:port][/db][?lease=SECONDS]' "
    "or 'rediss://...' (TLS)"
)
#: Seconds to wait for a TCP connection to Redis unless the URL says otherwise.
_REDIS_CONNECT_TIMEOUT = 10.0


class LockConfigError(ValueError):
    """A lock URL that is none of the accepted forms; names the value (password hidden)."""


@dataclass(frozen=True)
class LockSpec:
    """A parsed lock URL: ``file`` locks (``directory`` None: next to the store) or
    ``redis`` locks (``url``: the connection URL, without ``lease``)."""

    kind: Literal["file", "redis"]
    directory: Optional[Path] = None
    url: Optional[str] = None
    lease: float = DEFAULT_LOCK_LEASE


def resolve_lock_url(explicit: str | None = None) -> tuple[str, str]:
    """(lock URL, where it came from): ``explicit`` if given, else ``$LOWERFLOW_LOCKS``
    if set and not empty, else ``file``."""
    if explicit is not None:
        return explicit, "lock URL"
    from_env = os.environ.get(LOCKS_ENV, "").strip()
    if from_env:
        return from_env, LOCKS_ENV
    return "file", "default lock URL"


def parse_lock_url(value: Any, where: str = "lock URL") -> LockSpec:
    """Validate a lock URL (no connection is made); :class:`LockConfigError` names
    ``where``, the value and the accepted forms."""
    if not isinstance(value, str) or not value.strip():
        raise LockConfigError(f"{where} {value!r} is not a lock URL; accepted: {LOCK_URL_FORMS}")
    text = value.strip()
    if text == "file":
        return LockSpec("file")
    try:
        parts = urllib.parse.urlsplit(text)
        if parts.scheme == "file":
            return _file_spec(parts)
        if parts.scheme in ("redis", "rediss"):
            return _redis_spec(parts)
        raise ValueError(f"unknown scheme {parts.scheme}://" if parts.scheme else "no scheme")
    except ValueError as exc:
        raise LockConfigError(
            f"{where} {redact_url(text)!r} is not a lock URL ({exc}); accepted: {LOCK_URL_FORMS}"
        ) from None


def _file_spec(parts: urllib.parse.SplitResult) -> LockSpec:
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ValueError("a file lock URL is file:/// and an absolute directory, nothing else")
    directory = urllib.parse.unquote(parts.path)
    if not directory.startswith("/") or directory == "/":
        raise ValueError("a file lock URL needs an absolute directory")
    return LockSpec("file", directory=Path(directory))


def _redis_spec(parts: urllib.parse.SplitResult) -> LockSpec:
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

    if not parts.hostname:
        raise ValueError("no host")
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    if parts.path not in ("", "/") and not re.fullmatch(r"/\d+", parts.path):
        raise ValueError(f"the database {parts.path[1:]!r} is not a number")
    if parts.fragment:
        raise ValueError("a fragment ('#...') means nothing here")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    lease = DEFAULT_LOCK_LEASE
    options = []
    for name, text in query:
        if name == "lease":
            lease = _seconds(text)
        elif name in URL_QUERY_ARGUMENT_PARSERS or (parts.scheme == "rediss" and name.startswith("ssl_")):
            options.append((name, text))
        else:
            hint = " (ssl_* options need rediss://)" if name.startswith("ssl_") else ""
            raise ValueError(f"unknown option {name!r}{hint}")
    if not any(name == "socket_connect_timeout" for name, _ in options):
        options.append(("socket_connect_timeout", f"{_REDIS_CONNECT_TIMEOUT:g}"))
    url = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(options)))
    parse_url(url)  # redis-py's own check of the options' values
    return LockSpec("redis", url=url, lease=lease)


def _seconds(text: str) -> float:
    """A lease: a positive, finite number of seconds (ValueError otherwise)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"lease {text!r} is not a positive number of seconds")
    return seconds


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what messages show."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


_MANAGERS: dict[str, LockManager] = {}
_MANAGERS_LOCK = threading.Lock()


def lock_manager_for(
    url: str | None = None, default_dir: Path | str | Callable[[], Path] | None = None
) -> LockManager:
    """The lock manager of a lock URL (``url``, else ``$LOWERFLOW_LOCKS``, else ``file``),
    built once per process and URL.  ``default_dir`` (or a callable giving it): where
    ``file`` locks go when the URL names no directory (default ``~/.cache/lowerflow/locks``)."""
    spec = parse_lock_url(*resolve_lock_url(url))
    if spec.kind == "file":
        directory = spec.directory or (default_dir() if callable(default_dir) else default_dir)
        directory = Path(directory or DEFAULT_LOCK_DIR).expanduser().absolute()
        cache_key, build = f"file://{directory}", lambda: FileLockManager(lock_files_directory=directory)
    else:
        cache_key = f"{spec.url}#lease={spec.lease!r}"
        build = lambda: LeasedRedisLockManager(spec.url, lease=spec.lease)  # noqa: E731
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(cache_key)
        if manager is None:
            manager = _MANAGERS[cache_key] = build()
    return manager


class LocksUnavailable(RuntimeError):
    """The Redis server of the stage locks cannot be reached (names it, password hidden)."""


#: Renew a lease: set the key's expiry again, only if the token is still the holder's.
_RENEW_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
#: Release a lock: delete the key, only if the token is still the holder's.
_RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class LeasedRedisLockManager(_BlockingAcquire, RedisLockManager):
    """prefect-redis's ``RedisLockManager`` whose locks expire when their holder dies.

    * A lock taken without a ``hold_timeout`` (Prefect's transactions never pass one)
      is a lease of ``lease`` seconds that a daemon heartbeat thread renews every
      ``lease / 3`` while it is held: alive, a holder keeps it as long as the stage
      runs; killed, its lock expires at most ``lease`` seconds later.  An explicit
      ``hold_timeout`` is a fixed expiry, never renewed (Prefect's meaning).
    * Waiting for a lock only watches the key (prefect-redis takes and drops a lock
      without expiry to wait, which a killed waiter would leave behind for good).
    * Releasing a lock whose lease was lost (another run may hold it now) warns
      instead of failing the finished stage; the lock registry is updated before
      the key is deleted, so another thread of this process taking the key next
      is never forgotten.
    * Every Redis error at acquire is a :class:`LocksUnavailable` naming the server.
    """

    def __init__(self, connection_url: str, lease: float = DEFAULT_LOCK_LEASE) -> None:
        self.lease = float(lease)
        super().__init__(connection_url=connection_url)
        self._init_leases()

    def _init_leases(self) -> None:
        self._mutex = threading.Lock()
        self._leases: dict[str, bytes] = {}  # lock name -> token the heartbeat renews
        self._heartbeat: Optional[threading.Thread] = None
        self._renew = self.client.register_script(_RENEW_SCRIPT)
        self._release = self.client.register_script(_RELEASE_SCRIPT)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "lease": self.lease}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._init_leases()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.connection_url)!r}, lease={self.lease:g})"

    def acquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: Optional[float] = None,
        hold_timeout: Optional[float] = None,
    ) -> bool:
        """Take the lock of ``key`` for ``holder`` (waiting up to ``acquire_timeout``,
        None: without limit); True if taken.  See the class docstring for expiry."""
        from redis.exceptions import RedisError
        from redis.lock import Lock

        if self.is_lock_holder(key, holder):
            return True
        name = self._lock_name_for_key(key)
        expiry = self.lease if hold_timeout is None else hold_timeout
        lock = Lock(self.client, name, timeout=expiry, thread_local=False)
        try:
            if not lock.acquire(token=holder, blocking_timeout=acquire_timeout):
                return False
        except RedisError as exc:
            raise LocksUnavailable(
                f"cannot take stage lock {key} on {redact_url(self.connection_url)}: {type(exc).__name__}: {exc}"
            ) from exc
        with self._mutex:
            self._locks[name] = lock
            if hold_timeout is None:
                self._leases[name] = lock.local.token
        self._start_heartbeat()
        return True

    def release_lock(self, key: str, holder: str) -> None:
        """Release ``holder``'s lock of ``key``; ValueError if another holder has it."""
        name = self._lock_name_for_key(key)
        with self._mutex:
            lock = self._locks.get(name)
            token = getattr(getattr(lock, "local", None), "token", None)
            mine = token is not None and token.decode() == holder
            if mine:
                del self._locks[name]
                self._leases.pop(name, None)
        if mine:
            if not self._release(keys=[name], args=[token]):
                _warn(f"stage lock {key} had expired before its release (not renewed within its "
                      f"{self.lease:g} s lease, or past its hold timeout): another run may have "
                      "computed the stage too")
            return
        if self.is_locked(key):
            raise ValueError(f"No lock held by {holder} for transaction with key {key}")

    def wait_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        """Wait until ``key`` is unlocked (True) or ``timeout`` seconds passed (False)."""
        name = self._lock_name_for_key(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.client.exists(name):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    async def await_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.wait_for_lock, key, timeout)

    def _start_heartbeat(self) -> None:
        with self._mutex:
            if self._heartbeat is None:
                self._heartbeat = threading.Thread(
                    target=self._renew_forever, name="lowerflow-lock-heartbeat", daemon=True
                )
                self._heartbeat.start()

    def _renew_forever(self) -> None:
        """The heartbeat: every ``lease / 3`` seconds, renew every lease this process holds."""
        while True:
            time.sleep(self.lease / 3)
            self.renew_leases()

    def renew_leases(self) -> None:
        """Set every held lease's expiry to ``lease`` seconds from now; forget (with a
        warning) those found lost.  Redis errors are logged: the next beat retries."""
        with self._mutex:
            held = list(self._leases.items())
        for name, token in held:
            try:
                renewed = self._renew(keys=[name], args=[token, int(self.lease * 1000)])
            except Exception as exc:  # Redis unreachable for a moment: the next beat retries
                logger.warning("cannot renew stage lock %s: %s: %s", name, type(exc).__name__, exc)
                continue
            if not renewed:
                with self._mutex:
                    if self._leases.get(name) == token:
                        del self._leases[name]
                logger.warning("stage lock %s expired before it was renewed: another run may compute "
                               "the stage too", name)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class CacheConfig:
    """Where a stage's artifacts, result records and locks live.

    * ``store_url`` / ``storage_options``: the artifact store (default ``$LOWERFLOW_STORE``
      or ``./.lowerflow``).
    * ``results``: Prefect result storage.  Default for a local store:
      ``<root>/prefect/results``.  A remote store needs a saved block slug (see
      :func:`save_results_block`), as Prefect only accepts local paths or saved blocks.
    * ``lock_manager``: a lock manager object, used as it is; else the one of the lock
      URL ``lock_url`` (else ``$LOWERFLOW_LOCKS``, else ``file``: see
      :func:`lock_manager_for`).  ``lock_dir`` is where a bare ``file`` keeps its locks
      (default ``<root>/prefect/locks`` for a local store, ``~/.cache/lowerflow/locks``).
    * ``verify``: how cached refs are checked before a hit is used (see StageCachePolicy).
    """

    store_url: Optional[str] = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    results: Optional[str | Path] = None
    lock_manager: Optional[LockManager] = None
    lock_dir: Optional[Path] = None
    verify: Verify = "digest"
    lock_url: Optional[str] = None

    def artifact_store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url, **dict(self.storage_options))

    @classmethod
    def for_store(cls, store_url: str | None, locks: str | None = None, **storage_options: Any) -> "CacheConfig":
        """The configuration flows use for a store URL: results beside a local store;
        for a remote one (``s3://``, ``memory://``, ...) a results block saved at
        ``<store>/prefect/results`` (needs the Prefect API).  Credentials and
        endpoints come from ``storage_options``, fsspec's configuration, or the
        environment the filesystem reads (for S3: ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``).  ``locks``: the lock URL
        (None: ``$LOWERFLOW_LOCKS``, else ``file``), checked here, before any work
        (:class:`LockConfigError`)."""
        parse_lock_url(*resolve_lock_url(locks))
        config = cls(store_url=store_url, storage_options=storage_options, lock_url=locks)
        store = config.artifact_store()
        if store.is_local:
            return config
        digest = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        if store.url.startswith("memory:"):
            # Lives only in this process, and Prefect's RemoteFileSystem refuses
            # memory:/// paths: records go to a local directory of this URL's
            # (records that outlive the store fail their ref check: recompute).
            return dataclasses.replace(config, results=Path(records_location(store)[1]))
        return dataclasses.replace(config, results=save_results_block(config, name=f"lowerflow-results-{digest}"))

    def result_storage(self) -> str | Path:
        """What ``@task(result_storage=...)`` gets: a local Path or a saved block slug."""
        if self.results is not None:
            return self.results
        store = self.artifact_store()
        if not store.is_local:
            raise ValueError(
                f"store {store.url} is not local: give CacheConfig(results=<block slug>) "
                "(see tasks.cache.save_results_block)"
            )
        return Path(store.root) / "prefect" / "results"

    def locks(self) -> LockManager:
        """The lock manager that serializes identical concurrent stage runs (one per
        process and lock URL: see :func:`lock_manager_for`)."""
        if self.lock_manager is not None:
            return self.lock_manager
        return lock_manager_for(self.lock_url, default_dir=lambda: self.default_lock_dir())

    def default_lock_dir(self) -> Path:
        """Where a bare ``file`` lock URL keeps its locks: ``lock_dir``, else
        ``<root>/prefect/locks`` for a local store, else ``~/.cache/lowerflow/locks``."""
        if self.lock_dir is not None:
            return Path(self.lock_dir)
        store = self.artifact_store()
        return Path(store.root) / "prefect" / "locks" if store.is_local else DEFAULT_LOCK_DIR.expanduser()

    def policy(self, stage: str, version: str, ignore: tuple[str, ...] = ()) -> StageCachePolicy:
        """The SERIALIZABLE cache policy of one stage."""
        return StageCachePolicy(
            stage=stage,
            version=str(version),
            ignore=tuple(ignore),
            verify=self.verify,
            store_url=self.artifact_store().url,
            storage_options=dict(self.storage_options),
            isolation_level="SERIALIZABLE",
            lock_manager=self.locks(),
        )


def records_location(store: ArtifactStore) -> tuple[Any, str]:
    """(filesystem, directory) of the Prefect result records of ``store``'s stages:
    ``<store>/prefect/results``, or for a ``memory://`` store a local directory of its
    URL's (see :meth:`CacheConfig.for_store`)."""
    if store.url.startswith("memory:"):
        import tempfile

        import fsspec

        digest = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        return fsspec.filesystem("file"), f"{tempfile.gettempdir()}/lowerflow-results/{digest}"
    return store.fs, f"{store.root}/prefect/results"


def save_results_block(config: CacheConfig, name: str = "lowerflow-results") -> str:
    """Save a RemoteFileSystem block at ``<store>/prefect/results``; returns its slug.

    Needs the Prefect API.  Use the slug as ``CacheConfig(results=...)`` for remote stores.
    """
    from prefect.filesystems import RemoteFileSystem

    store = config.artifact_store()
    block = RemoteFileSystem(basepath=f"{store.url}/prefect/results", settings=dict(config.storage_options))
    block.save(name, overwrite=True)
    return f"remote-file-system/{name}"


def stage_task(
    stage: str,
    version: str = "1",
    *,
    config: CacheConfig | None = None,
    ignore: tuple[str, ...] = (),
    **task_kwargs: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator making a (synchronous) function a cached lowering stage (a Prefect task).

    The function must return ArtifactRefs and JSON data: anything else raises
    TypeError naming the stage (Prefect would only warn and never cache it).
    ``task_kwargs`` go to ``prefect.task`` (e.g. ``retries``).
    """
    config = config or CacheConfig()
    options = dict(
        name=stage,
        cache_policy=config.policy(stage, version, ignore),
        result_storage=config.result_storage(),
        result_serializer=result_serializer(),
        persist_result=True,
    )
    options.update(task_kwargs)

    def decorate(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def run_stage(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            check_result(stage, result)
            return result

        return task(**options)(run_stage)

    return decorate


def check_result(stage: str, result: Any) -> None:
    """Raise TypeError unless ``result`` persists as JSON (ArtifactRefs and JSON data)."""
    try:
        json.dumps(result, default=encode_json_object, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"stage {stage!r} returned a result that cannot be cached: {exc}") from exc
