"""Stage locks: the lock managers that make concurrent runs of one stage compute once,
and the lock URLs that choose them.

:class:`tasks.cache.CacheConfig` gives every stage's SERIALIZABLE cache policy the lock
manager of a *lock URL* (:func:`lock_manager_for`; an explicit value, else
``$LOWERFLOW_LOCKS``, else ``file``):

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

Also here, as the lowest room of the cache: :func:`warn`, the warning of the stage
cache (its logger and, in a run, the run's log).
"""

from __future__ import annotations

import datetime
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

from prefect.locking.filesystem import FileSystemLockManager
from prefect.locking.protocol import LockManager
from prefect_redis.locking import RedisLockManager

#: The stage cache's logger (its locks' warnings included: one name to configure).
logger = logging.getLogger("lowerflow.cache")


def warn(message: str) -> None:
    """Warn on the stage cache's logger and, inside a Prefect run, on the run's logger."""
    logger.warning(message)
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # no run context
        pass


# --------------------------------------------------------------------------- lock managers


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
                warn(f"stage lock {key} had expired before its release (not renewed within its "
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
