"""Stage 5 — backend preprocess, wrapped in a :class:`LoweredBackendModule`.

A backend is a :class:`BackendDetails` subclass whose ``preprocess`` turns a
partition's ExportedProgram into the bytes its runtime executes.  Backends are
found by class name (as in ExecuTorch: ``DelegationSpec("ReferenceBackend")``)
or by a name registered in the ``lowerflow.backends`` entry-point group
(``reference = lowering.backends.reference:ReferenceBackend``).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from importlib import metadata
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram

from .delegate import executorch_call_delegate
from .errors import BackendError
from .partition import CompileSpec

ENTRY_POINT_GROUP = "lowerflow.backends"


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    processed_bytes: bytes
    debug_handle_map: dict[int, tuple[int, ...]] | None = None


class BackendDetails(abc.ABC):
    """A backend's ahead-of-time half: ``preprocess`` a partition into bytes."""

    @staticmethod
    @abc.abstractmethod
    def preprocess(
        edge_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult: ...


def find_backend(backend_id: str) -> type[BackendDetails]:
    """The BackendDetails subclass named ``backend_id`` (class name or entry-point name)."""
    for cls in _all_subclasses(BackendDetails):
        if cls.__name__ == backend_id:
            return cls
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == backend_id:
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
    known = sorted({c.__name__ for c in _all_subclasses(BackendDetails)} | set(_entry_point_names()))
    raise BackendError(f"unknown backend {backend_id!r}; known backends: {known}")


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


class LoweredBackendModule(torch.nn.Module):
    """A partition after preprocess: its original program plus the backend's bytes.

    Calling it runs ``executorch_call_delegate(self, *args)``, which eagerly runs
    the original program, so a module holding lowered modules can be called,
    traced and re-exported like any other.
    """

    def __init__(
        self,
        edge_program: ExportedProgram,
        backend_id: str,
        processed_bytes: bytes,
        compile_specs: Sequence[CompileSpec],
    ) -> None:
        super().__init__()
        self._original_exported_program = edge_program
        self._backend_id = backend_id
        self._processed_bytes = bytes(processed_bytes)
        self._compile_specs = list(compile_specs)

    @property
    def original_module(self) -> ExportedProgram:
        return self._original_exported_program

    @property
    def backend_id(self) -> str:
        return self._backend_id

    @property
    def processed_bytes(self) -> bytes:
        return self._processed_bytes

    @property
    def compile_specs(self) -> list[CompileSpec]:
        return self._compile_specs

    def forward(self, *args: Any) -> Any:
        return executorch_call_delegate(self, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> "LoweredBackendModule":
        # nn.Module's default deepcopy copies __dict__ wholesale; build a proper
        # new module instead, with its own copy of the original program.
        copied = LoweredBackendModule(
            copy.deepcopy(self._original_exported_program, memo),
            self._backend_id,
            self._processed_bytes,
            copy.deepcopy(self._compile_specs, memo),
        )
        memo[id(self)] = copied
        return copied

    def extra_repr(self) -> str:
        return f"backend_id={self._backend_id!r}, processed_bytes={len(self._processed_bytes)}"


def preprocess(
    edge_program: ExportedProgram,
    backend_id: str,
    compile_specs: Sequence[CompileSpec] = (),
    *,
    partition: str = "<whole program>",
) -> LoweredBackendModule:
    """Run the backend's preprocess on ``edge_program`` and wrap the result."""
    backend = find_backend(backend_id)
    try:
        result = backend.preprocess(edge_program, list(compile_specs))
    except Exception as exc:
        raise BackendError(
            f"backend {backend.__name__!r} failed to preprocess partition {partition!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(result, PreprocessResult) or not isinstance(
        result.processed_bytes, (bytes, bytearray)
    ):
        raise BackendError(
            f"backend {backend.__name__!r}: preprocess of partition {partition!r} must return "
            f"PreprocessResult(processed_bytes: bytes), got {type(result).__name__}"
        )
    return LoweredBackendModule(edge_program, backend.__name__, result.processed_bytes, compile_specs)
