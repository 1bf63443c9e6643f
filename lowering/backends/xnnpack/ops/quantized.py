"""Quantized values and nodes: q/dq as aliases or Converts, quantized weights, int32 biases.

Which nodes compute quantized is decided once per program by :mod:`..qplan`;
this room has the checks and lowerings of the q/dq ops themselves and what
the FullyConnected and convolution lowerings call for their quantized operands.

- ``quantize_per_tensor`` of a node computing quantized with its parameters: that
  node's qint8 value (no XNN node); any other: ``Convert`` fp32 -> qint8;
- ``dequantize_per_tensor`` read only by nodes computing quantized: the qint8
  value itself; otherwise ``Convert`` qint8 -> fp32 (the quantized readers still
  read the qint8 value, :meth:`GraphBuilder.quantized_source`);
- weight dequantizations are static: a quantized gemm / convolution defines the
  integers as a qcint8 / qint8 / qbint4 constant (:func:`weight_constant`), any
  other reader a dequantized fp32 constant;
- a dynamic group (choose_qparams, getitems, q, dq and the reshapes to the gemm)
  is one ``Convert`` fp32 -> qdint8 (:func:`dynamic_input`) made by the gemm.

Named data (keys are content hashes): int8 weights raw (sha256), per-channel
scales fp32 and group scales bf16 (``"scale_"`` + sha256), 4-bit weights two
per byte ``(w[2i] + 8) | (w[2i+1] + 8) << 4``, static biases int32
``round(b / (s_w * s_in))`` (qcint32 with an fp32 scale blob, or qint32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .... import ptd_recipes
from .. import payload as P
from ..payload import per_tensor_quant
from ..generated import xnngraph_generated as fbx
from ..qparams import ACT_Q, QParams, QWeight, act_qparams, is_op
from ..values import NCHW, NHWC, shape
from ..xnodes import node1x1, reshape

if TYPE_CHECKING:
    from ..builder import GraphBuilder

qd = torch.ops.quantized_decomposed

def value_params(b: GraphBuilder, vid: int) -> QParams:
    """The per-tensor parameters of a qint8 value."""
    quant = b.value_type(vid)[1]
    if not isinstance(quant, fbx.PerTensorQuantT):
        raise AssertionError(f"value {vid} is not a per-tensor quantized value")
    return QParams(quant.scale, quant.zeroPoint)


# --------------------------------------------------------------------------- checks


def _plan(ctx):
    return ctx.qplan


def check_act_q(node, ctx):
    if act_qparams(node) is None:
        return "not an int8 [-128, 127] quantization with literal scale and zero point"
    x = node.args[0]
    if not isinstance(x, torch.fx.Node) or x.meta["val"].dtype != torch.float32:
        return "input is not a float32 tensor"
    return None


def check_dequantize_per_tensor(node, ctx):
    if ctx.is_static(node):
        return None  # a per-tensor weight
    params = act_qparams(node)
    source = node.args[0]
    if params is None or not is_op(source, ACT_Q) or not params.same(act_qparams(source)):
        return "not the dequantization of an int8 quantize_per_tensor with the same parameters"
    return None


def check_weight_dq(node, ctx):
    if ctx.is_static(node):
        return None
    plan = _plan(ctx)
    if plan is not None and node in plan.dynamic_parts:
        return None
    return "not a static weight or part of a dynamically quantized linear XNNPACK takes"


def check_dynamic_part(node, ctx):
    plan = _plan(ctx)
    if plan is not None and node in plan.dynamic_parts:
        return None
    return "not part of a dynamically quantized linear XNNPACK takes"


# --------------------------------------------------------------------------- q / dq


def lower_act_q(b: GraphBuilder, node: torch.fx.Node) -> None:
    params = act_qparams(node)
    source = node.args[0]
    planned = b.qplan.qout.get(source)
    if planned is not None and planned.same(params):
        b.alias(node, source)  # the producer computed this value quantized
        return
    layout = b.layout(source)
    x = b.get(source, layout)
    key = (x, params.scale, params.zero_point)  # one Convert per value and parameters (e.g. Q, K and V's input)
    if key not in b.converts:
        b.converts[key] = b.define(b.dims[x], datatype=P.DATATYPE_QINT8, quant=per_tensor_quant(params))
        b.add_node(fbx.NodeUnion.XNNConvert, node1x1(x, b.converts[key]))
    b.set_value(node, b.converts[key], layout)


def lower_act_dq(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    if node.users and all(u in b.qplan.qout for u in node.users):
        b.alias(node, source)  # read as qint8 only
        return
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.define(b.dims[x], datatype=P.DATATYPE_FP32)
    b.set_value(node, out, layout)
    b.dq_source[node] = source
    b.add_node(fbx.NodeUnion.XNNConvert, node1x1(x, out))


def lower_not_alone(b: GraphBuilder, node: torch.fx.Node) -> None:
    from ..values import XnnpackPreprocessError

    raise XnnpackPreprocessError(f"node {node.name!r} ({node.target}) is lowered only with the linear it feeds")


# --------------------------------------------------------------------------- operands


def dynamic_input(b: GraphBuilder, x: torch.fx.Node, dims: list[int] | None, layout: str = NCHW) -> int:
    """``x`` (fp32, in ``layout``: layout transposes happen before the Convert) reshaped to ``dims``
    and converted to qdint8 with parameters chosen at run time: per row for a FullyConnected
    (NCHW), per image for a convolution (NHWC); made once."""
    key = (x, tuple(dims or ()), layout)
    if key not in b.dynamic_inputs:
        value = b.get(x, layout)
        dims = dims or b.dims[value]
        if b.dims[value] != list(dims):
            flat = b.define(list(dims), datatype=P.DATATYPE_FP32)
            b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape(list(dims), value, flat))
            value = flat
        quant = fbx.PerTokenDynamicQuantT()
        quant.numNonbatchDims = 3 if layout == NHWC else 1
        out = b.define(list(dims), datatype=P.DATATYPE_QDINT8, quant=quant)
        b.add_node(fbx.NodeUnion.XNNConvert, node1x1(value, out))
        b.dynamic_inputs[key] = out
    return b.dynamic_inputs[key]


def weight_constant(b: GraphBuilder, w: QWeight, data: torch.Tensor, channel_dim: int = 0) -> int:
    """The filter constant of ``w``'s integers ``data`` (already in XNNPACK's layout)."""
    if w.kind == "tensor":
        quant = per_tensor_quant(QParams(float(w.scales.reshape(-1)[0]), 0))
        return b.constant(data, datatype=P.DATATYPE_QINT8, quant=quant)
    if w.kind == "channel":
        quant = fbx.PerChannelQuantT()
        quant.scale, quant.channelDim = [], channel_dim
        quant.scaleBufferIdx, quant.numScales = _scale_blob(b, w.scales, w, dtype=torch.float32), w.scales.numel()
        if w.bits == 4:  # a 4-bit row whose length is no multiple of 32 (blockwise needs one)
            return b.constant(data, datatype=P.DATATYPE_QCINT4, quant=quant, data=pack_int4(data))
        return b.constant(data, datatype=P.DATATYPE_QCINT8, quant=quant)
    # 4-bit groups: blockwise (a per-channel 4-bit weight is one block of K per row, as ExecuTorch emits it)
    scales = w.scales.reshape(data.shape[0], -1)
    group = data.shape[1] // scales.shape[1]
    quant = fbx.PerChannelGroupQuantT()
    quant.scale, quant.channelDim, quant.groupSize = [], 0, group
    quant.scaleBufferIdx, quant.numScales = _scale_blob(b, scales, w, dtype=torch.bfloat16), scales.numel()
    return b.constant(data, datatype=P.DATATYPE_QBINT4, quant=quant, data=pack_int4(data))


def pack_int4(data: torch.Tensor) -> bytes:
    """Rows of 4-bit values two per byte, low nibble first, each stored + 8 (odd rows padded)."""
    import numpy as np

    # int8 + 8 modulo 256 (values in [-8, 7]: 0..15), in numpy: one pass each, no thread pool
    u = data.detach().to(torch.int8).contiguous().numpy().view(np.uint8) + np.uint8(8)
    if u.shape[1] % 2:
        u = np.concatenate([u, np.zeros((u.shape[0], 1), dtype=np.uint8)], axis=1)
    return (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).tobytes()


def _scale_blob(b: GraphBuilder, scales: torch.Tensor, w: QWeight, role: str = "scales",
                dtype: torch.dtype | None = None) -> int:
    """The named data of a weight's scales (key ``scale_`` + sha256; stable: ``<weight>#scales``),
    stored as ``dtype`` (None: as they are)."""
    stored = scales.to(dtype) if dtype is not None else scales
    data = stored.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    owner = b.weight_name(w.data) if b.stable_keys else None
    recipe = b.recipe(scales, stored.dtype) if owner and ptd_recipes.recording() else None
    return b.blob(data, prefix="scale_", key=f"{owner}#{role}" if owner else None, recipe=recipe)


def static_bias(b: GraphBuilder, bias: torch.Tensor, w: QWeight, x_params: QParams) -> int:
    """An int32 bias ``round(b / (s_w * s_in))``: qcint32 per channel, qint32 per tensor."""
    bias = bias.detach().to(torch.float32).reshape(-1)
    lo, hi = -(2 ** 31), 2 ** 31 - 1
    if w.kind == "tensor":
        scale = float(w.scales.reshape(-1)[0]) * x_params.scale
        q = qd.quantize_per_tensor.default(bias, scale, 0, lo, hi, torch.int32)
        return b.constant(q, datatype=P.DATATYPE_QINT32, quant=per_tensor_quant(QParams(scale, 0)))
    scales = (w.scales.to(torch.float32) * x_params.scale).to(torch.float32)
    zeros = torch.zeros(scales.shape, dtype=torch.int64)
    q = qd.quantize_per_channel.default(bias, scales, zeros, 0, lo, hi, torch.int32)
    quant = fbx.PerChannelQuantT()
    quant.scale, quant.channelDim = [], 0
    quant.scaleBufferIdx, quant.numScales = _scale_blob(b, scales, w, "bias_scales"), scales.numel()
    return b.constant(q, datatype=P.DATATYPE_QCINT32, quant=quant)


def fully_connected(b: GraphBuilder, node: torch.fx.Node, x_node: torch.fx.Node, w_dq: torch.fx.Node,
                    bias_node: torch.fx.Node | None, result_node: torch.fx.Node | None = None) -> None:
    """A FullyConnected with a quantized weight ``[N, K]`` (no transpose flag): static (qint8 in and
    out, int32 bias) or dynamic (qdint8 in, fp32 bias and out).  ``result_node``: the node whose value
    it defines (an N-D product's unflattening view, :func:`.linear.plan_batched_inputs`), else ``node``."""
    w = b.qplan.weights[w_dq]
    filter_id = weight_constant(b, w, w.data)
    if node in b.qplan.dynamic:
        x = dynamic_input(b, b.qplan.dynamic[node], shape(x_node))
        bias_id = b.constant(b.static_tensor(bias_node).reshape(-1)) if bias_node is not None else P.INVALID_ID
    else:
        x = b.get(x_node, NCHW)
        bias_id = (static_bias(b, b.static_tensor(bias_node), w, value_params(b, x))
                   if bias_node is not None else P.INVALID_ID)
    if node in b.batched_dims:  # an N-D product (:func:`.linear.plan_quantized_batched_inputs`)
        out = b.define(b.batched_dims[node])
        b.set_value(node, out, NCHW)
    else:
        out = b.output(result_node if result_node is not None else node)
    body = fbx.XNNFullyConnectedT()
    body.input1Id, body.filterId, body.biasId, body.outputId, body.flags = x, filter_id, bias_id, out, 0
    b.add_node(fbx.NodeUnion.XNNFullyConnected, body, fusable_output=out)
