"""How far a quantized program's outputs are from fp32 eager, and whether that is allowed.

verify runs a quantized ``.pte`` against two references:

* the **quantized eager reference** (the quantized program run in torch): the
  runtime must match it within :data:`QUANT_STEPS` steps of each output's int8
  grid (XNNPACK requantizes and rounds on its own; per-row dynamic
  activations round differently), see :func:`quantized_tolerance`;
* **fp32 eager** (the model itself): the error is reported, per output, as
  ``max_error`` = max |out - fp32| / max |fp32| and ``sqnr_db`` =
  10·log10(Σ fp32² / Σ (out - fp32)²), and held to the model's ``min_sqnr`` /
  ``max_error`` (:func:`threshold_error`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

#: Steps of an output's int8 grid the runtime may differ from the quantized eager
#: reference by (1-LSB requantization differences accumulate over layers).
QUANT_STEPS = 4


def quantized_tolerance(reference: torch.Tensor) -> float:
    """The absolute tolerance of one output: :data:`QUANT_STEPS` steps of an int8 grid
    spanning the reference's range (at least 1e-5)."""
    if not reference.is_floating_point() or reference.numel() == 0:
        return 0.0
    ref = reference.detach().double()
    step = (ref.max() - ref.min()).item() / 255.0
    return max(QUANT_STEPS * step, 1e-5)


def output_error(actual: torch.Tensor, fp32: torch.Tensor) -> dict[str, float | None]:
    """``{"max_error", "sqnr_db"}`` of one output against fp32 eager (None: not float)."""
    if not fp32.is_floating_point() or fp32.numel() == 0:
        return {"max_error": None, "sqnr_db": None}
    a, r = actual.detach().double(), fp32.detach().double()
    diff = a - r
    scale = r.abs().max().item()
    max_error = diff.abs().max().item() / scale if scale > 0 else diff.abs().max().item()
    noise = diff.pow(2).sum().item()
    signal = r.pow(2).sum().item()
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return {"max_error": max_error, "sqnr_db": sqnr}


def outputs_error(actual: Sequence[torch.Tensor], fp32: Sequence[torch.Tensor]) -> dict[str, float | None]:
    """The worst output: largest ``max_error``, smallest ``sqnr_db`` (JSON-safe: inf -> None)."""
    errors = [output_error(a, r) for a, r in zip(actual, fp32)]
    max_errors = [e["max_error"] for e in errors if e["max_error"] is not None]
    sqnrs = [e["sqnr_db"] for e in errors if e["sqnr_db"] is not None]
    worst_sqnr = min(sqnrs) if sqnrs else None
    return {
        "max_error": max(max_errors) if max_errors else None,
        "sqnr_db": None if worst_sqnr is None or math.isinf(worst_sqnr) else round(worst_sqnr, 3),
    }


def threshold_error(error: dict[str, float | None], min_sqnr: float | None, max_error: float | None) -> str | None:
    """Why ``error`` (:func:`outputs_error`) breaks the thresholds; None when it does not."""
    sqnr, worst = error.get("sqnr_db"), error.get("max_error")
    if min_sqnr is not None and sqnr is not None and sqnr < min_sqnr:
        return f"SQNR {sqnr:.1f} dB against fp32 eager is below min_sqnr {min_sqnr:g} dB"
    if max_error is not None and worst is not None and worst > max_error:
        return f"error {worst:.4g} (max |Δ| / max |fp32|) against fp32 eager is above max_error {max_error:g}"
    return None
