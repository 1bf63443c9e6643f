"""Lowering targets: a name for "what to delegate, to which backend".

* ``portable`` — nothing delegated; every op runs on the runtime's portable kernels.
* a backend name (``reference``, ``xnnpack``, ``ReferenceBackend``, ``XnnpackBackend``,
  or any backend registered in the ``lowerflow.backends`` entry-point group or defined
  as a ``BackendDetails`` subclass) — partitioned by the backend's
  ``partitioner(**options)`` classmethod.  ``xnnpack`` programs run on ExecuTorch's
  XNNPACK backend (fp32).
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import BackendError
from .delegation import find_backend
from .partition import Partitioner

PORTABLE = "portable"


def partitioner_for(target: str, options: Mapping[str, Any] | None = None) -> Partitioner | None:
    """The partitioner of ``target`` (None for ``portable``); a clear error for unknown targets."""
    if target == PORTABLE:
        if options:
            raise BackendError(f"target {PORTABLE!r} takes no options, got {sorted(options)}")
        return None
    backend = find_backend(target)
    make = getattr(backend, "partitioner", None)
    if make is None:
        raise BackendError(
            f"target {target!r}: backend {backend.__name__} has no partitioner() classmethod, "
            "so it can only lower whole programs"
        )
    try:
        return make(**dict(options or {}))
    except TypeError as exc:
        raise BackendError(f"target {target!r}: bad options {dict(options or {})}: {exc}") from exc
