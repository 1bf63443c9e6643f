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
    computed as torchao's ``IntxUnpackedToInt8Tensor.from_hp`` does (AFFINE algorithm)."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block = tuple(scheme.block_size(weight.shape[1]))
    weight = weight.float().contiguous()  # a transposed view (unfold_linear_weights' views): one weight copied at a time
    with torch.no_grad():
        scale, zero_point = choose_qparams_affine(
            weight.float(), MappingType.SYMMETRIC, block, target_dtype=torch.int8,
            quant_min=scheme.qmin, quant_max=scheme.qmax, zero_point_dtype=torch.int8, keepdim=True,
        )
        qdata = quantize_affine(weight.float(), block, scale, zero_point, output_dtype=torch.int8,
                                quant_min=scheme.qmin, quant_max=scheme.qmax)
    return qdata, scale, zero_point
