"""Lowering targets: a name for "what to delegate, to which backend".

* ``portable`` — nothing delegated; every op runs on the runtime's portable kernels.
* a backend name (``reference``, ``xnnpack``, ``ReferenceBackend``, ``XnnpackBackend``,
  or any backend registered in the ``lowerflow.backends`` entry-point group or defined
  as a ``BackendDetails`` subclass) — partitioned by the backend's
  ``partitioner(**options)`` classmethod.  ``xnnpack`` programs run on ExecuTorch's
  XNNPACK backend (fp32).
"""

from __future__ import annotations

import difflib
from importlib import metadata
from typing import Any, Mapping

from .errors import BackendError
from .delegation import ENTRY_POINT_GROUP, UnknownBackendError, find_backend
from .partition import Partitioner

PORTABLE = "portable"


def target_names() -> list[str]:
    """The target names users type: ``portable``, then every backend registered in the
    ``lowerflow.backends`` entry-point group (``reference``, ``xnnpack``, plugins') by name."""
    return [PORTABLE, *sorted({e.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP)} - {PORTABLE})]


def check_target(target: str) -> None:
    """Raise BackendError unless ``target`` is ``portable`` or names a backend; an
    unknown one lists :func:`target_names` with the closest as a suggestion."""
    if target == PORTABLE:
        return
    try:
        find_backend(target)
    except UnknownBackendError:
        names = target_names()
        close = difflib.get_close_matches(target, names, n=1) or difflib.get_close_matches(
            target.lower(), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BackendError(f"unknown target {target!r}{hint} (targets: {', '.join(names)})") from None


def partitioner_for(target: str, options: Mapping[str, Any] | None = None) -> Partitioner | None:
    """The partitioner of ``target`` (None for ``portable``); a clear error for unknown targets."""
    if target == PORTABLE:
        if options:
            raise BackendError(f"target {PORTABLE!r} takes no options, got {sorted(options)}")
        return None
    check_target(target)
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
