"""Warm starts for flow runs on a work pool: fork a model's run from a process that
has already imported torch, Prefect and lowerflow.

A Prefect process worker starts every flow run as a new ``python -m prefect.engine``
process.  For a lowering run that costs ~5 s of imports before the first stage
(prefect 1.3 s, torch 1.6 s, torch.export's serializer and lowerflow 1 s, the
ExecuTorch runtime and transformers more) — as much as lowering a small model.
``lowerflow worker`` avoids it:

    lowerflow worker --pool P
      ├─ warm parent   (python -m flows.warm_start serve SOCKET)  imports everything once,
      │                 then forks one child per flow run
      └─ Prefect process worker (WarmProcessWorker)   polls the pool; its job command,
                        python -m flows.warm_start run prefect.engine,   is a stdlib-only client
                        that asks the warm parent for a child and relays its exit status

The child is a fork of the warm parent with the client's environment, working
directory and stdin/stdout/stderr (passed over the socket); it runs
``prefect.engine`` as ``python -m prefect.engine`` would.  Signals the worker sends
the client (cancellation) are forwarded to the child.

The warm parent never serves stale code: before each fork it checks the files of
every module it imported, every source lowerflow's cache keys digest, and the
site-packages directories (size, mtime; on Linux through inotify watches of their
directories, :class:`SourceWatch`, instead of ~4,700 stats).  If one changed, that request and any
later one fall back to a cold start, and the parent re-executes itself (reloading
everything) as soon as none of its children is running.  With no warm parent (plain
``prefect worker start``, or the socket gone), the client execs ``python -m
prefect.engine``: warm starts only ever make a run faster, never different.

The warm parent is single-threaded when it forks (torch's import starts one native
thread, which torch's own fork handlers expect, as DataLoader workers do); it never
starts an event loop, its one Prefect client (:func:`check_api_version`, synchronous) is
closed before it serves, and its imports and warm-up, the one lowering included
(:func:`lower_a_small_model`), run tensor ops on one torch thread, so no OpenMP pool
exists to be forked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

#: The environment variable naming the warm parent's socket (set by ``lowerflow worker``).
SOCKET_ENV = "LOWERFLOW_WARM_SOCKET"
#: Modules the warm parent imports (a missing optional one is skipped).
PRELOAD = (
    "torch",
    "prefect.engine",
    "prefect.flow_engine",
    "torch._export.serde.serialize",
    "flows.lower_model",
    "lowering.backends.reference",
    "lowering.backends.xnnpack",
    # What a flow run imports on its way (py-spy of warm children, issue 9: 3% of their CPU):
    # the event loop behind Prefect's clients, the task engine, the suspension observer.
    "anyio._backends._asyncio",
    "prefect.task_engine",
    "prefect.utilities.visualization",
    "prefect.artifacts",
    "prefect._internal.observers",
    "encodings.idna",
    "blake3",  # the weights' fingerprint
)
#: Imported too when installed: the ExecuTorch runtime (verify), transformers (HF models:
#: ``modeling_utils`` is what every model class imports, 1.1 s; the classes themselves
#: take 0.01-0.1 s each, and ``lowerflow worker --preload`` names a fleet's), what the
#: run reports draw with, and what Prefect imports on a flow's first call.
OPTIONAL_PRELOAD = ("executorch.runtime", "transformers", "transformers.modeling_utils", "flows.reports",
                    "PIL.PngImagePlugin", "fastapi.encoders")
#: Per-process work done once in the warm parent, not in every run: which distribution
#: each top-level module belongs to (0.7 s), the digest of lowerflow's sources (0.5 s),
#: the report pictures' fonts, one TLS context for the Prefect API clients, the server's
#: version check, Prefect's deferred pydantic schemas, and a first lowering.  They are
#: checked for staleness with the modules (see :func:`stamp_files`).
WARM_UP = ("tasks.fingerprint:_top_level_distributions", "tasks.cache_keys:environment_versions",
           "flows.warm_start:draw_a_picture", "flows.warm_start:share_api_tls_context",
           "flows.warm_start:check_api_version", "flows.warm_start:build_prefect_schemas",
           "flows.warm_start:lower_a_small_model")
#: Set (by the warm parent itself) when its warm-up lowering left a native thread behind:
#: it then re-executes without it, since a forked child must not inherit threads.
NO_WARM_LOWERING_ENV = "LOWERFLOW_WARM_NO_LOWERING"

_HEADER = struct.Struct("!I")


# --------------------------------------------------------------------------- the client (job command)


def start(module: str, args: list[str]) -> None:
    """``python -m flows.warm_start run MODULE [ARGS]``: ``python -m MODULE ARGS`` in a warm
    child if the warm parent answers, else in this process (exec).  A warm worker's job
    command is ``run prefect.engine``."""
    path = os.environ.get(SOCKET_ENV)
    code = run_warm(path, module, args) if path else None
    if code is not None:
        os._exit(code)
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def run_warm(path: str, module: str, args: list[str]) -> int | None:
    """Ask the warm parent at ``path`` for a child running ``module`` as ``__main__`` with
    this process's environment, directory and stdio; the child's exit status, or None
    if there is no warm parent or it declined (stale code)."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:
        return None
    request = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "module": module, "argv": args}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(request)) + request], [0, 1, 2])
    answers = conn.makefile("rb")
    first = answers.readline()
    if not first.startswith(b"P"):
        return None  # declined: cold start
    pid = int(first[1:])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    last = answers.readline()
    return int(last[1:]) if last.startswith(b"X") else 1


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- the warm parent


def serve(path: str, extra: list[str] = ()) -> None:
    """Import :data:`PRELOAD` (and ``extra`` modules), listen on ``path`` and fork a child
    per request, until the process that started it is gone."""
    import importlib
    import select

    import torch

    # Imports run tensor ops too (transformers.modeling_utils does): on one thread, so no
    # OpenMP pool exists for the children to inherit.  They get torch's thread count back.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in (*PRELOAD, *extra):
            importlib.import_module(name)
        for name in OPTIONAL_PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # not installed, or broken: its users import it themselves
                pass
        for call in WARM_UP:
            module, _, function = call.partition(":")
            getattr(importlib.import_module(module), function)()
    finally:
        torch.set_num_threads(threads)
    sources = SourceWatch(stamp_files())
    modules = module_files()
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.replace(path + ".new", path)  # clients see the socket only once it accepts
    children: dict[int, socket.socket] = {}
    reload_pending = False
    owner = os.getppid()
    while os.getppid() == owner:  # the worker that started it is gone: so is it
        reap(children)
        if reload_pending and not children:
            listener.close()
            os.execv(sys.executable, [sys.executable, "-m", "flows.warm_start", "serve", path, *extra])
        ready, _, _ = select.select([listener], [], [], 0.05)  # 0.05: a finished child's status is relayed soon
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if reload_pending or sources.changed():
            reload_pending = True
            _close(fds)
            _send(conn, b"S\n")
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            sources.close()
            run_child(request, fds, modules)  # never returns
        _close(fds)
        children[pid] = conn
        _send(conn, f"P{pid}\n".encode())


def run_child(request: dict, fds: list[int], modules: dict[str, str] | None = None) -> None:
    """In the forked child: become ``python -m <module>`` of the client (for a flow run,
    ``prefect.engine`` with the run's environment).  ``modules``: :func:`module_files`."""
    import runpy
    import traceback

    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
    _close(fds)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    entrypoint = os.environ.get(ENTRYPOINT_ENV)
    if entrypoint and modules:
        os.environ[ENTRYPOINT_ENV] = entrypoint_in_loaded_module(entrypoint, request["cwd"], modules)
    sys.argv = [request["module"], *request["argv"]]
    code = 1
    try:
        import warnings

        # runpy notes that the module was imported (by the preload) before it runs as __main__.
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package")
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()  # the settings of the run's environment, not the parent's
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        _exit_like_an_interpreter(code)


#: Where :func:`warm_worker_class` puts a local deployment's entrypoint for the engine.
ENTRYPOINT_ENV = "PREFECT__FLOW_ENTRYPOINT"


def module_files() -> dict[str, str]:
    """The warm parent's imported modules by the real path of their source file (``.py``)."""
    files: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name != "__main__" and isinstance(file, str) and file.endswith(".py"):
            files.setdefault(os.path.realpath(file), name)
    return files


def entrypoint_in_loaded_module(entrypoint: str, cwd: str, modules: dict[str, str]) -> str:
    """``flows/lower_model.py:lower_model`` as ``flows.lower_model:lower_model`` when that
    file, relative to ``cwd``, is a module the warm parent imported; else unchanged.

    Prefect loads a ``path.py:flow`` entrypoint by running the script as a new module
    (``load_script_as_module``): 40 ms of every run's CPU, 10% of a cached run's
    (py-spy, issue 9), to rebuild what the child already has.  The parent imported
    that very file, unchanged since (it checks before each fork, :func:`stamp_files`),
    and ran none of its code since, so the engine's ``import_module`` of the module's
    name gives the same flow.  A file elsewhere (another checkout) or not imported
    keeps its path: the engine runs it as Prefect always does.
    """
    path, sep, attribute = entrypoint.rpartition(":")
    if not sep or not path.endswith(".py"):
        return entrypoint
    name = modules.get(os.path.realpath(os.path.join(cwd, path)))
    return f"{name}:{attribute}" if name else entrypoint


def _exit_like_an_interpreter(code: int) -> None:
    """What a normal interpreter exit does, then ``os._exit``: join the threads and run the
    ``threading`` exit hooks (Prefect's log and event services drain there: without them
    the run's last logs never reach the API), then the ``atexit`` functions."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    except Exception:
        pass
    _keep_torch_libraries()
    try:
        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _keep_torch_libraries() -> None:
    """Let the process end without unregistering every ``torch.library`` op one by one.

    Each ``torch.library.Library`` (torchao's, lowerflow's fused ops, ...) unregisters its
    ops from the dispatcher in a ``weakref.finalize`` that runs at exit: 0.1 s of a run's
    CPU (py-spy, issue 9) spent tidying memory the exit frees anyway.  This marks those
    finalizers not to run at exit (``finalize.atexit``); every other exit function runs."""
    import weakref

    try:
        from torch.library import _del_library
    except ImportError:
        return
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info, "func", None) is _del_library:
            finalizer.atexit = False


def reap(children: dict[int, socket.socket]) -> None:
    """Tell each finished child's client its exit status (128 + signal if it was killed)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, f"X{128 - code if code < 0 else code}\n".encode())
            conn.close()


def stamp_files() -> list[str]:
    """What the warm parent's state depends on, to check before each fork: the file of
    every imported module, every source lowerflow's cache keys digest (imported or
    not), and the site-packages directories (a distribution installed or removed
    changes which distribution a module belongs to)."""
    from tasks.cache_keys import source_files
    from tasks.fingerprint import _installed_prefixes

    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    files.update(str(path) for _, path in source_files())
    files.update(_installed_prefixes())
    return sorted(files)


def file_stamps(files) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of each file; (-1, -1) for one that is gone."""
    stamps = {}
    for f in files:
        try:
            st = os.stat(f)
            stamps[f] = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamps[f] = (-1, -1)
    return stamps


class SourceWatch:
    """Whether any of ``files`` (and directories) changed since the watch was made:
    (size, mtime) differs, or it appeared or went away.

    Stat-ing every file before each fork (~4,700 for a worker with transformers
    preloaded) cost 20-36 ms of every run's latency and 4% of the flow runs' CPU
    (py-spy, issue 9).  On Linux the watch asks the kernel instead: an inotify watch
    on each directory holding a file reports any write, truncation, touch, rename,
    creation or deletion there, synchronously, so an empty event queue means nothing
    changed.  Only when the queue has events does it stat the files (events for
    other files of those directories, a ``__pycache__`` created, are then found
    harmless and drained).  It stats every time, as before, for files on a file
    system whose changes made elsewhere inotify does not see (NFS, SMB, FUSE; only
    :data:`LOCAL_FILE_SYSTEMS` are watched), everywhere when inotify is missing or out
    of watches, and from the moment a watched directory is itself removed or moved.
    """

    #: File systems whose every change passes through this kernel's inotify.
    LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs",
                                    "f2fs", "squashfs", "bcachefs", "jfs", "reiserfs"})
    _IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x8, 0x40, 0x80
    _IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
    _IN_Q_OVERFLOW, _IN_IGNORED, _IN_NONBLOCK, _IN_CLOEXEC = 0x4000, 0x8000, 0o4000, 0o2000000

    def __init__(self, files) -> None:
        self.stamps = file_stamps(files)
        self.polled = dict(self.stamps)  # the files stat-ed before every fork
        self.fd: int | None = None
        self._changed = False
        self._watch()
        if self.fd is not None:  # a change between the stat-ing and the watches: seen too
            self._changed = file_stamps(self.stamps) != self.stamps

    def changed(self) -> bool:
        """True if a file changed since the watch was made (and from then on)."""
        if not self._changed:
            if self.fd is None or self._drain():
                self._changed = file_stamps(self.stamps) != self.stamps
            else:
                self._changed = bool(self.polled) and file_stamps(self.polled) != self.polled
        return self._changed

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _watch(self) -> None:
        """Watch the directory of each file on a local file system (and each directory
        itself); those files are then no longer stat-ed before each fork."""
        if not sys.platform.startswith("linux"):
            return
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(self._IN_NONBLOCK | self._IN_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = (self._IN_MODIFY | self._IN_ATTRIB | self._IN_CLOSE_WRITE | self._IN_MOVED_FROM | self._IN_MOVED_TO
                | self._IN_CREATE | self._IN_DELETE | self._IN_DELETE_SELF | self._IN_MOVE_SELF)
        mounts = _mount_types()
        directories: dict[str, list[str]] = {}
        for path, stamp in self.stamps.items():
            if stamp == (-1, -1) or os.path.islink(path):
                continue  # gone (it may come back), or a link whose target's directory is elsewhere
            directories.setdefault(path if os.path.isdir(path) else os.path.dirname(path), []).append(path)
        for directory, paths in directories.items():
            if _mount_type(directory, mounts) not in self.LOCAL_FILE_SYSTEMS:
                continue
            if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
                os.close(fd)  # out of watches (fs.inotify.max_user_watches): stat everything
                self.polled = dict(self.stamps)
                return
            for path in paths:
                self.polled.pop(path, None)
        self.fd = fd

    def _drain(self) -> bool:
        """Read every pending event; True if there was one.  A watched directory
        removed or moved, or a lost event, turns the watch off for good."""
        import struct

        seen = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return seen
            if not data:
                return seen
            seen = True
            offset = 0
            while offset + 16 <= len(data):
                _wd, event, _cookie, length = struct.unpack_from("iIII", data, offset)
                offset += 16 + length
                if event & (self._IN_DELETE_SELF | self._IN_MOVE_SELF | self._IN_IGNORED | self._IN_Q_OVERFLOW):
                    self.close()
                    return True


def _mount_types() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts, longest point first."""
    mounts = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                if "-" in fields:
                    point = fields[4].replace("\\040", " ")
                    mounts.append((point, fields[fields.index("-") + 1]))
    except OSError:
        pass
    return sorted(mounts, key=lambda m: -len(m[0]))


def _mount_type(path: str, mounts: list[tuple[str, str]]) -> str | None:
    """The type of the file system ``path`` is on (None if unknown)."""
    real = os.path.realpath(path)
    for point, kind in mounts:
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return kind
    return None


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < _HEADER.size:
        raise ValueError("short request")
    (size,) = _HEADER.unpack_from(data)
    body = data[_HEADER.size:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("truncated request")
        body += chunk
    return json.loads(body), list(fds)


def _send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:  # the client went away; its child still runs to the end
        pass


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


#: The Prefect version whose API clients :func:`share_api_tls_context` was written against.
TLS_PREFECT_VERSION = "3.8.8"


def share_api_tls_context() -> None:
    """Make Prefect's verified TLS context once per CA file, not once per API client.

    Prefect 3.8.8 builds a new ``ssl.create_default_context(cafile=...)`` for each
    ``PrefectClient``/``SyncPrefectClient`` (35-40 ms: it parses ~150 CA certificates),
    and a flow run makes about eight of them: 0.3 s of CPU a run (py-spy, issue 9).
    After this, a client made with Prefect's own TLS settings (no ``verify`` of its own,
    not ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``) gets the context that the same call made
    for the same CA file (``PREFECT_API_SSL_CERT_FILE``, else certifi's bundle) before:
    the warm parent makes the one its settings name, so every child starts with it.
    Prefect never changes a context it is given.  Only on the Prefect version this was
    checked against.
    """
    import ssl

    import certifi
    import prefect
    from prefect.client import orchestration
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    if prefect.__version__ != TLS_PREFECT_VERSION:
        return
    contexts: dict[str, ssl.SSLContext] = {}

    def verified_context(cafile: str) -> ssl.SSLContext:
        if cafile not in contexts:
            contexts[cafile] = ssl.create_default_context(cafile=cafile)
        return contexts[cafile]

    def sharing(init):
        def __init__(self, *args, httpx_settings=None, **kwargs):
            if not (httpx_settings or {}).get("verify") and not PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
                cafile = PREFECT_API_SSL_CERT_FILE.value() or certifi.where()
                httpx_settings = {**(httpx_settings or {}), "verify": verified_context(cafile)}
            init(self, *args, httpx_settings=httpx_settings, **kwargs)

        __init__.__wrapped__ = init
        return __init__

    for client in (orchestration.PrefectClient, orchestration.SyncPrefectClient):
        if not hasattr(client.__init__, "__wrapped__"):
            client.__init__ = sharing(client.__init__)
    verified_context(PREFECT_API_SSL_CERT_FILE.value() or certifi.where())


def build_prefect_schemas() -> None:
    """Complete every Prefect pydantic model whose schema is still deferred.

    Prefect defines its client models (flow runs, deployments, events, artifacts, ...)
    with their validators built on first use, and a forked child that validates one
    builds it again: 30-40 ms per model, ~10% of a cached fleet member's CPU (py-spy,
    issue 9).  Built here once (0.15 s for ~260 models), every child has them.
    """
    import pydantic

    models, stack = set(), [pydantic.BaseModel]
    while stack:
        for model in stack.pop().__subclasses__():
            if model not in models:
                models.add(model)
                stack.append(model)
    for model in sorted(models, key=lambda m: (m.__module__, m.__qualname__)):
        if model.__module__.startswith("prefect.") and not model.__pydantic_complete__:
            model.model_rebuild(raise_errors=False)  # one that cannot be built yet stays lazy


def check_api_version() -> None:
    """Ask the Prefect server its version once, here, so that no child asks it again.

    Prefect checks the server's version once per process and API URL (a GET of
    ``/admin/version``; the events subscriber that watches a deployment run for
    suspension also builds a TLS context of its own for it), before the flow starts:
    0.1 s of CPU and a round trip in every flow run (py-spy, issue 9).  Done once in
    the warm parent, every child inherits Prefect's "already checked" record, as every
    client of one long-lived Prefect worker process does.  A child whose settings name
    another API URL checks it itself; so do all children if the server cannot be
    reached now, or its major version differs (the child then fails as Prefect would).
    Only on the Prefect version this was checked against.
    """
    import prefect

    if prefect.__version__ != TLS_PREFECT_VERSION:
        return
    from prefect._internal import version_checking
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with get_client(sync_client=True) as client:
            client.raise_for_api_version_mismatch_once()  # records str(client.api_url)
    except Exception:
        return
    # The events and logs clients key the record on the setting as written.
    version_checking._cache_api_version_check(version_checking._api_version_check_key(url, prefect.__version__))


def lower_a_small_model() -> None:
    """Export, serialize and lower a small model to every built-in target, once, in the
    warm parent: what torch and lowerflow do lazily on a process's first lowering
    (decomposition tables, operator lookups, the serializer's and partitioners' first
    calls) then happens once per worker, not in every run.  Measured on forked
    children: 0.25-0.9 s less a model (mlp 0.45 -> 0.17 s, mobilenet_v2 5.7 -> 4.8 s).

    :func:`serve` runs it on one torch thread: no OpenMP pool is started, so children
    fork with none.  If native threads appeared anyway, the parent re-executes itself
    without this warm-up."""
    import threading

    import torch
    from torch import nn
    from torch.nn import functional as F

    if os.environ.get(NO_WARM_LOWERING_ENV):
        return
    from lowering import export, lower
    from lowering.serialize import deserialize_any, serialize_any
    from lowering.targets import PORTABLE, partitioner_for

    class Small(nn.Module):
        """A conv net's and a transformer's usual layers."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.embed, self.norm, self.mlp = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            x = self.norm(self.embed(ids))
            x = F.scaled_dot_product_attention(x, x, x) + F.gelu(self.mlp(x))
            return x.softmax(-1).mean() + self.conv(image).flatten().sum()

    def native_threads() -> int:
        return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()

    before = native_threads()
    try:
        model, inputs = Small().eval(), (torch.randn(1, 3, 8, 8), torch.arange(6).reshape(1, 6))
        program = export(model, inputs)
        serialized = serialize_any(program)
        deserialize_any(serialized.manifest, serialized.get_blob)
        for target in (PORTABLE, "reference", "xnnpack"):
            lower(model, inputs, partitioner=partitioner_for(target))
    except Exception as exc:  # a warm-up only makes runs faster: never a reason not to serve them
        print(f"lowerflow warm start: the warm-up lowering failed ({type(exc).__name__}: {exc}); "
              "runs will do torch's first-lowering work themselves", file=sys.stderr)
    if native_threads() > before:
        os.environ[NO_WARM_LOWERING_ENV] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "flows.warm_start", *sys.argv[1:]])


def draw_a_picture() -> None:
    """Load the report pictures' fonts and draw and encode a small PNG (no threads)."""
    import io

    from PIL import Image, ImageDraw

    from flows.report_pictures import FONT_PIXELS, picture_font

    image = Image.new("RGB", (40, 20), "white")
    for pixels in FONT_PIXELS:
        ImageDraw.Draw(image).text((1, 1), "warm", font=picture_font(pixels), fill="black")
    image.save(io.BytesIO(), format="PNG")


# --------------------------------------------------------------------------- the worker


#: The one pull step a deployment of code already on the worker has (``prefect deploy``
#: without ``pull``, or ``flow.from_source(<local directory>)``).
SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


def local_entrypoint(deployment) -> tuple[str, str] | None:
    """(directory, entrypoint) of a deployment whose code is already here: its only pull
    step is ``set_working_directory`` to an existing directory and its entrypoint is a
    ``path.py:flow``.  None for anything else (git clones, storage blocks, module paths).

    For such a deployment, a flow run started in ``directory`` with
    ``PREFECT__FLOW_ENTRYPOINT=entrypoint`` loads the same flow as the engine's
    ``load_flow_from_flow_run`` (read the deployment, run the step: ``chdir``, import the
    entrypoint), without reading the deployment again nor emitting the step's event:
    0.1-0.3 s of every flow run (issue 9).
    """
    steps = getattr(deployment, "pull_steps", None) or []
    entrypoint = getattr(deployment, "entrypoint", None) or ""
    if len(steps) != 1 or ":" not in entrypoint or getattr(deployment, "storage_document_id", None):
        return None
    if not isinstance(steps[0], dict) or len(steps[0]) != 1:
        return None
    (step, settings), = steps[0].items()
    if step not in (SET_WORKING_DIRECTORY, "prefect.deployments.steps.pull.set_working_directory"):
        return None
    directory = settings.get("directory") if isinstance(settings, dict) else None
    if not isinstance(directory, str) or "{{" in directory or not os.path.isdir(directory):
        return None  # templated ({{ ... }}) or not on this machine: let the engine run the step
    return directory, entrypoint


def warm_worker_class():
    """Prefect's ProcessWorker whose flow runs start with ``flows.warm_start run
    prefect.engine`` (unless a deployment sets its own ``command``), loading a
    :func:`local_entrypoint` deployment's flow straight from its entrypoint."""
    from prefect.utilities.processutils import command_to_string
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    rendered: dict[str, tuple[object, dict[str, str]]] = {}  # settings object, its variables

    class WarmJobConfiguration(ProcessJobConfiguration):
        @classmethod
        def _base_environment(cls) -> dict[str, str]:
            """Prefect's: the worker's settings as environment variables, for every run.
            Rendering them walks every setting (~50 ms of the worker's CPU a run, py-spy);
            while the settings are the same object, they are the same variables."""
            from prefect.settings import get_current_settings

            settings = get_current_settings()
            if rendered.get("last", (None,))[0] is not settings:
                rendered["last"] = (settings, super()._base_environment())
            return dict(rendered["last"][1])

        def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None,
                                 worker_name=None, worker_id=None):
            super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
            local = local_entrypoint(deployment) if deployment is not None else None
            if local is not None and ENTRYPOINT_ENV not in self.env:
                self.working_dir = local[0]
                self.env[ENTRYPOINT_ENV] = local[1]  # a warm child imports it as a module

    class WarmProcessWorker(ProcessWorker):
        job_configuration = WarmJobConfiguration

        async def run(self, flow_run, configuration, task_status=None):
            if not configuration._command_configured:
                configuration.command = command_to_string(
                    [sys.executable, "-m", "flows.warm_start", "run", "prefect.engine"])
                configuration._command_configured = True
            try:
                return await super().run(flow_run, configuration, task_status)
            finally:
                self._poll_soon()

        async def get_and_submit_flow_runs(self):
            """Prefect's poll, skipped while every slot is taken (nothing could be submitted:
            a busy worker's polls only cost the server, ~15 ms of its CPU each, two a
            second per worker); :meth:`_poll_soon` polls as soon as a slot frees."""
            if self._limiter is not None and self._limiter.available_tokens < 1:
                import prefect.types._datetime

                self._last_polled_time = prefect.types._datetime.now("UTC")  # the health check's "still polling"
                return []
            return await super().get_and_submit_flow_runs()

        def _poll_soon(self):
            """Look for the next run as soon as this one's process has ended: a busy worker
            otherwise idles until its next poll (``PREFECT_WORKER_QUERY_SECONDS``; 0.25 s
            on average, a run).  The poll starts once the caller has released the run's
            limit slot, which it does before it next awaits."""
            if self._runs_task_group is not None:
                try:
                    self._runs_task_group.start_soon(self.get_and_submit_flow_runs)
                except RuntimeError:  # shutting down
                    pass

    return WarmProcessWorker


def run_worker(pool: str, work_queues: list[str], limit: int | None, query_seconds: float = 0.5,
               name: str | None = None, threads: int = 1, preload: list[str] = ()) -> None:
    """``lowerflow worker``: a warm parent and a :func:`warm_worker_class` worker polling
    ``pool`` (its ``work_queues``, at most ``limit`` runs at once), until interrupted.

    ``threads``: torch's intra-op threads per flow run (``OMP_NUM_THREADS``, unless set):
    one worker per core, each run on one thread, rather than every run spreading over
    every core and the workers of a machine fighting for them.

    ``preload``: more modules for the warm parent to import once (a fleet's model zoo,
    e.g. ``transformers.models.bert.modeling_bert``: 0.3-1 s a run otherwise)."""
    import shutil
    import subprocess
    import tempfile
    import time

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # read when the warm parent imports torch
    directory = tempfile.mkdtemp(prefix="lowerflow-warm-")
    path = os.path.join(directory, "warm.sock")
    parent = subprocess.Popen([sys.executable, "-m", "flows.warm_start", "serve", path, *preload])
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            if parent.poll() is not None:
                raise RuntimeError(f"the warm parent exited with status {parent.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm parent was not ready after 300 s")
            time.sleep(0.05)
        os.environ[SOCKET_ENV] = path
        os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(query_seconds))
        _run_prefect_worker(pool, work_queues, limit, name)
    finally:
        parent.terminate()
        try:
            parent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            parent.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _run_prefect_worker(pool: str, work_queues: list[str], limit: int | None, name: str | None) -> None:
    import anyio
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # PREFECT_WORKER_QUERY_SECONDS set above
    share_api_tls_context()  # the worker makes API clients for every run it submits, too
    worker_class = warm_worker_class()

    async def main() -> None:
        async with worker_class(work_pool_name=pool, work_queues=work_queues or None, limit=limit,
                                name=name) as worker:
            await worker.start()

    anyio.run(main)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["run"] and len(sys.argv) > 2:
        start(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"usage: python -m flows.warm_start serve SOCKET [MODULE...] | run MODULE [ARGS...] (got {sys.argv[1:]})")
