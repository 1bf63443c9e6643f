"""lowering.quantize.weights.quantize_weight is torchao's symmetric weight quantization, bit for bit.

The cold lowering (the dynamic recipes' linears, quantized embeddings) and a weights-only update
(lowering.rebind: every weight quantized again) both compute it; a weights-only ``.ptd`` must equal
a cold lowering's byte for byte, and a cold lowering must give the bytes it gave with torchao's ops.
"""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

from lowering.quantize.dynamic import weight_scheme
from lowering.quantize.embedding import SCHEMES
from lowering.quantize.recipes import parse_recipe
from lowering.quantize.weights import WeightScheme, quantize_weight


def torchao_quantize(weight: torch.Tensor, scheme: WeightScheme):
    """What quantize_weight computed with torchao's ops (session 17): the reference."""
    block = tuple(scheme.block_size(weight.shape[1]))
    weight = weight.float().contiguous()
    scale, zero_point = choose_qparams_affine(
        weight, MappingType.SYMMETRIC, block, target_dtype=torch.int8, quant_min=scheme.qmin,
        quant_max=scheme.qmax, zero_point_dtype=torch.int8, keepdim=True)
    qdata = quantize_affine(weight, block, scale, zero_point, output_dtype=torch.int8, quant_min=scheme.qmin,
                            quant_max=scheme.qmax)
    return qdata, scale, zero_point


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    edge = torch.randn(8, 64)
    edge[0] = 0.0                          # an all-zero row: the scale is clamped to eps
    edge[1, :32] = -0.0                    # a block of negative zeros
    edge[2, :5] = 1e-39                    # subnormals
    edge[3] = torch.linspace(-1, 1, 64)    # values on rounding ties
    edge[4, 7] = 3e38                      # a huge value beside small ones
    edge[5] = -edge[5].abs()               # only negative values
    edge[6] = edge[6].abs()                # only positive values
    return {"randn": torch.randn(96, 128) * 0.02, "edge": edge,
            "bf16": torch.randn(16, 64).to(torch.bfloat16), "transposed": torch.randn(128, 32).t()}


SCHEMES_TESTED = {"8da4w": weight_scheme(parse_recipe("8da4w")), "int8-dynamic": weight_scheme(parse_recipe("int8-dynamic")),
                  **{f"embedding {k}": v[0] for k, v in SCHEMES.items()}}


@pytest.mark.parametrize("scheme", list(SCHEMES_TESTED.values()), ids=list(SCHEMES_TESTED))
def test_quantize_weight_is_torchaos_bit_for_bit(scheme):
    for name, weight in weights().items():
        got, expected = quantize_weight(weight, scheme), torchao_quantize(weight, scheme)
        for what, a, b in zip(("qdata", "scale", "zero point"), got, expected):
            assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), (name, what)
            assert torch.equal(a, b), f"{name}: {what} differs from torchao's"


def test_quantize_weight_leaves_its_weight_alone():
    weight = torch.randn(32, 64)
    before = weight.clone()
    quantize_weight(weight, WeightScheme(32, -8, 7))
    assert torch.equal(weight, before)
