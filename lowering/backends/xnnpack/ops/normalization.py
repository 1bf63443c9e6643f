"""Normalizations: layer norm, BatchNorm (inference), softmax.

XNNPACK 1.5.1 has no LayerNorm or BatchNorm node: layer norm is built from
FullyConnected means and elementwise nodes; a BatchNorm after a convolution is
folded into its filter (:func:`.convolution.plan_batch_norm_folds`), any other
one is ``x * scale + shift`` by per-channel constants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..values import NCHW, NHWC, TO_NHWC, only_first_result, shape, val
from ..xnodes import node1x1, node2x1

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten

# --------------------------------------------------------------------------- layer norm


def check_layer_norm(node, ctx):
    if len(node.args[1]) != 1:
        return "normalization over more than the last dim"
    return only_first_result(node)


def lower_layer_norm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Layer norm over the last dim from XNNPACK's nodes (1.5.1 has no LayerNorm node); the
    means are FullyConnected by a constant [K, 1] of 1/K::

        mean = FC(x, 1/K)   d = x - mean   var = FC(d*d, 1/K)
        out = d * rsqrt(var + eps) [* weight] [+ bias]
    """
    source, (k,), weight, bias, eps = node.args[:5]
    x = b.get(source, NCHW)
    dims = b.dims[x]
    reduced = dims[:-1] + [1]
    averaging = b.constant(torch.full((k, 1), 1.0 / k))

    def define(d):
        return b.define(list(d))

    def fc(inp):
        out = define(reduced)
        body = fbx.XNNFullyConnectedT()
        body.input1Id, body.filterId, body.biasId, body.outputId = inp, averaging, P.INVALID_ID, out
        body.flags = P.FLAG_TRANSPOSE_WEIGHTS
        b.add_node(fbx.NodeUnion.XNNFullyConnected, body)
        return out

    mean = fc(x)
    centered = define(dims)
    b.add_node(fbx.NodeUnion.XNNSubtract, node2x1(x, mean, centered))
    squared = define(dims)
    b.add_node(fbx.NodeUnion.XNNSquare, node1x1(centered, squared))
    var = fc(squared)
    shifted = define(reduced)
    b.add_node(fbx.NodeUnion.XNNAdd, node2x1(var, b.scalar(eps), shifted))
    inv = define(reduced)
    b.add_node(fbx.NodeUnion.XNNReciprocalSquareRoot, node1x1(shifted, inv))
    steps = [(fbx.NodeUnion.XNNMultiply, inv)]
    if weight is not None:
        steps.append((fbx.NodeUnion.XNNMultiply, b.get(weight, NCHW)))
    if bias is not None:
        steps.append((fbx.NodeUnion.XNNAdd, b.get(bias, NCHW)))
    value = centered
    for i, (kind, operand) in enumerate(steps):
        out = b.define(dims) if i < len(steps) - 1 else None
        if out is None:
            out = b.define(dims)
            b.set_value(node, out, NCHW)
        b.add_node(kind, node2x1(value, operand, out))
        value = out


# --------------------------------------------------------------------------- batch norm


def batch_norm_scale_shift(b: GraphBuilder, bn: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x * scale + shift`` per channel."""
    weight, bias, mean, var = (b.static_tensor(a) if a is not None else None for a in bn.args[1:5])
    return scale_shift(weight, bias, mean, var, float(bn.args[6]))


def scale_shift(weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A BatchNorm's ``(scale, shift)`` (float64) from its affine parameters and statistics."""
    inv = torch.rsqrt(var.double() + eps)
    scale = inv if weight is None else weight.double() * inv
    shift = -mean.double() * scale
    if bias is not None:
        shift = shift + bias.double()
    return scale, shift


def check_batch_norm(node, ctx):
    if not all(a is None or ctx.is_static(a) for a in node.args[1:5]):
        return "statistics or affine parameters are not static"
    if val(node.args[0]).dim() < 2:
        return "input has no channel dim"
    return only_first_result(node)


def lower_batch_norm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Folded into the convolution before it (see :func:`.convolution.plan_batch_norm_folds`),
    else ``x*scale + shift``."""
    if node.args[0] in b.bn_folds and b.bn_folds[node.args[0]] is node:
        return  # aliased by the convolution's lowering
    source = node.args[0]
    scale, shift = batch_norm_scale_shift(b, node)
    rank = val(source).dim()
    layout = b.layout(source) if rank == 4 else NCHW
    per_channel = [-1] if layout == NHWC else [-1] + [1] * (rank - 2)
    x = b.get(source, layout)
    scaled = b.define(b.dims[x])
    b.add_node(fbx.NodeUnion.XNNMultiply, node2x1(x, b.constant(scale.float().reshape(per_channel)), scaled))
    dims = shape(node.args[0])
    out = b.define([dims[i] for i in TO_NHWC] if layout == NHWC else dims)
    b.set_value(node, out, layout)
    b.add_node(fbx.NodeUnion.XNNAdd, node2x1(scaled, b.constant(shift.float().reshape(per_channel)), out),
               fusable_output=out)


# --------------------------------------------------------------------------- softmax


def check_softmax(node, ctx):
    dim, rank = node.args[1], val(node.args[0]).dim()
    if dim not in (-1, rank - 1):
        return "softmax over a dim other than the last"
    if node.target is aten._softmax.default and node.args[2]:
        return "half_to_float"
    return None


def softmax_symbolic_sizes(node: torch.fx.Node) -> str | None:
    """XNNPACK takes a softmax with symbolic sizes if the dim it runs over is static."""
    dim = node.args[1] % val(node).dim()
    if not isinstance(val(node).shape[dim], int):
        return "dynamic shape: softmax over a symbolic dim"
    return None


def lower_softmax(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0], NCHW)
    out = b.output(node)
    b.add_node(fbx.NodeUnion.XNNSoftmax, node1x1(x, out))
