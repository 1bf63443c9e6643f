"""Quantized XNNPACK nodes with XNNPACK's arithmetic, for lowerflow's runtime.

A node with a quantized input or output runs here; its quantized values are int32
tensors of their integers (``runtime_qvalues``).  The arithmetic is XNNPACK's
(``src/microparams-init.c``, the scalar micro-kernels), done in fp32 where XNNPACK
does it in fp32 and exactly in integers (float64 accumulations) elsewhere:

    fp32 -> qint8      q = rint(clamp(x * (1f/s), qmin-zp, qmax-zp)) + zp        (round half even)
    fp32 -> qdint8     per row: lo = min(0, min x), hi = max(0, max x), m = 255/(hi-lo) (1 if equal),
                       zp = rint(clamp(lo*m+128 > 127-hi*m ? -128-lo*m : 127-hi*m)), then as above with
                       1/s = m; the row's scale is 1/m
    q -> fp32          (q - zp) * s
    qint8 -> qint8     y = (x * m + (zy << 8) - m*zx + 128) >> 8,  m = rint(256 * sx/sy)
    FC / convs (static)  acc = sum (x - zx) * w + b_int32;  y = rint(clamp(f32(acc) * (sx*sw[c]/sy))) + zy
    FC / conv (dynamic)  y = fma(f32(acc_row) * sx_row, sw[c], b_f32)   (blockwise: acc = sum_b f32(acc_b) * sw[c,b])
    Add / Subtract     fixed point: m = rint(|sa/sy| * 2^shift), shift = 20 - exponent(max |s/sy|),
                       y = (bias + a*ma + b*mb) >> shift + zy,  bias = 2^(shift-1) - ma*za - mb*zb
    Multiply           y = rint(f32((a-za)*(b-zb)) * (sa*sb/sy)) + zy
    GlobalAvgPool      y = rint(f32(sum) * s + (zy - n*zx*s)),  s = (sx/sy) * (1/n)
    output_min_max     bounds quantized as rint(clamp(v/sy + zy, -128, 127))
    moves (transpose, reshape, slice, concat, copy, pad, maxpool, clamp)  on the integers

Other per-tensor qint8 elementwise nodes run as quantize(op(dequantize(x))), XNNPACK's
reference form.  Softmax, AvgPooling2d and BatchMatrixMultiply on qint8 are refused
(XNNPACK refuses them too).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...runtime.errors import ExecutorError
from .generated import xnngraph_generated as fbx
from .runtime_qvalues import D, DynamicQ, QParams

K = fbx.NodeUnion
INVALID_ID = 0xFFFFFFFF
FLAG_TRANSPOSE_WEIGHTS = 0x1
F32 = torch.float32
F64 = torch.float64


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


# ------------------------------------------------------------------ primitives

def quantize(x: torch.Tensor, inv_scale: Any, zp: Any, qmin: int, qmax: int) -> torch.Tensor:
    """XNNPACK's f32 -> q (scalar fmagic kernel): fp32 multiply, clamp, round half even."""
    v = x.to(F32) * inv_scale
    v = torch.maximum(v, (qmin - zp) if isinstance(zp, torch.Tensor) else f32(qmin - zp))
    v = torch.minimum(v, (qmax - zp) if isinstance(zp, torch.Tensor) else f32(qmax - zp))
    return torch.round(v).to(torch.int32) + zp


def dequantize(q: torch.Tensor, p: QParams) -> torch.Tensor:
    return (q - p.zero_point).to(F32) * f32(p.scale)


def requantize(acc: torch.Tensor, scale: torch.Tensor, zp: int, lo: int, hi: int) -> torch.Tensor:
    """fp32 requantization of exact integer accumulators (float64) with output bounds [lo, hi]."""
    v = acc.to(F32) * scale
    v = torch.clamp(v, lo - zp, hi - zp)
    return torch.round(v).to(torch.int32) + zp


def quantize_bound(value: float, p: QParams) -> int:
    """``xnn_qs8_quantize``: lrintf(min(max(v / s + zp, qmin), qmax)) in fp32."""
    v = f32(value) / f32(p.scale) + f32(float(p.zero_point))
    lo, hi = (0, 255) if p.datatype == D.xnn_datatype_quint8 else (-128, 127)
    return int(torch.round(torch.clamp(v, lo, hi)))


def bounds(node: fbx.XNodeT, p: QParams) -> tuple[int, int]:
    """The quantized output bounds of a node: its output_min_max in the output's domain."""
    mm = node.outputMinMax
    if mm is None:
        return p.qmin, p.qmax
    return max(p.qmin, quantize_bound(mm.outputMin, p)), min(p.qmax, quantize_bound(mm.outputMax, p))


def dynamic_quantize(x: torch.Tensor, num_nonbatch_dims: int) -> DynamicQ:
    """``xnn_f32_qd8_asymmetric_quantization_params`` + convert, per row."""
    x = x.to(F32)
    nb = max(1, min(int(num_nonbatch_dims), x.dim()))
    dims = tuple(range(x.dim() - nb, x.dim()))
    rmin = torch.clamp(x.amin(dim=dims, keepdim=True), max=0.0)
    rmax = torch.clamp(x.amax(dim=dims, keepdim=True), min=0.0)
    equal = rmin == rmax
    mult = torch.where(equal, f32(1.0), f32(255.0) / torch.where(equal, f32(1.0), rmax - rmin))
    dmin, dmax = rmin * mult, rmax * mult
    zp = torch.where((f32(-128.0) + dmin) + (f32(127.0) + dmax) > 0, f32(-128.0) - dmin, f32(127.0) - dmax)
    zp = torch.round(torch.clamp(zp, -128.0, 127.0)).to(torch.int32)
    q = quantize(x, mult, zp, -128, 127)
    return DynamicQ(q, f32(1.0) / mult, zp)


def _float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def add_params(sa: float, sb: float, so: float, sign_b: int = 1) -> tuple[int, int, int]:
    """``xnn_init_qs8_add_minmax_scalar_params``: (a multiplier, b multiplier, shift)."""
    a_os = float(f32(sa) / f32(so))
    b_os = float(f32(sb) / f32(so)) * sign_b
    max_abs = max(abs(a_os), abs(b_os))
    exponent = ((_float_bits(max_abs) >> 23) & 0xFF) - 127
    shift = 20 - exponent
    if not 12 <= shift <= 30:
        raise ExecutorError(f"qint8 add: input/output scale ratio {max_abs} is outside XNNPACK's range")
    ma = int(torch.round(torch.tensor(abs(a_os) * 2.0 ** shift, dtype=F64)))
    mb = int(torch.round(torch.tensor(abs(b_os) * 2.0 ** shift, dtype=F64)))
    return (-ma if a_os < 0 else ma), (-mb if b_os < 0 else mb), shift


# ------------------------------------------------------------------ node context

def node_error(index: int, kind_name: str, output_id: int, why: str) -> ExecutorError:
    return ExecutorError(f"XNNPACK payload: node {index} ({kind_name}, output value {output_id}): {why} "
                         "(lowerflow's runtime)")


class QNode:
    """One node's view of the values: float/int tensors, their QParams, the node."""

    def __init__(self, index: int, node: fbx.XNodeT, values: dict, qparams: dict[int, QParams], kind_name: str):
        self.index, self.node, self.body, self.values, self.qparams = index, node, node.xnodeUnion, values, qparams
        self.kind_name = kind_name

    def q(self, vid: int) -> QParams | None:
        return self.qparams.get(vid)

    @property
    def out(self) -> QParams | None:
        return self.qparams.get(self.body.outputId)

    def fail(self, why: str) -> ExecutorError:
        return node_error(self.index, self.kind_name, self.body.outputId, why)

    def per_tensor(self, vid: int) -> QParams:
        p = self.q(vid)
        if p is None or p.scheme != "tensor":
            raise self.fail(f"value {vid} must be per-tensor quantized, is "
                            f"{'fp32' if p is None else p.name + ' ' + p.scheme}")
        return p

    def as_float(self, vid: int) -> torch.Tensor:
        p, v = self.q(vid), self.values[vid]
        if p is None:
            return v
        if isinstance(v, DynamicQ):
            return (v.q - v.zero_point).to(F32) * v.scale
        return dequantize(v, self.per_tensor(vid))

    def finish_float(self, y: torch.Tensor) -> torch.Tensor:
        """Clamp a float result by output_min_max and quantize it to the output's params."""
        mm = self.node.outputMinMax
        if mm is not None:
            y = y.clamp(mm.outputMin, mm.outputMax)
        out = self.out
        if out is None:
            return y
        if out.scheme != "tensor":
            raise self.fail(f"output value {self.body.outputId} is {out.name} {out.scheme}; expected per tensor")
        return quantize(y, f32(1.0) / f32(out.scale), out.zero_point, *bounds(self.node, out))


# ------------------------------------------------------------------ kernels

def _convert(n: QNode, floats: dict) -> Any:
    pin, pout, x = n.q(n.body.inputId), n.out, n.values[n.body.inputId]
    if pout is not None and pout.datatype == D.xnn_datatype_qdint8:
        if pin is not None:
            raise n.fail(f"{pin.name} -> qdint8 convert")
        return dynamic_quantize(x, pout.num_nonbatch_dims)
    if pout is None:
        return n.as_float(n.body.inputId)
    if pout.scheme != "tensor":
        raise n.fail(f"convert to {pout.name} {pout.scheme}")
    inv = f32(1.0) / f32(pout.scale)
    if pin is None:
        return quantize(x, inv, pout.zero_point, pout.qmin, pout.qmax)
    ratio = float(f32(n.per_tensor(n.body.inputId).scale) / f32(pout.scale))
    if pin.datatype == pout.datatype == D.xnn_datatype_qint8 and 2.0 ** -8 <= ratio <= 2.0 ** 7:
        return requantize_q8(x, pin, pout, ratio)
    return quantize(n.as_float(n.body.inputId), inv, pout.zero_point, pout.qmin, pout.qmax)


def requantize_q8(x: torch.Tensor, pin: QParams, pout: QParams, ratio: float) -> torch.Tensor:
    """qint8 -> qint8 (``xnn_qs8_vcvt``): multiplier rint(256 * si/so), 8-bit fixed point."""
    multiplier = int(torch.round(f32(256.0) * f32(ratio)))
    bias = (pout.zero_point << 8) - multiplier * pin.zero_point + 0x80
    y = torch.div(bias + x.to(torch.int64) * multiplier, 256, rounding_mode="floor")
    return torch.clamp(y, -128, 127).to(torch.int32)


def _weights(n: QNode, transpose: bool) -> tuple[torch.Tensor, QParams]:
    """The filter's integers minus its zero point (float64) and its QParams."""
    fid = n.body.filterId
    w, pw = n.values[fid], n.q(fid)
    if pw is None:
        raise n.fail(f"a quantized input with an fp32 filter (value {fid})")
    w = (w - pw.zero_point).to(F64) if pw.scheme == "tensor" else w.to(F64)
    return (w.t() if transpose else w), pw


def _bias(n: QNode) -> tuple[torch.Tensor | None, QParams | None]:
    bid = n.body.biasId
    if bid == INVALID_ID:
        return None, None
    return n.values[bid], n.q(bid)


def _weight_scale(pw: QParams) -> torch.Tensor:
    return pw.scale if isinstance(pw.scale, torch.Tensor) else f32(pw.scale)


def _static_out(n: QNode, acc: torch.Tensor, pin: QParams, pw: QParams) -> torch.Tensor:
    """Add the int32 bias to the accumulators (last dim = output channel) and requantize."""
    bias, pb = _bias(n)
    if bias is not None:
        if pb is None:
            raise n.fail(f"an fp32 bias (value {n.body.biasId}) on a static quantized node")
        acc = acc + bias.to(F64)
    pout = n.out
    if pout is None or pout.scheme != "tensor":
        raise n.fail("a static quantized node needs a per-tensor quantized output")
    scale = (f32(pin.scale) * _weight_scale(pw)) / f32(pout.scale)
    return requantize(acc, scale, pout.zero_point, *bounds(n.node, pout))


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add (one rounding), as XNNPACK's x86 and Arm kernels do."""
    return (a.to(F64) * b.to(F64) + c.to(F64)).to(F32)


def _dynamic_out(n: QNode, acc: torch.Tensor, x: DynamicQ, pw: QParams) -> torch.Tensor:
    """y = fma(f32(acc) * s_x, s_w, bias): the qd8-f32-qc8w GEMM's output stage."""
    scaled = acc.to(F32) * x.scale
    bias, pb = _bias(n)
    if bias is None:
        return n.finish_float(scaled * _weight_scale(pw))
    if pb is not None:
        raise n.fail(f"a quantized bias (value {n.body.biasId}) on a dynamically quantized node")
    return n.finish_float(_fma(scaled, _weight_scale(pw), bias))


def _fully_connected(n: QNode, floats: dict) -> Any:
    transpose = bool(n.body.flags & FLAG_TRANSPOSE_WEIGHTS)
    w, pw = _weights(n, transpose)
    x = n.values[n.body.input1Id]
    if isinstance(x, DynamicQ):
        xq = (x.q - x.zero_point).to(F64)
        if pw.scheme == "group":
            return _blockwise_fc(n, x, xq, w, pw)
        return _dynamic_out(n, xq @ w.t(), x, pw)
    pin = n.q(n.body.input1Id)
    if pin is None:
        raise n.fail(f"an fp32 input (value {n.body.input1Id}) with a quantized filter")
    pin = n.per_tensor(n.body.input1Id)
    return _static_out(n, (x - pin.zero_point).to(F64) @ w.t(), pin, pw)


#: Most per-block partial sums (float64) :func:`_blockwise_fc` holds at once: rows are done in
#: chunks (an LLM head at a 1023-token prefill is 1023 x 49152 x 18 of them: 7 GB at once).
BLOCKWISE_CHUNK = 1 << 22


def _blockwise_fc(n: QNode, x: DynamicQ, xq: torch.Tensor, w: torch.Tensor, pw: QParams) -> torch.Tensor:
    gs = pw.group_size
    oc, ic = w.shape
    blocks = (ic + gs - 1) // gs
    pad = blocks * gs - ic
    if pad:
        xq, w = F.pad(xq, (0, pad)), F.pad(w, (0, pad))
    rows, wb, scale = xq.reshape(-1, blocks, gs), w.reshape(oc, blocks, gs), pw.scale.to(F64)
    step = max(1, BLOCKWISE_CHUNK // (oc * blocks))
    summed = torch.empty(rows.shape[0], oc, dtype=F32)
    for start in range(0, rows.shape[0], step):  # each row alone: the same sums as all at once
        acc = torch.einsum("mbk,obk->mob", rows[start:start + step], wb)
        summed[start:start + step] = (acc.to(F32).to(F64) * scale).sum(-1).to(F32)
    summed = summed.reshape(*xq.shape[:-1], oc)
    bias, _ = _bias(n)
    return n.finish_float(summed * x.scale if bias is None else _fma(summed, x.scale, bias))


def _conv_like(n: QNode, floats: dict) -> Any:
    """Conv2d, DepthwiseConv2d, ConvTranspose2d: the float kernel on exact integers (float64)."""
    w, pw = _weights(n, False)
    if pw.scheme == "group":
        raise n.fail("a blockwise-quantized convolution filter")
    x = n.values[n.body.input1Id]
    body = n.body
    scratch = {body.filterId: w}
    if isinstance(x, DynamicQ):
        if not (n.node.xnodeUnionType == K.XNNConv2d and becomes_fully_connected(body)):
            x = per_image(x)
        scratch[body.input1Id] = (x.q - x.zero_point).to(F64)
    else:
        pin = n.per_tensor(body.input1Id)
        scratch[body.input1Id] = (x - pin.zero_point).to(F64)
    if body.biasId != INVALID_ID:
        scratch[body.biasId] = torch.zeros(w.shape[0] if n.node.xnodeUnionType != K.XNNDepthwiseConv2d
                                           else w.shape[-1], dtype=F64)
    acc = floats[n.node.xnodeUnionType](body, scratch)
    if isinstance(x, DynamicQ):
        return _dynamic_out(n, acc, x, pw)
    return _static_out(n, acc, n.per_tensor(body.input1Id), pw)


def per_image(x: DynamicQ) -> DynamicQ:
    """The params a convolution reads for a qdint8 input: ``quantization_params[n]`` for image n
    (``xnn_compute_dqigemm``).  An input quantized per image has them; one quantized per pixel
    (shared with a 1x1 conv, see :func:`apply_define_rules`) is read as its first N rows' params."""
    n = x.q.shape[0]
    if x.scale.numel() == n:
        return x
    shape = (n,) + (1,) * (x.q.dim() - 1)
    return DynamicQ(x.q, x.scale.reshape(-1)[:n].reshape(shape), x.zero_point.reshape(-1)[:n].reshape(shape))


def _add_sub(sign_b: int) -> Callable:
    def run(n: QNode, floats: dict) -> Any:
        ia, ib = n.body.input1Id, n.body.input2Id
        pa, pb, po = n.per_tensor(ia), n.per_tensor(ib), n.out
        if po is None:
            raise n.fail("a quantized add/subtract with an fp32 output")
        ma, mb, shift = add_params(pa.scale, pb.scale, po.scale, sign_b)
        bias = (1 << (shift - 1)) - ma * pa.zero_point - mb * pb.zero_point
        acc = bias + n.values[ia].to(torch.int64) * ma + n.values[ib].to(torch.int64) * mb
        y = torch.div(acc, 2 ** shift, rounding_mode="floor") + po.zero_point
        return torch.clamp(y, *bounds(n.node, po)).to(torch.int32)
    return run


def _multiply(n: QNode, floats: dict) -> Any:
    ia, ib = n.body.input1Id, n.body.input2Id
    pa, pb, po = n.per_tensor(ia), n.per_tensor(ib), n.out
    if po is None:
        raise n.fail("a quantized multiply with an fp32 output")
    acc = ((n.values[ia] - pa.zero_point).to(torch.int64) * (n.values[ib] - pb.zero_point)).to(F64)
    scale = (f32(pa.scale) * f32(pb.scale)) / f32(po.scale)
    return requantize(acc, scale, po.zero_point, *bounds(n.node, po))


def _global_avg_pool(n: QNode, floats: dict) -> Any:
    pin, po = n.per_tensor(n.body.inputId), n.out
    if po is None:
        return n.finish_float(n.as_float(n.body.inputId).mean(dim=(1, 2), keepdim=True))
    x = n.values[n.body.inputId]
    count = x.shape[1] * x.shape[2]
    total = x.to(torch.int64).sum(dim=(1, 2), keepdim=True)
    scale = (f32(pin.scale) / f32(po.scale)) * (f32(1.0) / f32(float(count)))
    zero = f32(float(po.zero_point)) - f32(float(count * pin.zero_point)) * scale
    v = total.to(F32) * scale + zero
    lo, hi = bounds(n.node, po)
    return torch.round(torch.clamp(v, lo, hi)).to(torch.int32)


def _same_params_move(n: QNode, floats: dict) -> Any:
    """Transpose, reshape, slice, copy, maxpool, clamp: the integers move; params shared."""
    vid = n.body.inputId
    pin, po = n.q(vid), n.out
    kind = n.node.xnodeUnionType
    if pin is None or po is None or not pin.same_as(po):
        return n.finish_float(floats[kind](n.body, {vid: n.as_float(vid)}))
    x = n.values[vid]
    if kind == K.XNNMaxPooling2d:
        y = floats[kind](n.body, {vid: x.to(F64)}).to(torch.int32)
    else:
        y = floats[kind](n.body, {vid: x})
    if n.node.outputMinMax is not None:
        y = torch.clamp(y, *bounds(n.node, po))
    return y


def _pad(n: QNode, floats: dict) -> Any:
    vid, body = n.body.inputId, n.body
    pin, po = n.q(vid), n.out
    if po is None or pin is None or not pin.same_as(po):
        return n.finish_float(floats[K.XNNStaticConstantPad](body, {vid: n.as_float(vid)}))
    pads = []
    for pre, post in zip(reversed(list(body.prePaddings)), reversed(list(body.postPaddings))):
        pads += [int(pre), int(post)]
    return F.pad(n.values[vid], pads, value=quantize_bound(body.paddingValue, po))


def _concatenate(n: QNode, floats: dict) -> Any:
    body, po = n.body, n.out
    ids = [i for i in (body.input1Id, body.input2Id, body.input3Id, body.input4Id, body.input5Id) if i != INVALID_ID]
    if po is None:
        return torch.cat([n.as_float(i) for i in ids], dim=body.axis)
    parts = []
    for i in ids:
        if po.same_as(n.q(i)):
            parts.append(n.values[i])
        else:  # different params: requantize the input into the output's
            parts.append(quantize(n.as_float(i), f32(1.0) / f32(po.scale), po.zero_point, po.qmin, po.qmax))
    return torch.cat(parts, dim=body.axis)


def _reference(n: QNode, floats: dict) -> Any:
    """quantize(op(dequantize(inputs))): XNNPACK's reference form for other elementwise nodes."""
    scratch = {}
    for name in ("inputId", "input1Id", "input2Id"):
        vid = getattr(n.body, name, None)
        if vid is not None and vid != INVALID_ID:
            scratch[vid] = n.as_float(vid)
    y = floats[n.node.xnodeUnionType](n.body, scratch)
    return n.finish_float(y)


_REFUSED = (K.XNNSoftmax, K.XNNAvgPooling2d, K.XNNBatchMatrixMultiply)

QUANT_KERNELS: dict[int, Callable] = {
    K.XNNConvert: _convert,
    K.XNNFullyConnected: _fully_connected,
    K.XNNConv2d: _conv_like,
    K.XNNDepthwiseConv2d: _conv_like,
    K.XNNConvTranspose2d: _conv_like,
    K.XNNAdd: _add_sub(1),
    K.XNNSubtract: _add_sub(-1),
    K.XNNMultiply: _multiply,
    K.XNNGlobalAvgPooling2d: _global_avg_pool,
    K.XNNMaxPooling2d: _same_params_move,
    K.XNNClamp: _same_params_move,
    K.XNNCopy: _same_params_move,
    K.XNNStaticTranspose: _same_params_move,
    K.XNNStaticReshape: _same_params_move,
    K.XNNStaticSlice: _same_params_move,
    K.XNNStaticConstantPad: _pad,
    K.XNNConcatenate2: _concatenate,
    K.XNNConcatenate3: _concatenate,
    K.XNNConcatenate4: _concatenate,
    K.XNNConcatenate5: _concatenate,
}


def apply_define_rules(graph: fbx.XNNGraphT, qparams: dict[int, QParams]) -> None:
    """What XNNPACK changes while defining the graph: a 1x1, stride-1, unpadded, ungrouped
    Conv2d becomes a fully-connected node, and its qdint8 input is then quantized per pixel
    (``num_nonbatch_dims = 1``) instead of per image (``src/subgraph/convolution-2d.c``)."""
    for node in graph.xnodes or []:
        body = node.xnodeUnion
        if node.xnodeUnionType != K.XNNConv2d:
            continue
        p = qparams.get(body.input1Id)
        if p is None or p.datatype != D.xnn_datatype_qdint8:
            continue
        if becomes_fully_connected(body):
            qparams[body.input1Id] = dataclasses.replace(p, num_nonbatch_dims=1)


def becomes_fully_connected(body: Any) -> bool:
    """Whether XNNPACK defines this Conv2d as a fully-connected node (1x1, stride 1, no padding, 1 group)."""
    padded = body.paddingTop or body.paddingRight or body.paddingBottom or body.paddingLeft
    return (body.groups == 1 and body.kernelHeight == body.kernelWidth == 1 and not padded
            and body.subsamplingHeight == body.subsamplingWidth == 1
            and body.groupInputChannels + body.groupOutputChannels > 2)


def check_quantized_node(index: int, node: fbx.XNodeT, kind_name: str, floats: dict[int, Callable]) -> None:
    """At load: refuse a node on quantized values that cannot run (named by index, kind, output id)."""
    kind = node.xnodeUnionType
    if kind in _REFUSED:
        raise node_error(index, kind_name, node.xnodeUnion.outputId,
                         "is not supported on quantized values (XNNPACK refuses it too)")
    if kind not in QUANT_KERNELS and kind not in floats:
        raise node_error(index, kind_name, node.xnodeUnion.outputId, "is not supported on quantized values")


def run_quantized_node(n: QNode, floats: dict[int, Callable]) -> Any:
    """Run one node that has a quantized input or output (checked by :func:`check_quantized_node`)."""
    kernel = QUANT_KERNELS.get(n.node.xnodeUnionType)
    return kernel(n, floats) if kernel is not None else _reference(n, floats)
