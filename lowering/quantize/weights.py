"""Weight quantization shared by the dynamic recipes' linears (:mod:`.dynamic`) and the
quantized embedding tables (:mod:`.embedding`): a :class:`WeightScheme` (block, range)
and the symmetric per-block quantization torchao computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightScheme:
    """How a weight ``[N, K]`` is quantized: blocks ``[1, block]`` (block 0 = K), range."""

    block: int
    qmin: int
    qmax: int

    def block_size(self, k: int) -> list[int]:
        return [1, self.block or k]


def quantize_weight(weight: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qdata int8 [N, K], scale fp32 [N, K/b], zero_point int8 [N, K/b])``, symmetric,
    bit-identical to torchao's ``choose_qparams_affine`` + ``quantize_affine`` (SYMMETRIC, as
    ``IntxUnpackedToInt8Tensor.from_hp`` computes them; tests/test_quantize_weights.py), in
    place on one fp32 copy of the weight (torchao's custom ops cost several temporaries and a
    dispatch each: a weights-only update quantizes every weight again, :mod:`lowering.rebind`)::

        w [N, K] -> blocks [N, K/b, b];  s = clamp(max(-min(lo, 0), max(hi, 0)) / ((qmax - qmin) / 2), eps)
        q = clamp(round(w * (1 / s)) + zp, qmin, qmax)       zp = int((qmax + qmin + 1) / 2)
    """
    n, k = weight.shape
    block = scheme.block or k
    with torch.no_grad():
        # a transposed view (unfold_linear_weights' views): one weight copied at a time
        w = weight.detach().to(torch.float32).contiguous().view(n, k // block, block)
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scale = torch.maximum(torch.minimum(lo, torch.zeros_like(lo)).neg_(), hi.clamp_(min=0))
        scale.div_(float(scheme.qmax - scheme.qmin) / 2).clamp_(min=torch.finfo(torch.float32).smallest_normal)
        zero = int((scheme.qmax + scheme.qmin + 1) / 2)
        x = w * (1.0 / scale)
        x.round_()
        if zero:
            x.add_(zero)
        qdata = x.clamp_(scheme.qmin, scheme.qmax).to(torch.int8).view(n, k)
    return qdata, scale.view(n, k // block), torch.full((n, k // block), zero, dtype=torch.int8)
