"""Quantization parameters read from q/dq nodes: what each q/dq op means to XNNPACK.

The ops of a quantized edge program (see ``/work/notes/quant-contract.md``)::

    %q  = quantized_decomposed.quantize_per_tensor.default(%x, 0.026, 19, -128, 127, torch.int8)
    %dq = quantized_decomposed.dequantize_per_tensor.default(%q, 0.026, 19, -128, 127, torch.int8)
    %w  = quantized_decomposed.dequantize_per_channel.default(%w_i8, %scales, %zps, 0, -127, 127, torch.int8)
    %w4 = torchao.dequantize_affine(%qdata, [1, 32], %scale, %zp, torch.int8, -8, 7)

- :class:`QParams`: the scale and zero point of a per-tensor activation q/dq;
- :class:`QWeight`: a weight's integer data and scales (per tensor, per channel,
  or per group of 4-bit values), read from its dq node and static operands;
  :func:`weight_of` refuses what XNNPACK would run wrong (a non-zero weight
  zero point, a group size not a multiple of 32, 8-bit groups) with
  :class:`QuantWeightError`;
- op groups by role (:data:`ACT_Q`, :data:`ACT_DQ`, :data:`WEIGHT_DQ`,
  :data:`DYNAMIC_Q`, ...).  torchao's ops are matched by name, so this package
  needs no torchao import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines quantized_decomposed ops)

qd = torch.ops.quantized_decomposed

ACT_Q = qd.quantize_per_tensor.default
ACT_DQ = qd.dequantize_per_tensor.default
#: Dynamic (per-token at run time) activation quantization.
CHOOSE_QPARAMS = {qd.choose_qparams.tensor, "torchao::choose_qparams_affine"}
DYNAMIC_Q = {qd.quantize_per_tensor.tensor, "torchao::quantize_affine"}
DYNAMIC_DQ = {qd.dequantize_per_tensor.tensor, "torchao::dequantize_affine"}
#: Ops that dequantize a static weight.
WEIGHT_DQ = {qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default, "torchao::dequantize_affine"}


def op_key(target: Any) -> Any:
    """``target`` itself for ATen and quantized_decomposed ops; ``"torchao::name"`` for torchao's."""
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.name.startswith("torchao::"):
        return schema.name
    return target


def is_op(node: Any, ops: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    key = op_key(node.target)
    return key in ops if isinstance(ops, (set, frozenset, tuple)) else key == ops


class QuantWeightError(ValueError):
    """A quantized weight XNNPACK cannot run correctly; the message says why."""


@dataclass(frozen=True)
class QParams:
    """Per-tensor int8 activation parameters."""

    scale: float
    zero_point: int

    def same(self, other: "QParams | None") -> bool:
        return other is not None and self.scale == other.scale and self.zero_point == other.zero_point


def act_qparams(node: torch.fx.Node) -> QParams | None:
    """The parameters of a per-tensor int8 activation q or dq with literal scale and zero point."""
    if not (is_op(node, ACT_Q) or is_op(node, ACT_DQ)):
        return None
    _, scale, zp, qmin, qmax, dtype = node.args[:6]
    if isinstance(scale, torch.fx.Node) or isinstance(zp, torch.fx.Node):
        return None
    if dtype != torch.int8 or (qmin, qmax) != (-128, 127):
        return None
    return QParams(float(scale), int(zp))


@dataclass
class QWeight:
    """A static weight's integers and scales, in the weight's own (PyTorch) layout.

    ``kind``: ``"tensor"`` (one scale), ``"channel"`` (one scale per index of
    ``axis``) or ``"group"`` (``scales[o, g]`` for columns ``g*group_size ...``
    of row ``o``, 2-D weights only).  ``bits`` is 4 for values in [-8, 7].
    """

    data: torch.Tensor  # int8
    scales: torch.Tensor  # float32: [1], [C] or [N, K / group_size]
    kind: str
    axis: int = 0
    group_size: int = 0
    bits: int = 8

    def dequantized(self) -> torch.Tensor:
        w = self.data.to(torch.float32)
        if self.kind == "tensor":
            return w * self.scales.reshape(())
        if self.kind == "channel":
            shape = [1] * w.dim()
            shape[self.axis] = -1
            return w * self.scales.reshape(shape)
        return w * self.scales.repeat_interleave(self.group_size, dim=1)


def dequantized_constant(node: torch.fx.Node, tensor_of) -> torch.Tensor | None:
    """The fp32 values of a per-tensor / per-channel dq of static data read by an op computing
    in fp32 (any zero point: it is not a weight XNNPACK reads quantized); None for other dqs."""
    if is_op(node, qd.dequantize_per_tensor.default):
        _, scale, zp = node.args[:3]
        return (tensor_of(node.args[0]).to(torch.float32) - float(zp)) * float(scale)
    if is_op(node, qd.dequantize_per_channel.default):
        data, scales, zps, axis = tensor_of(node.args[0]), tensor_of(node.args[1]), node.args[2], int(node.args[3])
        shape = [1] * data.dim()
        shape[axis % data.dim()] = -1
        zero = tensor_of(zps).to(torch.float32).reshape(shape) if zps is not None else 0.0
        return (data.to(torch.float32) - zero) * scales.to(torch.float32).reshape(shape)
    return None


def weight_of(node: torch.fx.Node, tensor_of) -> QWeight:
    """The :class:`QWeight` of a weight dq node; ``tensor_of(arg)`` gives a static operand's tensor.

    Raises :class:`QuantWeightError` for weights XNNPACK would compute wrong.
    """
    if is_op(node, qd.dequantize_per_tensor.default):
        _, scale, zp, qmin, qmax, dtype = node.args[:6]
        _check_int8(dtype)
        if int(zp) != 0:
            raise QuantWeightError(f"weight zero point {int(zp)} is not 0 (XNNPACK weights are symmetric)")
        return QWeight(tensor_of(node.args[0]), torch.tensor([float(scale)]), "tensor", bits=_bits(qmin, qmax))
    if is_op(node, qd.dequantize_per_channel.default):
        _, scales, zps, axis, qmin, qmax, dtype = node.args[:7]
        _check_int8(dtype)
        _check_zero(tensor_of(zps))
        data = tensor_of(node.args[0])
        return QWeight(data, tensor_of(scales).to(torch.float32).reshape(-1), "channel", int(axis) % data.dim(),
                       bits=_bits(qmin, qmax))
    if is_op(node, "torchao::dequantize_affine"):
        return _affine_weight(node, tensor_of)
    raise QuantWeightError(f"{node.target} is not a weight dequantization")


def _affine_weight(node: torch.fx.Node, tensor_of) -> QWeight:
    args = list(node.args) + [None] * 8
    qdata, block, scale, zp, dtype, qmin, qmax = args[:7]
    qmin = node.kwargs.get("quant_min", qmin)
    qmax = node.kwargs.get("quant_max", qmax)
    _check_int8(dtype)
    data = tensor_of(qdata)
    if data.dim() != 2 or len(block) != 2 or int(block[0]) != 1:
        raise QuantWeightError(f"block size {list(block)} of a {data.dim()}-D weight (only [1, K] or [1, group])")
    if zp is not None:
        _check_zero(tensor_of(zp))
    n, k = data.shape
    group = int(block[1])
    scales = tensor_of(scale).to(torch.float32).reshape(n, -1)
    bits = _bits(qmin, qmax)
    if group == k and (bits == 8 or k % 32 != 0):  # 4-bit per channel: qcint4 when K is no block size
        return QWeight(data, scales.reshape(-1), "channel", 0, bits=bits)
    if bits != 4:
        raise QuantWeightError(f"8-bit weights quantized in groups of {group} (XNNPACK takes groups of 4-bit values only)")
    if group % 32 != 0:
        raise QuantWeightError(f"group size {group} is not a multiple of 32 (XNNPACK's blockwise weights need it)")
    if k % group != 0 or scales.shape[1] != k // group:
        raise QuantWeightError(f"{k} columns do not split into groups of {group}")
    return QWeight(data, scales, "group", 0, group, bits=4)


def _bits(qmin: Any, qmax: Any) -> int:
    return 4 if (qmin, qmax) == (-8, 7) else 8


def _check_int8(dtype: Any) -> None:
    if dtype != torch.int8:
        raise QuantWeightError(f"weight dtype {dtype} (XNNPACK takes int8-stored weights)")


def _check_zero(zps: torch.Tensor) -> None:
    if bool((zps != 0).any()):
        bad = sorted({int(v) for v in zps.reshape(-1)[zps.reshape(-1) != 0].tolist()})[:4]
        raise QuantWeightError(
            f"asymmetric weight: zero points {bad} are not 0 (XNNPACK implies 0, or 8 for 4-bit, "
            "so the result would be silently wrong)")


def per_token_block(node: torch.fx.Node) -> bool:
    """A torchao affine op whose block is one row of the last dim (1 everywhere else)."""
    block = node.args[1]
    dims = list(node.args[0].meta["val"].shape)
    return len(block) == len(dims) and all(int(b) == 1 for b in block[:-1]) and int(block[-1]) == int(dims[-1])
