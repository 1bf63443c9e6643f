"""Stage 5 — backend preprocess, wrapped in a :class:`LoweredBackendModule`.

A backend is a :class:`BackendDetails` subclass whose ``preprocess`` turns a
partition's ExportedProgram into the bytes its runtime executes.  Backends are
found by class name (as in ExecuTorch: ``DelegationSpec("ReferenceBackend")``)
or by a name registered in the ``lowerflow.backends`` entry-point group
(``reference = lowering.backends.reference:ReferenceBackend``).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram

from .delegate import executorch_call_delegate
from .delegation import (  # re-exported: their historical home
    ENTRY_POINT_GROUP,
    BackendDetails,
    CompileSpec,
    PreprocessResult,
    canonical_backend_id,
    find_backend,
)
from .delegation import named_blob
from .errors import BackendError

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendDetails",
    "CompileSpec",
    "LoweredBackendModule",
    "PreprocessResult",
    "canonical_backend_id",
    "find_backend",
    "preprocess",
]


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
        named_data: Mapping[str, bytes] | None = None,
    ) -> None:
        super().__init__()
        self._original_exported_program = edge_program
        self._backend_id = backend_id
        self._processed_bytes = bytes(processed_bytes)
        self._compile_specs = list(compile_specs)
        self._named_data = {k: named_blob(v) for k, v in sorted((named_data or {}).items())}

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

    @property
    def named_data(self) -> dict[str, bytes]:
        """Blobs the payload refers to by key (weights), stored in the program's named data."""
        return self._named_data

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
            self._named_data,
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
    return LoweredBackendModule(
        edge_program, backend.__name__, result.processed_bytes, compile_specs, result.named_data
    )
