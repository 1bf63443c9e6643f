"""How far a quantized program's outputs are from fp32 eager, and whether that is allowed.

verify runs a quantized ``.pte`` against two references:

* the **quantized eager reference** (the quantized program run in torch): the
  runtime must match it within :data:`QUANT_STEPS` steps of each output's int8
  grid (XNNPACK requantizes and rounds on its own; per-row dynamic
  activations round differently), or within how far the reference itself moves
  when its activation scales are nudged by a rounding, whichever is larger
  (a deep model amplifies those 1-LSB flips), see :func:`quantized_tolerance`;
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
#: How many times the nudged reference's distance a runtime may be from the reference: one
#: nudge is one draw of which activations flip, and a runtime's flips are others (measured:
#: runtime ÷ nudged 0.45 on SmolLM2's widths at 8 layers, 1.24 on an 8-layer decoder of
#: hidden 256 with init range 0.1, tests/test_quantized_tolerance.py).
NUDGE_MARGIN = 2.0


def quantized_tolerance(reference: torch.Tensor, nudged: torch.Tensor | None = None) -> float:
    """The absolute tolerance of one output: :data:`QUANT_STEPS` steps of an int8 grid
    spanning the reference's range (at least 1e-5), or :data:`NUDGE_MARGIN` times
    max |nudged - reference| if larger.

    ``nudged``: the same output of the reference run with every dynamic activation scale
    moved by 2**-16 (:func:`lowering.quantize.dynamic.nudged_activation_scales`), which flips
    the few activations that close to a rounding boundary by one step, as a runtime's own
    qparams arithmetic does.  A shallow model barely moves (a tiny decoder: ~1e-6, so the
    int8-grid bound decides); a deep one amplifies each flip layer by layer — SmolLM2-135M's
    30 random layers under 8da4w: ExecuTorch's XNNPACK and lowerflow's runtime each 0.1–0.18
    from the reference and as far from each other, the nudged reference as far, while the
    reference is 2.5 from fp32 (issue 27).  A wrong program (a lost layer, wrong scales or
    zero points) is off by the quantization error itself, far beyond either bound."""
    if not reference.is_floating_point() or reference.numel() == 0:
        return 0.0
    ref = reference.detach().double()
    step = (ref.max() - ref.min()).item() / 255.0
    spread = 0.0 if nudged is None else NUDGE_MARGIN * (nudged.detach().double() - ref).abs().max().item()
    return max(QUANT_STEPS * step, 1e-5, spread)


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
