"""ExecuTorch's quantized kernel library (``quantized_decomposed::*.out``) for the executor.

A program that keeps q/dq ops at the top level (``to_edge(...).to_executorch()`` of a
PT2E-converted model, or the q/dq left outside a delegate) calls these kernels; ExecuTorch
runs them from ``executorch/kernels/quantized`` and lowerflow here, with the same arithmetic
(ExecuTorch's ``kernels/quantized/cpu/op_*.cpp``), never importing executorch:

    quantize      q = clamp(zp + rint(f32(x * (1f / f32(scale)))), qmin, qmax)   (round half even)
    dequantize    x = f32(q - zp) * f32(scale)                                   (zp absent: 0)
    choose_qparams  min/max (with 0) -> scale = (max - min) / (qmax - qmin) in double,
                  raised to 6.1e-5 for tiny ranges; zp from the side with the smaller error,
                  nudged (rint) into [qmin, qmax]; ``eps`` is ignored as ExecuTorch does
    embedding_byte / embedding_4bit   rows ``indices`` of an int8 / packed int4 table,
                  ``(f32(q) - f32(zp)) * f32(scale)`` per group of a row
                  (:func:`lowering.quant_ops.quantized_embedding`; ``op_embedding*.cpp``)

Schemas are those of ExecuTorch's ``quantized.yaml`` (arguments in order, ``out`` tensors
last); each entry is ``(number of arguments, call, positions written)``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .errors import ExecutorError

SMALL_SCALE = np.float32(6.1e-5)


def _quantize(x: torch.Tensor, scale, zero_point, qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """``quantize_val``; ``scale``/``zero_point`` scalars or tensors broadcasting against ``x``."""
    scale = torch.as_tensor(scale, dtype=torch.float64).to(torch.float32)
    inv = torch.tensor(1.0, dtype=torch.float32) / scale
    q = torch.round(x.to(torch.float32) * inv).to(torch.int64) + torch.as_tensor(zero_point).to(torch.int64)
    return q.clamp(qmin, qmax).to(dtype)


def _dequantize(q: torch.Tensor, scale, zero_point, out_dtype) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float64).to(torch.float32)
    zero = torch.as_tensor(0 if zero_point is None else zero_point).to(torch.int32)
    return ((q.to(torch.int32) - zero).to(torch.float32) * scale).to(out_dtype or torch.float32)


def _write(out: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(out.shape) != tuple(value.shape):
        raise ExecutorError(f"{what}: out tensor has shape {tuple(out.shape)}, the result {tuple(value.shape)}")
    out.copy_(value)


def _channel_shape(x: torch.Tensor, axis: int) -> list[int]:
    shape = [1] * x.dim()
    shape[axis % x.dim()] = -1
    return shape


def quantize_per_tensor(values: list) -> None:
    x, scale, zp, qmin, qmax, dtype, out = values
    _write(out, _quantize(x, float(scale), int(zp), qmin, qmax, out.dtype), "quantize_per_tensor")


def quantize_per_tensor_tensor(values: list) -> None:
    x, scale, zp, qmin, qmax, dtype, out = values
    _write(out, _quantize(x, float(scale.reshape(())), int(zp.reshape(())), qmin, qmax, out.dtype),
           "quantize_per_tensor.Tensor_out")


def dequantize_per_tensor(values: list) -> None:
    q, scale, zp, qmin, qmax, dtype, out_dtype, out = values
    _write(out, _dequantize(q, float(scale), int(zp), out.dtype), "dequantize_per_tensor")


def dequantize_per_tensor_tensor(values: list) -> None:
    q, scale, zp, qmin, qmax, dtype, out_dtype, out = values
    _write(out, _dequantize(q, float(scale.reshape(())), int(zp.reshape(())), out.dtype),
           "dequantize_per_tensor.Tensor_out")


def quantize_per_channel(values: list) -> None:
    x, scales, zps, axis, qmin, qmax, dtype, out = values
    shape = _channel_shape(x, axis)
    _write(out, _quantize(x, scales.reshape(shape), zps.reshape(shape), qmin, qmax, out.dtype),
           "quantize_per_channel")


def dequantize_per_channel(values: list) -> None:
    q, scales, zps, axis, qmin, qmax, dtype, out_dtype, out = values
    shape = _channel_shape(q, axis)
    _write(out, _dequantize(q, scales.reshape(shape), None if zps is None else zps.reshape(shape), out.dtype),
           "dequantize_per_channel")


def quantize_per_token(values: list) -> None:
    x, scales, zps, qmin, qmax, dtype, out = values
    _write(out, _quantize(x, scales, zps, qmin, qmax, out.dtype), "quantize_per_token")


def dequantize_per_token(values: list) -> None:
    q, scales, zps, qmin, qmax, dtype, output_dtype, out = values
    _write(out, _dequantize(q, scales, zps, out.dtype), "dequantize_per_token")


def scale_and_zero_point(lo: float, hi: float, qmin: int, qmax: int) -> tuple[float, int]:
    """ExecuTorch's ``calculate_scale_and_zero_point`` (fp32 min/max, double scale)."""
    lo, hi = min(np.float32(lo), np.float32(0.0)), max(np.float32(hi), np.float32(0.0))
    scale = (float(hi) - float(lo)) / (qmax - qmin)
    if np.float32(scale) == 0.0 or not np.isfinite(np.float32(1.0) / np.float32(scale)):
        scale = 0.1
    if scale < float(SMALL_SCALE):
        original = np.float32(scale)
        scale = float(SMALL_SCALE)
        if lo == 0.0:
            hi = np.float32(SMALL_SCALE * np.float32(qmax - qmin))
        elif hi == 0.0:
            lo = np.float32(-SMALL_SCALE * np.float32(qmax - qmin))
        else:
            amplifier = np.float32(SMALL_SCALE / original)
            lo, hi = np.float32(lo * amplifier), np.float32(hi * amplifier)
    from_min, from_max = qmin - float(lo) / scale, qmax - float(hi) / scale
    error_min, error_max = abs(qmin) - abs(float(lo) / scale), abs(qmax) - abs(float(hi) / scale)
    initial = from_min if error_min < error_max else from_max
    if initial < qmin:
        return scale, qmin
    if initial > qmax:
        return scale, qmax
    return scale, int(np.rint(np.float32(initial)))


def choose_qparams(values: list) -> None:
    x, qmin, qmax, eps, dtype, scale_out, zero_point_out = values
    flat = x.detach().reshape(-1).to(torch.float32)
    if flat.numel() == 0:
        raise ExecutorError("choose_qparams of an empty tensor")
    scale, zp = scale_and_zero_point(float(flat.min()), float(flat.max()), qmin, qmax)
    scale_out.fill_(scale)
    zero_point_out.fill_(zp)


def choose_qparams_per_token_asymmetric(values: list) -> None:
    x, dtype, scale_out, zero_point_out = values
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    pairs = [scale_and_zero_point(float(r.min()), float(r.max()), -128, 127) for r in rows]
    scale_out.copy_(torch.tensor([s for s, _ in pairs], dtype=torch.float64).reshape(scale_out.shape))
    zero_point_out.copy_(torch.tensor([z for _, z in pairs], dtype=torch.int64).reshape(zero_point_out.shape))


def _embedding(bits: int) -> Callable[[list], None]:
    def embedding(values: list) -> None:
        from ..quant_ops import quantized_embedding

        weight, scales, zero_points, _qmin, _qmax, indices, out = values
        result = quantized_embedding(weight, scales, zero_points, indices, bits).to(out.dtype)
        if tuple(out.shape) != tuple(result.shape):
            out.resize_(result.shape)  # a dynamic (DYNAMIC_BOUND) output: the executor emptied it
        out.copy_(result)

    return embedding


#: qualified name -> (number of schema arguments, call, positions of the written arguments).
QUANT_KERNEL_SPECS: dict[str, tuple[int, Callable[[list], None], tuple[int, ...]]] = {
    "quantized_decomposed::quantize_per_tensor.out": (7, quantize_per_tensor, (6,)),
    "quantized_decomposed::quantize_per_tensor.Tensor_out": (7, quantize_per_tensor_tensor, (6,)),
    "quantized_decomposed::dequantize_per_tensor.out": (8, dequantize_per_tensor, (7,)),
    "quantized_decomposed::dequantize_per_tensor.Tensor_out": (8, dequantize_per_tensor_tensor, (7,)),
    "quantized_decomposed::quantize_per_channel.out": (8, quantize_per_channel, (7,)),
    "quantized_decomposed::dequantize_per_channel.out": (9, dequantize_per_channel, (8,)),
    "quantized_decomposed::quantize_per_token.out": (7, quantize_per_token, (6,)),
    "quantized_decomposed::dequantize_per_token.out": (8, dequantize_per_token, (7,)),
    "quantized_decomposed::choose_qparams.Tensor_out": (7, choose_qparams, (5, 6)),
    "quantized_decomposed::choose_qparams_per_token_asymmetric.out": (4, choose_qparams_per_token_asymmetric, (2, 3)),
    "quantized_decomposed::embedding_byte.out": (7, _embedding(8), (6,)),
    "quantized_decomposed::embedding_4bit.out": (7, _embedding(4), (6,)),
}
