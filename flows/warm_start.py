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
directories, :class:`flows.source_watch.SourceWatch`, instead of ~4,700 stats).  If
one changed, that request and any later one fall back to a cold start, and the parent
re-executes itself (reloading everything) as soon as none of its children is running.  With no warm parent (plain
``prefect worker start``, or the socket gone), the client execs ``python -m
prefect.engine``: warm starts only ever make a run faster, never different.

The warm parent is single-threaded when it forks (torch's import starts one native
thread, which torch's own fork handlers expect, as DataLoader workers do); it never
starts an event loop, its one Prefect client (:func:`flows.warm_up.check_api_version`,
synchronous) is closed before it serves, and its imports and warm-up, the one lowering
included (:func:`flows.warm_up.lower_a_small_model`), run tensor ops on one torch thread,
so no OpenMP pool exists to be forked.

This module is the client (the job command: stdlib imports only, it must start fast)
and the warm parent and its children (``python -m flows.warm_start serve|run``: these
module names are in job commands and process listings, keep them).  The warm-ups are
:mod:`flows.warm_up`'s, the staleness check :mod:`flows.source_watch`'s, the worker
(``lowerflow worker``, WarmProcessWorker) :mod:`flows.warm_worker`'s.
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
WARM_UP = ("tasks.fingerprint:top_level_distributions", "tasks.cache_keys:environment_versions",
           "flows.warm_up:draw_a_picture", "flows.warm_up:share_api_tls_context",
           "flows.warm_up:check_api_version", "flows.warm_up:build_prefect_schemas",
           "flows.warm_up:lower_a_small_model")

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

    from flows.console import quiet_libraries

    quiet_libraries()  # before torch: its children's consoles are lowerflow's lines (and Prefect's)
    import torch

    from flows.source_watch import SourceWatch

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
            if not reload_pending:  # why runs start cold until it has reloaded: said once
                changed = sources.changed_files()
                print(f"lowerflow warm parent: {', '.join(changed[:3]) or 'a source'}"
                      f"{f' (+{len(changed) - 3})' if len(changed) > 3 else ''} changed: runs start cold "
                      "until it has reloaded", file=sys.stderr, flush=True)
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


#: Where :func:`flows.warm_worker.warm_worker_class` puts a local deployment's entrypoint for the engine.
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
    from tasks.fingerprint import installed_prefixes

    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    files.update(str(path) for _, path in source_files())
    files.update(installed_prefixes())
    return sorted(files)


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


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["run"] and len(sys.argv) > 2:
        start(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"usage: python -m flows.warm_start serve SOCKET [MODULE...] | run MODULE [ARGS...] (got {sys.argv[1:]})")
