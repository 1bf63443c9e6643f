"""A Python interpreter of XNNPACK payloads on torch ops, for lowerflow's executor.

It reads the payload the way the ExecuTorch runtime does (header, graph,
constants from the program's named data by key), then runs the nodes in order.
Values carry the graph's dims, so NHWC values are NHWC tensors here too:
convolutions and poolings permute to torch's NCHW around the torch call.
External inputs are bound by external id; outputs come back in external id order.

Quantized values (``XNNQuantizedTensorValue``: qint8, qcint8, q(c)int32, qdint8,
qcint4, qbint4) are read by ``runtime_qvalues`` and every node touching one runs in
``runtime_quant`` with XNNPACK's arithmetic (requantization, rounding); fp32 nodes
run here, unchanged.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ...runtime.errors import ExecutorError
from . import payload as P
from . import runtime_quant as RQ
from . import runtime_qvalues as Q
from .generated import xnngraph_generated as fbx

K = fbx.NodeUnion
_NAMES = P.node_kind_names()


@dataclass
class XnnpackProgram:
    """An initialized delegate: the graph, its constants, and its external values."""

    graph: fbx.XNNGraphT
    constants: dict[int, torch.Tensor]  # value id -> tensor
    inputs: list[tuple[int, int]]  # (external id, value id), sorted
    outputs: list[tuple[int, int]]
    qparams: dict[int, Q.QParams] = field(default_factory=dict)  # quantized value id -> params
    quantized_nodes: set[int] = field(default_factory=set)  # indices of nodes run by runtime_quant


class XnnpackRuntime:
    """``init(processed, compile_specs, named_data=...) -> handle``; ``execute(handle, args) -> outputs``."""

    def init(self, processed: bytes, compile_specs: Sequence[Any] = (), named_data: Mapping[str, bytes] | None = None):
        graph, inline = P.deserialize_payload(processed)
        read = Q.blob_reader(graph.constantData or [], inline, named_data or {})
        constants, qparams, inputs, outputs = {}, {}, [], []
        for value in graph.xvalues or []:
            tensor = Q.tensor_part(value)
            if Q.is_quantized(value):
                qparams[tensor.idOut] = Q.read_qparams(value, read)
            elif tensor.datatype != P.DATATYPE_FP32:
                raise ExecutorError(f"XNNPACK payload: value {tensor.idOut} has datatype "
                                    f"{Q.DATATYPE_NAMES.get(tensor.datatype, tensor.datatype)} (fp32 or quantized only)")
            if tensor.constantBufferIdx:
                constants[tensor.idOut] = _constant(tensor, qparams.get(tensor.idOut), read)
            if tensor.flags & P.EXTERNAL_INPUT:
                inputs.append((tensor.externalId, tensor.idOut))
            if tensor.flags & P.EXTERNAL_OUTPUT:
                outputs.append((tensor.externalId, tensor.idOut))
        RQ.apply_define_rules(graph, qparams)
        quantized_nodes = set()
        for index, node in enumerate(graph.xnodes or []):
            kind = node.xnodeUnionType
            if kind not in _KERNELS and kind not in RQ.QUANT_KERNELS:
                raise ExecutorError(f"XNNPACK payload: node {index} of kind {_NAMES.get(kind, kind)} "
                                    "is not supported by lowerflow's runtime")
            if any(vid in qparams for vid in _value_ids(node.xnodeUnion)):
                RQ.check_quantized_node(index, node, _NAMES.get(kind, str(kind)), _KERNELS)
                quantized_nodes.add(index)
        return XnnpackProgram(graph, constants, sorted(inputs), sorted(outputs), qparams, quantized_nodes)

    def num_inputs(self, handle: XnnpackProgram) -> int:
        return len(handle.inputs)

    @torch.no_grad()
    def execute(self, handle: XnnpackProgram, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(args) != len(handle.inputs):
            raise ExecutorError(f"XNNPACK delegate takes {len(handle.inputs)} inputs, got {len(args)}")
        values: dict[int, Any] = dict(handle.constants)
        for (_, vid), arg in zip(handle.inputs, args):
            dims = list(Q.tensor_part(handle.graph.xvalues[vid]).dims)
            # A 0-dim input is [1] in the graph; an input smaller than its dims is a
            # dynamic one (dims at the upper bound): it runs at its own size.
            if list(arg.shape) != dims and arg.numel() == _numel(dims):
                arg = arg.reshape(dims)
            values[vid] = arg.to(torch.int32) if vid in handle.qparams else arg
        for index, node in enumerate(handle.graph.xnodes or []):
            if index in handle.quantized_nodes:
                qnode = RQ.QNode(index, node, values, handle.qparams, _NAMES.get(node.xnodeUnionType, "?"))
                values[_output_id(node.xnodeUnion)] = RQ.run_quantized_node(qnode, _KERNELS).contiguous()
                continue
            result = _KERNELS[node.xnodeUnionType](node.xnodeUnion, values)
            if node.outputMinMax is not None:
                result = result.clamp(node.outputMinMax.outputMin, node.outputMinMax.outputMax)
            values[_output_id(node.xnodeUnion)] = result.contiguous()
        return [_external_output(values[vid], handle.qparams.get(vid)) for _, vid in handle.outputs]


def _external_output(value: Any, params: Q.QParams | None) -> torch.Tensor:
    """A copy of an output value; a quantized one in its storage dtype (int8, uint8)."""
    if params is None:
        return value.clone()
    if isinstance(value, Q.DynamicQ):
        raise ExecutorError("XNNPACK payload: a dynamically quantized (qdint8) value is a delegate output")
    return value.to(Q.storage_dtype(params))


def _constant(tensor: fbx.XNNTensorValueT, params: Q.QParams | None, read) -> torch.Tensor:
    """A constant value's data: fp32, or the integers of a quantized one."""
    dims = [int(d) for d in (tensor.dims if tensor.dims is not None else [])]
    data = read(tensor.constantBufferIdx, f"constant value {tensor.idOut}")
    if params is not None:
        return Q.decode_constant(tensor.idOut, tensor.datatype, dims, data)
    count = _numel(dims)
    if len(data) < 4 * count:
        raise ExecutorError(f"XNNPACK payload: constant value {tensor.idOut} has {len(data)} bytes, needs {4 * count}")
    return _read_only_floats(data, count).reshape(dims)


def _read_only_floats(data: bytes, count: int) -> torch.Tensor:
    """``count`` fp32 values of a constant as a tensor over the program's own bytes (no copy:
    the interpreter's kernels never write a value in place; outputs are copies)."""
    if not count:
        return torch.empty(0, dtype=torch.float32)
    with warnings.catch_warnings():  # torch warns that the bytes are not writable: they are never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(data)[:4 * count], dtype=torch.float32)


def _value_ids(body: Any) -> list[int]:
    """The value ids a node body names (inputs, filter, bias, output)."""
    return [getattr(body, name) for name in vars(body) if name.endswith("Id") and isinstance(getattr(body, name), int)]


def _numel(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _output_id(body: Any) -> int:
    return body.outputId


def _binary(fn: Callable) -> Callable:
    return lambda body, v: fn(v[body.input1Id], v[body.input2Id])


def _unary(fn: Callable) -> Callable:
    return lambda body, v: fn(v[body.inputId])


def _nchw(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 3, 1, 2)


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1)


def _conv(body, v):
    x, filt = _nchw(v[body.input1Id]), v[body.filterId]
    bias = v[body.biasId] if body.biasId != P.INVALID_ID else None
    x = F.pad(x, (body.paddingLeft, body.paddingRight, body.paddingTop, body.paddingBottom))
    weight = filt.permute(0, 3, 1, 2)  # OHWI -> OIHW
    return _nhwc(F.conv2d(x, weight, bias, (body.subsamplingHeight, body.subsamplingWidth), 0,
                          (body.dilationHeight, body.dilationWidth), body.groups))


def _depthwise(body, v):
    x, filt = _nchw(v[body.input1Id]), v[body.filterId]
    bias = v[body.biasId] if body.biasId != P.INVALID_ID else None
    x = F.pad(x, (body.paddingLeft, body.paddingRight, body.paddingTop, body.paddingBottom))
    weight = filt.permute(3, 0, 1, 2)  # [1,H,W,O] -> [O,1,H,W]
    return _nhwc(F.conv2d(x, weight, bias, (body.subsamplingHeight, body.subsamplingWidth), 0,
                          (body.dilationHeight, body.dilationWidth), body.groups))


def _conv_transpose(body, v):
    x, filt = _nchw(v[body.input1Id]), v[body.filterId]
    bias = v[body.biasId] if body.biasId != P.INVALID_ID else None
    g, gi, go = body.groups, body.groupInputChannels, body.groupOutputChannels
    kh, kw = body.kernelHeight, body.kernelWidth
    weight = filt.reshape(g, go, kh, kw, gi).permute(0, 4, 1, 2, 3).reshape(g * gi, go, kh, kw)
    y = F.conv_transpose2d(x, weight, bias, (body.subsamplingHeight, body.subsamplingWidth), 0,
                           (body.adjustmentHeight, body.adjustmentWidth), g, (body.dilationHeight, body.dilationWidth))
    h, w = y.shape[2], y.shape[3]
    y = y[:, :, body.paddingTop:h - body.paddingBottom, body.paddingLeft:w - body.paddingRight]
    return _nhwc(y)


def _fully_connected(body, v):
    x, filt = v[body.input1Id], v[body.filterId]
    y = x @ filt if body.flags & P.FLAG_TRANSPOSE_WEIGHTS else x @ filt.t()
    if body.biasId != P.INVALID_ID:
        y = y + v[body.biasId]
    return y


def _max_pool(body, v):
    x = _nchw(v[body.inputId])
    x = F.pad(x, (body.paddingLeft, body.paddingRight, body.paddingTop, body.paddingBottom), value=-float("inf"))
    return _nhwc(F.max_pool2d(x, (body.poolingHeight, body.poolingWidth), (body.strideHeight, body.strideWidth),
                              0, (body.dilationHeight, body.dilationWidth)))


def _avg_pool(body, v):
    x = _nchw(v[body.inputId])
    if body.paddingTop != body.paddingBottom or body.paddingLeft != body.paddingRight:
        raise ExecutorError("XNNPACK payload: asymmetric average-pooling padding is not supported by lowerflow's runtime")
    return _nhwc(F.avg_pool2d(x, (body.poolingHeight, body.poolingWidth), (body.strideHeight, body.strideWidth),
                              (body.paddingTop, body.paddingLeft), count_include_pad=False))


def _cat(body, v):
    ids = [body.input1Id, body.input2Id, body.input3Id, body.input4Id, body.input5Id]
    return torch.cat([v[i] for i in ids if i != P.INVALID_ID], dim=body.axis)


def _slice(body, v):
    x = v[body.inputId]
    for d, (o, s) in enumerate(zip(body.offsets, body.sizes)):
        x = x.narrow(d, int(o), int(s))
    return x


def _pad(body, v):
    pads = []
    for pre, post in zip(reversed(list(body.prePaddings)), reversed(list(body.postPaddings))):
        pads += [int(pre), int(post)]
    return F.pad(v[body.inputId], pads, value=body.paddingValue)


def _resize_bilinear(body, v):
    x = _nchw(v[body.inputId])
    return _nhwc(F.interpolate(x, size=(body.newHeight, body.newWidth), mode="bilinear",
                               align_corners=bool(body.flags & P.FLAG_ALIGN_CORNERS)))


def _leaky_relu(body, v):
    return F.leaky_relu(v[body.inputId], body.negativeSlope)


def _clamp(body, v):
    return v[body.inputId]  # the bounds are the node's output_min_max, applied by execute


_KERNELS: dict[int, Callable] = {
    K.XNNAdd: _binary(torch.add),
    K.XNNSubtract: _binary(torch.sub),
    K.XNNMultiply: _binary(torch.mul),
    K.XNNDiv: _binary(torch.div),
    K.XNNMaximum: _binary(torch.maximum),
    K.XNNMinimum: _binary(torch.minimum),
    K.XNNBatchMatrixMultiply: _binary(torch.matmul),
    K.XNNPReLU: _binary(lambda x, w: torch.where(x >= 0, x, x * w)),
    K.XNNFullyConnected: _fully_connected,
    K.XNNConv2d: _conv,
    K.XNNDepthwiseConv2d: _depthwise,
    K.XNNConvTranspose2d: _conv_transpose,
    K.XNNMaxPooling2d: _max_pool,
    K.XNNAvgPooling2d: _avg_pool,
    K.XNNGlobalAvgPooling2d: _unary(lambda x: x.mean(dim=(1, 2), keepdim=True)),
    K.XNNSoftmax: _unary(lambda x: torch.softmax(x, -1)),
    K.XNNSigmoid: _unary(torch.sigmoid),
    K.XNNTanh: _unary(torch.tanh),
    K.XNNGelu: _unary(F.gelu),
    K.XNNHardswish: _unary(F.hardswish),
    K.XNNAbs: _unary(torch.abs),
    K.XNNNegate: _unary(torch.neg),
    K.XNNExp: _unary(torch.exp),
    K.XNNLog: _unary(torch.log),
    K.XNNSquareRoot: _unary(torch.sqrt),
    K.XNNReciprocalSquareRoot: _unary(torch.rsqrt),
    K.XNNFloor: _unary(torch.floor),
    K.XNNCeiling: _unary(torch.ceil),
    K.XNNSin: _unary(torch.sin),
    K.XNNCos: _unary(torch.cos),
    K.XNNSquare: _unary(torch.square),
    K.XNNCopy: _unary(torch.clone),
    K.XNNClamp: _clamp,
    K.XNNLeakyReLU: _leaky_relu,
    K.XNNStaticTranspose: lambda body, v: v[body.inputId].permute([int(p) for p in body.perm]),
    K.XNNStaticReshape: lambda body, v: v[body.inputId].reshape([int(d) or -1 for d in body.newShape]),
    K.XNNStaticSlice: _slice,
    K.XNNStaticConstantPad: _pad,
    K.XNNStaticResizeBilinear2D: _resize_bilinear,
    K.XNNConcatenate2: _cat,
    K.XNNConcatenate3: _cat,
    K.XNNConcatenate4: _cat,
    K.XNNConcatenate5: _cat,
}
