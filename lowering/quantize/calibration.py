"""Calibration batches: read them once, check each against the program's inputs.

``calibration`` is an iterable of input tuples, or a callable returning one.
A batch must have as many inputs as the program's user inputs, and each tensor
the dtype, rank and static sizes of its placeholder; a mismatch is a QuantizeError naming the
batch index and the input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..errors import QuantizeError


def user_input_values(program: ExportedProgram) -> list[tuple[str, Any]]:
    """``(name, meta value)`` of each user input placeholder, in order."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    return [
        (node.name, node.meta.get("val"))
        for node, spec in zip(placeholders, program.graph_signature.input_specs)
        if spec.kind == InputKind.USER_INPUT
    ]


def calibration_batches(program: ExportedProgram, calibration: Any, label: str = "program") -> list[tuple]:
    """The checked batches (a list of tuples) of ``calibration``; ``[]`` for None."""
    if calibration is None:
        return []
    if callable(calibration):
        try:
            calibration = calibration()
        except Exception as exc:
            raise QuantizeError(f"{label}: the calibration callable failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(calibration, torch.Tensor) or isinstance(calibration, (str, bytes)):
        raise QuantizeError(
            f"{label}: calibration must be an iterable of input tuples (or a callable returning one), "
            f"got {type(calibration).__name__}"
        )
    try:
        batches = list(calibration)
    except TypeError:
        raise QuantizeError(
            f"{label}: calibration must be an iterable of input tuples (or a callable returning one), "
            f"got {type(calibration).__name__}"
        ) from None
    expected = user_input_values(program)
    return [_check_batch(i, batch, expected, label) for i, batch in enumerate(batches)]


def _check_batch(index: int, batch: Any, expected: list[tuple[str, Any]], label: str) -> tuple:
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)):
        raise QuantizeError(f"{label}: calibration batch {index} must be a tuple of inputs, got {type(batch).__name__}")
    if len(batch) != len(expected):
        raise QuantizeError(
            f"{label}: calibration batch {index} has {len(batch)} input(s), the program takes {len(expected)} "
            f"({', '.join(name for name, _ in expected)})"
        )
    for value, (name, meta) in zip(batch, expected):
        if not isinstance(meta, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            raise QuantizeError(
                f"{label}: calibration batch {index}, input {name!r}: expected a tensor, got {type(value).__name__}"
            )
        if value.dtype != meta.dtype or value.dim() != meta.dim():
            raise QuantizeError(
                f"{label}: calibration batch {index}, input {name!r}: got {_describe(value)}, "
                f"the program takes {_describe(meta)}"
            )
        if any(isinstance(want, int) and got != want for got, want in zip(value.shape, meta.shape)):
            raise QuantizeError(
                f"{label}: calibration batch {index}, input {name!r}: got {_describe(value)}, "
                f"the program takes {_describe(meta)} (its static sizes are fixed at export)"
            )
    return tuple(batch)


def _describe(t: torch.Tensor) -> str:
    shape = ", ".join(str(s) for s in t.shape)
    return f"{str(t.dtype).removeprefix('torch.')} rank {t.dim()} [{shape}]"
