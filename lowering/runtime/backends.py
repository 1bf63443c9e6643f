"""The registry of Python backend runtimes that DelegateCall instructions dispatch to.

A backend runtime is any object with::

    init(processed: bytes, compile_specs: list[CompileSpec]) -> handle
    execute(handle, args: list) -> list[torch.Tensor]

``init`` runs once per delegate when a method is loaded (a runtime whose
``init`` has a ``named_data`` keyword parameter also gets the program's named
data, ``{key: bytes}``, as ExecuTorch hands backends a NamedDataMap); ``execute`` runs on
every DelegateCall with the delegate's input values and returns its outputs,
which the executor copies into the planned output tensors.  A runtime should
also have ``num_inputs(handle) -> int``: where a DelegateCall's inputs end and
its outputs begin (the format does not record it).

Runtimes are registered explicitly, or found by backend id in the
``lowerflow.backend_runtimes`` entry-point group (a class, instantiated once).
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any, Protocol

from .errors import ExecutorError

ENTRY_POINT_GROUP = "lowerflow.backend_runtimes"

_RUNTIMES: dict[str, Any] = {}


class BackendRuntime(Protocol):
    """What :func:`register_backend_runtime` expects."""

    def init(self, processed: bytes, compile_specs: list) -> Any: ...

    def execute(self, handle: Any, args: list) -> list: ...


def takes_named_data(runtime: Any) -> bool:
    """Whether ``runtime.init`` accepts the program's named data (``named_data=``)."""
    try:
        return "named_data" in inspect.signature(runtime.init).parameters
    except (TypeError, ValueError):
        return False


def register_backend_runtime(backend_id: str, runtime: BackendRuntime) -> None:
    """Make DelegateCalls of delegates with id ``backend_id`` run on ``runtime``.

    Registering the same id again replaces the previous runtime.
    """
    if not isinstance(backend_id, str) or not backend_id:
        raise ExecutorError(f"backend id must be a non-empty str, got {backend_id!r}")
    for method in ("init", "execute"):
        if not callable(getattr(runtime, method, None)):
            raise ExecutorError(f"backend runtime for {backend_id!r} has no {method}() method")
    _RUNTIMES[backend_id] = runtime


def unregister_backend_runtime(backend_id: str) -> None:
    """Forget the runtime of ``backend_id`` (no error if none is registered)."""
    _RUNTIMES.pop(backend_id, None)


def backend_runtime(backend_id: str) -> BackendRuntime:
    """The runtime registered for ``backend_id``; a clear error naming it otherwise."""
    if backend_id not in _RUNTIMES:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry.name == backend_id:
                try:
                    register_backend_runtime(backend_id, entry.load()())
                except Exception as exc:
                    raise ExecutorError(
                        f"backend runtime {backend_id!r}: entry point {entry.value!r} failed: {exc}"
                    ) from exc
    try:
        return _RUNTIMES[backend_id]
    except KeyError:
        known = ", ".join(sorted(_RUNTIMES)) or "none"
        raise ExecutorError(
            f"no backend runtime registered for backend id {backend_id!r} "
            f"(registered: {known}); call lowering.runtime.register_backend_runtime"
        ) from None
