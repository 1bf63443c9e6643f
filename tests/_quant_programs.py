"""Quantized .pte files made by ExecuTorch itself (the oracle), for the runtime tests.

Recipes: PT2E static int8 (XNNPACKQuantizer, per-channel), PT2E dynamic int8, and
torchao 8da4w (int8 dynamic activations, int4 weights in groups of 32); delegated to
XNNPACK with ``to_edge_transform_and_lower``, or kept portable with ``to_edge``
(quantized_decomposed q/dq ops at the top level).  Built once per process.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class CNN(nn.Module):
    """conv-BN-ReLU, maxpool, conv-BN-ReLU, conv-BN + residual add + ReLU, GAP, linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c3, self.b3 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)
        for bn in (self.b1, self.b2, self.b3):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        y = torch.relu(self.b2(self.c2(x)))
        y = torch.relu(self.b3(self.c3(y)) + y)
        pooled = F.adaptive_avg_pool2d(y, 1)
        return self.fc(pooled.flatten(1)), pooled


class Mixed(nn.Module):
    """Depthwise and transposed convs, cat, hardtanh, an fp32 island (sigmoid), mul."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 16, 1)
        self.up = nn.ConvTranspose2d(32, 32, 2, stride=2)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        x = self.c(x)
        y = torch.cat([F.hardtanh(self.dw(x), 0.0, 6.0), self.pw(x)], 1)
        y = self.up(y)
        y = y * torch.sigmoid(y)
        y = y * y
        return self.fc(y.mean((2, 3))), y


class SharedInput(nn.Module):
    """One conv output feeds a 3x3 and a 1x1 conv: with dynamic quantization they share one
    qdint8 value, which XNNPACK quantizes per pixel for the 1x1 conv (defined as a fully
    connected node) while the 3x3 conv reads it per image."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 16, 3, padding=1)
        self.k3, self.k1 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        x = self.c(x)
        return torch.cat([self.k3(x), self.k1(x)], 1)


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS = {"mlp": (MLP, (4, 64)), "cnn": (CNN, (1, 3, 16, 16)), "mixed": (Mixed, (1, 3, 8, 8)),
          "shared": (SharedInput, (1, 3, 8, 8)),
          "encoder": (encoder, (1, 16, 64))}
RECIPES = ("static", "dynamic", "8da4w", "8da4w-axis")


def model_and_input(name: str):
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    return factory().eval(), torch.randn(shape)


def _pt2e(model, example: tuple, dynamic: bool):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = torch.export.export(model, example).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic))
    prepared = prepare_pt2e(graph, quantizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        prepared(*[torch.randn(t.shape, generator=generator) for t in example])
    return torch.export.export(convert_pt2e(prepared), example)


def _8da4w(model, example: tuple, per_axis: bool = False):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    granularity = PerAxis(0) if per_axis else PerGroup(32)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=granularity))
    return torch.export.export(model, example)


def exported(name: str, recipe: str):
    model, x = model_and_input(name)
    if recipe.startswith("8da4w"):
        return _8da4w(model, (x,), per_axis=recipe == "8da4w-axis"), x
    return _pt2e(model, (x,), recipe == "dynamic"), x


@functools.lru_cache(maxsize=None)
def delegated_pte(name: str, recipe: str) -> tuple[bytes, torch.Tensor]:
    """(.pte delegated to XNNPACK by ExecuTorch, the input)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program, x = exported(name, recipe)
        pte = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    return bytes(pte), x


@functools.lru_cache(maxsize=None)
def portable_pte(name: str, recipe: str) -> tuple[bytes, torch.Tensor]:
    """(.pte with the quantized_decomposed ops at the top level, no delegate, the input)."""
    import executorch.kernels.quantized  # noqa: F401  (out variants for to_executorch, kernels for the runtime)
    from executorch.exir import to_edge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program, x = exported(name, recipe)
        pte = to_edge(program).to_executorch().buffer
    return bytes(pte), x
