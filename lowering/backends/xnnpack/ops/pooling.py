"""Pooling and the other NHWC window ops: max / average pooling, global mean and max, bilinear resize.

All compute in NHWC (a mean or amax over H and W is a global pooling to
``[N, 1, 1, C]``; without keepdim it is reshaped to ``[N, C]``, the same bytes).
A mean over the last dim is a FullyConnected by ``1/K`` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..values import NCHW, NHWC, TO_NHWC, only_first_result, pair, shape, val
from ..xnodes import node1x1, reshape

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten

# --------------------------------------------------------------------------- pooling


def _pool_args(node: torch.fx.Node) -> tuple[list[int], list[int], list[int], list[int], bool]:
    args = list(node.args) + [None] * 6
    kernel = pair(args[1])
    stride = pair(args[2]) if args[2] else kernel
    padding = pair(args[3] if args[3] is not None else 0)
    dilation = pair(args[4] if args[4] is not None else 1) if node.target is aten.max_pool2d_with_indices.default else [1, 1]
    ceil_mode = bool(args[5] if node.target is aten.max_pool2d_with_indices.default else args[4])
    return kernel, stride, padding, dilation, ceil_mode


def _floor_shape(node, kernel, stride, padding, dilation) -> list[int]:
    n, c, h, w = shape(node.args[0])
    hw = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip((h, w), kernel, stride, padding, dilation)]
    return [n, c, *hw]


def check_pool(node, ctx):
    if len(shape(node.args[0])) != 4:
        return "input is not 4-D"
    kernel, stride, padding, dilation, ceil_mode = _pool_args(node)
    if ceil_mode and _floor_shape(node, kernel, stride, padding, dilation) != shape(_first(node)):
        return "ceil_mode changes the output size"
    if node.target is aten.max_pool2d_with_indices.default:
        if any(s > k for s, k in zip(stride, kernel)):
            return "stride > kernel"
        return only_first_result(node)
    args = list(node.args) + [None] * 7
    count_include_pad = True if args[5] is None else bool(args[5])
    if any(padding) and count_include_pad:
        return "padding counted in the average"
    if args[6] is not None:
        return "divisor_override"
    return None


def _first(node: torch.fx.Node) -> torch.fx.Node:
    """A node-like carrying the first result's shape (for multi-result pooling)."""
    class _Shape:
        meta = {"val": val(node)[0] if isinstance(val(node), (tuple, list)) else val(node)}
    return _Shape()


def lower_pool(b: GraphBuilder, node: torch.fx.Node) -> None:
    kernel, stride, padding, dilation, _ = _pool_args(node)
    x = b.get(node.args[0], NHWC)
    result = _first(node)
    dims = shape(result)
    out = b.define([dims[i] for i in TO_NHWC])
    body = fbx._XNNPooling2DT()
    body.paddingTop, body.paddingRight, body.paddingBottom, body.paddingLeft = (
        padding[0], padding[1], padding[0], padding[1])
    body.poolingHeight, body.poolingWidth = kernel
    body.strideHeight, body.strideWidth = stride
    body.dilationHeight, body.dilationWidth = dilation
    body.inputId, body.outputId, body.flags = x, out, P.FLAG_KEEP_DIMS
    is_max = node.target is aten.max_pool2d_with_indices.default
    b.add_node(fbx.NodeUnion.XNNMaxPooling2d if is_max else fbx.NodeUnion.XNNAvgPooling2d, body)
    if is_max:
        b.results[node] = [(out, NHWC)]
    else:
        b.set_value(node, out, NHWC)


# --------------------------------------------------------------------------- global mean and max


def _mean_dims(node: torch.fx.Node) -> list[int]:
    rank = len(shape(node.args[0]))
    return sorted(int(d) % rank for d in node.args[1])


def check_mean(node, ctx):
    rank = len(shape(node.args[0]))
    if node.kwargs.get("dtype") is not None:
        return "dtype"
    if _mean_dims(node) == [rank - 1]:
        return None  # a FullyConnected by 1/K
    if rank != 4:
        return "input is not 4-D"
    if _mean_dims(node) != [2, 3]:
        return "mean over dims other than H and W, or the last"
    return None


def _keepdim(node: torch.fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _mean_last(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Mean over the last dim: FullyConnected(x, 1/K) -> [..., 1] (then reshaped if not keepdim)."""
    x = b.get(node.args[0], NCHW)
    dims = b.dims[x]
    mean = b.define(dims[:-1] + [1]) if not _keepdim(node) else b.output(node)
    body = fbx.XNNFullyConnectedT()
    body.input1Id, body.filterId, body.biasId, body.outputId = (
        x, b.constant(torch.full((dims[-1], 1), 1.0 / dims[-1])), P.INVALID_ID, mean)
    body.flags = P.FLAG_TRANSPOSE_WEIGHTS
    b.add_node(fbx.NodeUnion.XNNFullyConnected, body)
    if not _keepdim(node):
        b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape(shape(node) or [1], mean, b.output(node)))


def lower_mean(b: GraphBuilder, node: torch.fx.Node) -> None:
    """GlobalAvgPooling2d in NHWC ([N,1,1,C]); keepdim=False is a reshape of it to [N,C].
    A mean over the last dim is a FullyConnected by 1/K instead."""
    if _mean_dims(node) == [len(shape(node.args[0])) - 1]:
        _mean_last(b, node)
        return
    x = b.get(node.args[0], NHWC)
    n, c = shape(node.args[0])[:2]
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    pooled = b.output(node, NHWC) if keepdim else b.define([n, 1, 1, c])
    b.add_node(fbx.NodeUnion.XNNGlobalAvgPooling2d, node1x1(x, pooled, P.FLAG_KEEP_DIMS))
    if not keepdim:  # [N,1,1,C] NHWC has the bytes of [N,C]
        out = b.output(node)
        b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape([n, c], pooled, out))



def check_amax(node, ctx):
    if len(shape(node.args[0])) != 4 or sorted(int(d) % 4 for d in node.args[1]) != [2, 3]:
        return "max over dims other than H and W of a 4-D tensor"
    return None


def lower_amax(b: GraphBuilder, node: torch.fx.Node) -> None:
    """amax over H, W: a MaxPooling2d whose window is the whole image (NHWC [N,1,1,C])."""
    x = b.get(node.args[0], NHWC)
    n, c, h, w = shape(node.args[0])
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    pooled = b.output(node, NHWC) if keepdim else b.define([n, 1, 1, c])
    body = fbx._XNNPooling2DT()
    body.paddingTop = body.paddingRight = body.paddingBottom = body.paddingLeft = 0
    body.poolingHeight, body.poolingWidth, body.strideHeight, body.strideWidth = h, w, h, w
    body.dilationHeight = body.dilationWidth = 1
    body.inputId, body.outputId, body.flags = x, pooled, P.FLAG_KEEP_DIMS
    b.add_node(fbx.NodeUnion.XNNMaxPooling2d, body)
    if not keepdim:
        b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape([n, c], pooled, b.output(node)))


# --------------------------------------------------------------------------- resize


def check_upsample(node, ctx):
    if len(shape(node.args[0])) != 4:
        return "input is not 4-D"
    scales = node.args[3] if len(node.args) > 3 else None
    if scales is not None:  # torch maps coordinates with the given scale, XNNPACK with the size ratio
        src, dst = shape(node.args[0])[2:], shape(node)[2:]
        if any(float(d) != float(s) * float(f) for s, d, f in zip(src, dst, scales)):
            return "scale factor other than output size / input size"
    return None


def lower_upsample(b: GraphBuilder, node: torch.fx.Node) -> None:
    """StaticResizeBilinear2D in NHWC (align_corners as XNNPACK's flag)."""
    x = b.get(node.args[0], NHWC)
    out = b.output(node, NHWC)
    body = fbx.XNNStaticResizeBilinear2DT()
    body.newHeight, body.newWidth = shape(node)[2:]
    body.inputId, body.outputId = x, out
    body.flags = P.FLAG_ALIGN_CORNERS if node.args[2] else 0
    b.add_node(fbx.NodeUnion.XNNStaticResizeBilinear2D, body)

