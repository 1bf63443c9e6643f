"""Executes reference-backend payloads: nested ``.pte`` programs, on lowerflow's executor."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...runtime import LoadedMethod, load


class ReferenceRuntime:
    """``init(processed, compile_specs) -> handle``; ``execute(handle, args) -> outputs``.

    A handle is the nested program's loaded ``forward`` method: it owns the
    partition's planned memory and mutable buffers, so buffer state persists
    across ``execute`` calls on the same handle.
    """

    def init(self, processed: bytes, compile_specs: Sequence[Any] = ()) -> LoadedMethod:
        return load(processed).method("forward")

    def num_inputs(self, handle: LoadedMethod) -> int:
        return len(handle.inputs)

    def execute(self, handle: LoadedMethod, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return handle.execute(list(args))
