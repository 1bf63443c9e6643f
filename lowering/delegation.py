"""The delegation types every stage shares, below partition and preprocess.

- :class:`CompileSpec`, :class:`DelegationSpec`: what a partitioner says about a
  partition (which backend, which options);
- :class:`PreprocessResult`, :class:`BackendDetails`: a backend's ahead-of-time
  half and what it returns (processed bytes plus named data blobs);
- :func:`find_backend`: the registry (class name or ``lowerflow.backends`` entry
  point);
- :data:`TAG`: the ``node.meta`` key naming a node's partition.

``lowering.partition`` and ``lowering.lowered_module`` both import from here and
re-export these names, so neither imports the other.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from importlib import metadata
from typing import Any, Mapping

from torch.export import ExportedProgram

from .errors import BackendError

#: Entry-point group of backends (``name = module:BackendDetailsSubclass``).
ENTRY_POINT_GROUP = "lowerflow.backends"

#: The node.meta key a partitioner sets (stage 2); stages 3 and 4 read it.
#: Here, below every stage, so that those read it without importing partition.
TAG = "delegation_tag"
#: ``node.meta`` key set on a partition's copy of a constant the top-level
#: program keeps too: a backend that may lay the data out either way picks the
#: original's layout, so that the ``.pte`` stores the bytes once.
SHARED_WITH_TOP_LEVEL = "shared_with_top_level"
#: ``node.meta`` key set on a buffer placeholder that another method of the program
#: writes (methods sharing their mutable buffers, e.g. cross-attention keys an
#: ``encoder`` method stores and a ``text_decoder`` reads): it is state, read at run
#: time, never constant data a partition may take (:func:`lowering.methods.mark_shared_state`).
SHARED_STATE = "shared_state"


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """One backend option: a key and its raw bytes (as in ExecuTorch)."""

    key: str
    value: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not isinstance(self.value, (bytes, bytearray)):
            raise TypeError(
                f"CompileSpec(key={self.key!r}): key must be str and value bytes, "
                f"got {type(self.key).__name__} and {type(self.value).__name__}"
            )
        object.__setattr__(self, "value", bytes(self.value))


@dataclasses.dataclass(frozen=True)
class DelegationSpec:
    """Which backend lowers a partition, and with which compile specs."""

    backend_id: str
    compile_specs: tuple[CompileSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "compile_specs", tuple(self.compile_specs))


#: The compile spec that asks a backend for external weights: its named data go to the
#: program's ``.ptd`` under stable keys (the weight's name and role, never its bytes), so
#: a retrain of the same program binds to the same keys (:mod:`lowering.external`).
EXTERNAL_WEIGHTS_SPEC = CompileSpec("external_weights", b"\x01")


def with_external_weights(spec: DelegationSpec) -> DelegationSpec:
    """``spec`` with :data:`EXTERNAL_WEIGHTS_SPEC` (once)."""
    if any(s.key == EXTERNAL_WEIGHTS_SPEC.key for s in spec.compile_specs):
        return spec
    return DelegationSpec(spec.backend_id, tuple(spec.compile_specs) + (EXTERNAL_WEIGHTS_SPEC,))


def named_data_key(data: bytes) -> str:
    """The key ExecuTorch's backends give a blob of named data: its sha256 hex digest."""
    return hashlib.sha256(data).hexdigest()


def named_blob(data: Any) -> bytes | memoryview:
    """A blob of named data as a lowered module keeps it: bytes, or a read-only memoryview
    (a weight tensor's memory, :func:`lowering.tensor_blobs.tensor_memory`) as it is, so a
    weight is not copied until the ``.pte`` is joined; anything else copied to bytes."""
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        return data
    return bytes(data)


def same_blob(a: Any, b: Any) -> bool:
    """Whether two blobs of named data hold the same bytes (without copying either)."""
    return a is b or (len(a) == len(b) and hashlib.sha256(a).digest() == hashlib.sha256(b).digest())


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    """What ``BackendDetails.preprocess`` returns.

    ``named_data`` maps keys to blobs (weights) the payload refers to by key (bytes, or
    read-only views of the weights' memory: :func:`named_blob`); they are stored in the program's ``named_data`` table, one segment per distinct
    blob, and handed to the backend's runtime when it loads the delegate.
    """

    processed_bytes: bytes
    debug_handle_map: dict[int, tuple[int, ...]] | None = None
    named_data: Mapping[str, bytes] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        named = {}
        for key, blob in dict(self.named_data or {}).items():
            if not isinstance(key, str) or not isinstance(blob, (bytes, bytearray, memoryview)):
                raise TypeError(
                    f"PreprocessResult.named_data: key {key!r} must be str and its blob bytes, "
                    f"got {type(key).__name__} and {type(blob).__name__}"
                )
            named[key] = named_blob(blob)
        object.__setattr__(self, "named_data", dict(sorted(named.items())))


class BackendDetails(abc.ABC):
    """A backend's ahead-of-time half: ``preprocess`` a partition into bytes."""

    @staticmethod
    @abc.abstractmethod
    def preprocess(
        edge_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult: ...


class UnknownBackendError(BackendError):
    """No backend has that class name or entry-point name."""


#: Backends found by entry-point name in this process (``reference`` -> ReferenceBackend).
_BY_ENTRY_POINT: dict[str, type[BackendDetails]] = {}


def find_backend(backend_id: str) -> type[BackendDetails]:
    """The BackendDetails subclass named ``backend_id`` (class name or entry-point name)."""
    for cls in _all_subclasses(BackendDetails):
        if cls.__name__ == backend_id:
            return cls
    if backend_id in _BY_ENTRY_POINT:
        return _BY_ENTRY_POINT[backend_id]
    entries = list(metadata.entry_points(group=ENTRY_POINT_GROUP))  # 25-50 ms: scans every distribution
    for entry in entries:
        if entry.name == backend_id:
            _BY_ENTRY_POINT[backend_id] = _load_entry(backend_id, entry)
            return _BY_ENTRY_POINT[backend_id]
    # A backend known by class name whose package is not imported yet: load the
    # registered backends once and look again.
    for entry in entries:
        try:
            cls = entry.load()
        except Exception:
            continue
        if isinstance(cls, type) and cls.__name__ == backend_id and issubclass(cls, BackendDetails):
            return cls
    known = sorted({c.__name__ for c in _all_subclasses(BackendDetails)} | {e.name for e in entries})
    raise UnknownBackendError(f"unknown backend {backend_id!r}; known backends: {known}")


def _load_entry(backend_id: str, entry) -> type[BackendDetails]:
    try:
        cls = entry.load()
    except Exception as exc:
        raise BackendError(
            f"backend {backend_id!r}: entry point {entry.value!r} failed to load: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BackendDetails)):
        raise BackendError(
            f"backend {backend_id!r}: entry point {entry.value!r} is not a BackendDetails subclass"
        )
    return cls


def _all_subclasses(cls: type) -> list[type]:
    found, stack = [], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if not getattr(sub, "__abstractmethods__", None):
            found.append(sub)
        stack.extend(sub.__subclasses__())
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def _entry_point_names() -> list[str]:
    return [e.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP)]


def canonical_backend_id(backend_id: str) -> str:
    """The id written into programs: the backend class's name."""
    return find_backend(backend_id).__name__


__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendDetails",
    "CompileSpec",
    "DelegationSpec",
    "EXTERNAL_WEIGHTS_SPEC",
    "PreprocessResult",
    "UnknownBackendError",
    "canonical_backend_id",
    "find_backend",
    "named_data_key",
    "with_external_weights",
]
