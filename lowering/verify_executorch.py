"""verify's second runtime: the stock ExecuTorch runtime (the oracle), when it is installed.

It is looked up by name at call time (``importlib``): nothing in lowerflow depends on
it.  Before a program runs, the kernel libraries it needs are loaded
(:func:`lowering.stock_ops.needed_sets` of its operators)::

    operators of the .pte           sets needed     where the runtime runs
    aten::*, executorch_prim::*     -               this process
    quantized_decomposed::*.out     quantized       this process (import executorch.kernels.quantized)
    llama::*.out                    llm             a fresh interpreter, custom-ops library first

The "llm" set runs in a fresh interpreter (unless this process loaded ExecuTorch's
custom-ops library already): loading that library into a process where lowerflow
defined its own ``llama::`` ops aborts the process (the library registers the same
ops again in a static initializer; a C++ exception no Python code can catch).
Starting one costs seconds (importing torch and ExecuTorch: ~18 s on a loaded machine),
so :meth:`ExecutorchRunner.batch` runs every job of one verify call (each input set,
each method) in ONE fresh interpreter, each job on a program loaded for it alone.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Iterable, Union

import torch

from .stock_ops.table import LIBRARIES, needed_sets, stock_table

log = logging.getLogger("lowering.verify")

#: A program to run: its bytes, or the path of its ``.pte`` file (either one carrying its
#: ``.ptd`` when its weights are external: :func:`with_data`).
Pte = Union[bytes, str, os.PathLike]


class _BytesWithData(bytes):
    """A ``.pte``'s bytes that carry the ``.ptd`` (``data``: bytes or a path) they bind."""

    data: Any = None


class _PathWithData(str):
    """A ``.pte`` file's path that carries the ``.ptd`` (``data``: bytes or a path) it binds."""

    data: Any = None


def with_data(pte: "Pte", data: "bytes | str | os.PathLike | None") -> "Pte":
    """``pte`` (bytes or path) together with its external data (a ``.ptd``'s bytes or path):
    every runtime verify runs binds the program's external weights from it.  Everything
    that reads the program alone (its table, its size) sees ``pte`` as it was."""
    if data is None:
        return pte
    pair = _BytesWithData(pte) if isinstance(pte, (bytes, bytearray, memoryview)) else _PathWithData(os.fspath(pte))
    pair.data = data if isinstance(data, (bytes, bytearray)) else os.fspath(data)
    return pair


def data_of(pte: "Pte") -> "bytes | str | None":
    """The external data (``.ptd`` bytes or path) ``pte`` carries, None if it has none."""
    return getattr(pte, "data", None)


def data_bytes(pte: "Pte") -> bytes | None:
    """The ``.ptd`` bytes ``pte`` carries (read from its file if a path), None if none."""
    data = data_of(pte)
    if data is None or isinstance(data, (bytes, bytearray)):
        return data
    with open(data, "rb") as f:
        return f.read()


@contextlib.contextmanager
def _data_path(pte: "Pte"):
    """The path of ``pte``'s ``.ptd`` (bytes written to a temporary file), None without one."""
    data = data_of(pte)
    if data is None or not isinstance(data, (bytes, bytearray)):
        yield data
        return
    with tempfile.TemporaryDirectory(prefix="lowerflow-ptd-") as tmp:
        path = os.path.join(tmp, "data.ptd")
        with open(path, "wb") as f:
            f.write(data)
        yield path

#: ExecuTorch's Python runtime deadlocks when two threads execute methods at once
#: (seen with two models verified concurrently in a fleet): one call at a time.
_EXECUTORCH_LOCK = threading.Lock()

#: The fresh interpreter's program: load the libraries, then per job load its program (by
#: path) and methods, run the calls; save each job's outputs, or the last line of its error.
_CHILD = """
import importlib, sys, traceback, torch
request = torch.load(sys.argv[1], weights_only=True)
for module in request["modules"]:
    importlib.import_module(module)
runtime = importlib.import_module("executorch.runtime").Runtime.get()
results = []
for path, data, names, calls in request["jobs"]:
    try:
        # a path: the runtime maps the file, nothing is copied; data: the .ptd it binds
        program = runtime.load_program(path, data_path=data) if data else runtime.load_program(path)
        for name in names:
            if name not in program.method_names:
                raise KeyError(f"program has no method {name!r}; methods: {sorted(program.method_names)}")
        methods = {name: program.load_method(name) for name in names}
        results.append([list(methods[name].execute(list(inputs))) for name, inputs in calls])
    except Exception as exc:
        lines = [line for line in "".join(traceback.format_exception_only(exc)).splitlines() if line.strip()]
        results.append({"error": lines[-1]})
torch.save(results, sys.argv[2])
"""


def executorch_runner() -> "ExecutorchRunner | None":
    """The runner, or None where ExecuTorch is not installed."""
    try:
        with native_output_to_log():
            runtime_module = importlib.import_module("executorch.runtime")
    except ImportError:
        return None
    return ExecutorchRunner(runtime_module)


class ExecutorchRunner:
    """Runs ``.pte`` methods on ExecuTorch's runtime with the kernel libraries they need."""

    def __init__(self, runtime_module) -> None:
        self.runtime_module = runtime_module

    def __call__(self, pte: "Pte", inputs: list, calls: int, method_name: str = "forward") -> list[list[torch.Tensor]]:
        """``calls`` calls of ``method_name`` on one loaded method (state carries over)."""
        return self.sequence(pte, [method_name], [(method_name, inputs)] * calls)

    def sequence(self, pte: "Pte", names: list[str], calls: list) -> list[list[torch.Tensor]]:
        """``calls`` ``[(method, flat inputs)]`` on one program, every method of ``names`` loaded first."""
        return batch_outputs(self.batch(pte, [(names, calls)])[0])

    def batch(self, pte: "Pte", jobs: list[tuple[list[str], list]]) -> list:
        """Every job ``(names, calls)`` as :meth:`sequence` runs it, each on a program loaded
        for it alone (fresh state); a program that needs the "llm" set runs them all in
        one fresh interpreter.  Per job: its outputs, or the exception it raised.
        ``pte``: the program's bytes, or its file's path (loaded from the file, memory-mapped)."""
        try:  # before the runtime sees it: a missing or wrong .ptd crashes the stock runtime
            _check_data(pte)
        except Exception as exc:
            return [exc] * len(jobs)
        sets = needed_sets(program_operators(pte))
        if "llm" in sets and LIBRARIES["llm"] not in sys.modules:
            return run_in_fresh_interpreter(pte, jobs, sets)
        results = []
        for names, calls in jobs:
            try:
                results.append(self._run_here(pte, sets, names, calls))
            except Exception as exc:
                results.append(exc)
        return results

    def _run_here(self, pte: "Pte", sets: set[str], names: list[str], calls: list) -> list[list[torch.Tensor]]:
        with _EXECUTORCH_LOCK, native_output_to_log():
            for name in sorted(sets):
                _load_library(name)
            with _data_path(pte) as data:
                source = bytes(pte) if isinstance(pte, bytes) else str(pte)
                runtime = self.runtime_module.Runtime.get()
                program = runtime.load_program(source, data_path=data) if data else runtime.load_program(source)
            for name in names:
                if name not in program.method_names:
                    raise KeyError(f"program has no method {name!r}; methods: {sorted(program.method_names)}")
            methods = {name: program.load_method(name) for name in names}
            return [list(methods[name].execute(list(inputs))) for name, inputs in calls]

    def call(self, pte: "Pte", function: str, *args: Any) -> Any:
        """``function(runtime, *args)`` (``"module:name"``, a module-level function taking
        ExecuTorch's ``Runtime`` first, e.g. :func:`lowering.benchmark.measure`) with the
        kernel libraries ``pte`` needs loaded: in this process, one call at a time, or,
        where ``pte`` needs the "llm" set, in a fresh interpreter (``args``: what
        ``torch.save`` keeps with ``weights_only``; programs as file paths)."""
        sets = needed_sets(program_operators(pte))
        if "llm" in sets and LIBRARIES["llm"] not in sys.modules:
            return call_in_fresh_interpreter(function, args, sets)
        module, _, name = function.partition(":")
        with _EXECUTORCH_LOCK, native_output_to_log():
            for library in sorted(sets):
                _load_library(library)
            return getattr(importlib.import_module(module), name)(self.runtime_module.Runtime.get(), *args)

    def missing_operators(self, operators: Iterable[str]) -> list[str]:
        """Operators of namespaces the stock runtime has none of (a backend's own ops,
        e.g. a fused op no backend took): the runtime refuses the method, so verify skips
        it.  A missing kernel of a stock namespace is a failure to report, not a skip."""
        table = stock_table()
        return [op for op in operators if table.set_of(op) is None and op.partition("::")[0] not in table.namespaces]

    def missing_backends(self, backend_ids: list[str]) -> list[str]:
        with _EXECUTORCH_LOCK, native_output_to_log():
            registry = self.runtime_module.Runtime.get().backend_registry
            return [b for b in backend_ids if not registry.is_available(b)]


def program_operators(pte: "Pte") -> list[str]:
    """The operators the program's methods call, ``"ns::name.overload"``, in order of first use
    (``pte``: bytes or a file's path; only the program's table is read)."""
    from .pte.format import decode_string, program_table

    names = []
    for plan in program_table(pte).executionPlan or []:
        for op in plan.operators or []:
            name, overload = decode_string(op.name), decode_string(op.overload)
            qualified = f"{name}.{overload}" if overload else name
            if qualified not in names:
                names.append(qualified)
    return names


def _load_library(name: str) -> None:
    """Load an optional set's kernel library into this process's runtime, as a user of
    the stock runtime links it in."""
    try:
        importlib.import_module(LIBRARIES[name])
    except ImportError:  # an ExecuTorch without it: the runtime reports the operators missing
        pass


def run_in_fresh_interpreter(pte: "Pte", jobs: list[tuple[list[str], list]], sets: Iterable[str]) -> list:
    """:meth:`ExecutorchRunner.batch` in ONE fresh Python (the same interpreter) that loads
    the libraries of ``sets`` ("llm" first) before the runtime.  A job's error comes back
    as a RuntimeError quoting the last line of its traceback; when the interpreter itself
    fails (e.g. aborts), every job's is a RuntimeError quoting its last line of stderr."""
    return run_programs_in_fresh_interpreter([(pte, names, calls) for names, calls in jobs], sets)


def run_programs_in_fresh_interpreter(jobs: list[tuple["Pte", list[str], list]], sets: Iterable[str]) -> list:
    """:func:`run_in_fresh_interpreter` of ``(pte, method names, calls)`` jobs of several
    programs (each distinct program's bytes written once; a path is handed over as it
    is): one interpreter start-up for all."""
    modules = [LIBRARIES[name] for name in ("llm", "quantized") if name in sets]
    with tempfile.TemporaryDirectory(prefix="lowerflow-executorch-") as tmp:
        paths: dict[Any, str] = {}
        for item in [pte for pte, _, _ in jobs] + [data_of(pte) for pte, _, _ in jobs]:
            if item is None or _file_key(item) in paths:
                continue
            if isinstance(item, (bytes, bytearray)):
                paths[_file_key(item)] = os.path.join(tmp, f"file{len(paths)}")
                with open(paths[_file_key(item)], "wb") as f:
                    f.write(item)
            else:  # a plain str: a path carrying its .ptd (_PathWithData) is no tensor weights_only loads
                paths[_file_key(item)] = str(os.fspath(item))
        request, outputs = os.path.join(tmp, "request.pt"), os.path.join(tmp, "outputs.pt")
        torch.save({"modules": modules,
                    "jobs": [(paths[_file_key(pte)], paths.get(_file_key(data_of(pte))), list(names),
                              [(name, list(inputs)) for name, inputs in calls])
                             for pte, names, calls in jobs]}, request)
        done = subprocess.run([sys.executable, "-c", _CHILD, request, outputs],
                              capture_output=True, text=True, timeout=900)
        if done.stderr.strip():
            log.debug("executorch runtime output (fresh interpreter):\n%s", done.stderr.strip())
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            failed = RuntimeError(lines[-1] if lines else f"the ExecuTorch runtime exited with {done.returncode}")
            return [failed] * len(jobs)
        results = torch.load(outputs, weights_only=True)  # tensors, numbers, strings: nothing to unpickle
        return [RuntimeError(r["error"]) if isinstance(r, dict) else r for r in results]


def _check_data(pte: "Pte") -> None:
    """:func:`lowering.external.check_pair` of the program and the data it carries (a program
    that needs none and carries none costs a read of its table)."""
    from .external import check_pair

    data = data_of(pte)
    check_pair(pte, data, pte_name="the program", ptd_name="its .ptd")


def _file_key(item: Any) -> Any:
    """A dict key of a program's or data's bytes or path (plain bytes / str: carried data aside)."""
    if item is None:
        return None
    return ("bytes", bytes(item)) if isinstance(item, (bytes, bytearray)) else ("path", os.fspath(item))


#: :func:`call_in_fresh_interpreter`'s program: the libraries first, then the function.
_CALL_CHILD = """
import importlib, sys, torch
request = torch.load(sys.argv[1], weights_only=True)
for module in request["modules"]:
    importlib.import_module(module)
runtime = importlib.import_module("executorch.runtime").Runtime.get()
module, _, name = request["function"].partition(":")
torch.save(getattr(importlib.import_module(module), name)(runtime, *request["args"]), sys.argv[2])
"""


def call_in_fresh_interpreter(function: str, args: tuple, sets: Iterable[str]) -> Any:
    """:meth:`ExecutorchRunner.call` in a fresh Python that loads the libraries of ``sets``
    ("llm" first) before the runtime; its error comes back as a RuntimeError quoting the
    last line of its stderr."""
    modules = [LIBRARIES[name] for name in ("llm", "quantized") if name in sets]
    with tempfile.TemporaryDirectory(prefix="lowerflow-executorch-") as tmp:
        request, output = os.path.join(tmp, "request.pt"), os.path.join(tmp, "output.pt")
        torch.save({"modules": modules, "function": function, "args": list(args)}, request)
        done = subprocess.run([sys.executable, "-c", _CALL_CHILD, request, output],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else f"the ExecuTorch runtime exited with {done.returncode}")
        return torch.load(output, weights_only=True)


def batch_outputs(result: "list | Exception") -> list:
    """A :meth:`ExecutorchRunner.batch` entry: its outputs, or its exception raised."""
    if isinstance(result, Exception):
        raise result
    return result


@contextlib.contextmanager
def native_output_to_log():
    """The oracle's import and its C++ runtime print diagnostics straight to file
    descriptor 2 (cpuinfo probes, torchao's optional kernels).  Around those calls
    fd 2 goes to a temporary file, and what was written is logged at DEBUG on
    ``lowering.verify``, so it is there for whoever asks and stays off the console.
    Python-level warnings and log records raised meanwhile are unaffected."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except ValueError:
                pass
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace").strip()
            if text:
                log.debug("executorch runtime output:\n%s", text)
