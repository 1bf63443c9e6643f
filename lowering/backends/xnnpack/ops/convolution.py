"""Convolutions: 2-D, depthwise, transposed, and 1-D as 2-D with H = 1.

Convolutions compute in NHWC with the filter in OHWI (``[1, H, W, O]`` for a
depthwise one).  Before the walk, two producers are planned into the
convolution that reads them: a BatchNorm after it is folded into its filter
and bias (:func:`plan_batch_norm_folds`), a zero pad of H and W before it into
its padding (:func:`plan_pad_folds`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..values import NCHW, NHWC, TO_NHWC, pair, shape
from ..xnodes import reshape, transpose
from . import quantized
from .normalization import scale_shift
from .shape import pads

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten


def check_conv(node, ctx):
    rank = len(shape(node.args[1]))
    if rank == 3 and node.args[6]:
        return "1-D transposed convolution"
    if rank not in (3, 4):
        return "only 1-D and 2-D convolution"
    if not ctx.is_static(node.args[1]):
        return "weight is not a static parameter"
    if node.args[2] is not None and not ctx.is_static(node.args[2]):
        return "bias is not a static parameter"
    if node.args[6]:
        if any(pair(node.args[5])[i] != 1 for i in range(2)):
            return "dilated transposed convolution"
        return None
    return None


# --------------------------------------------------------------------------- plans


def plan_batch_norm_folds(b: GraphBuilder) -> None:
    """BatchNorms folded into the convolution before them (its only user, static weights)."""
    for node in b.ep.graph.nodes:
        if node.target is not aten._native_batch_norm_legit_no_training.default:
            continue
        conv = node.args[0]
        if (
            isinstance(conv, torch.fx.Node)
            and conv.target is aten.convolution.default
            and conv not in b.qplan.qout
            and len(conv.users) == 1
            and not conv.args[6]  # not transposed
            and all(b.ctx.is_static(a) for a in node.args[1:5])
            and b.ctx.is_static(conv.args[1])
            and (conv.args[2] is None or b.ctx.is_static(conv.args[2]))
        ):
            b.bn_folds[conv] = node


def plan_pad_folds(b: GraphBuilder) -> None:
    """Zero pads of H and W whose only user is a (non-transposed) convolution.

    Before::  %pad = constant_pad_nd(%x, [0, 1, 0, 1], 0.0)   %conv = convolution(%pad, %w, ...)
    After::   Conv2d(x) with padding right/bottom += 1
    """
    for node in b.ep.graph.nodes:
        if node.target is not aten.convolution.default or node.args[6]:
            continue
        pad = node.args[0]
        if (
            isinstance(pad, torch.fx.Node)
            and pad.target is aten.constant_pad_nd.default
            and len(pad.users) == 1
            and float(pad.args[2] if len(pad.args) > 2 else 0.0) == 0.0
            and len(pad.args[1]) <= 4
            and all(int(p) >= 0 for p in pad.args[1])
            and len(shape(pad)) == 4
        ):
            b.pad_folds.add(pad)


# --------------------------------------------------------------------------- lowering


def _conv1d_input(b: GraphBuilder, x_node: torch.fx.Node) -> int:
    """[N, C, L] -> NHWC [N, 1, L, C]: a transpose and a reshape."""
    n, c, length = shape(x_node)
    x = b.get(x_node, NCHW)
    nlc = b.define([n, length, c])
    b.add_node(fbx.NodeUnion.XNNStaticTranspose, transpose([0, 2, 1], x, nlc))
    nhwc = b.define([n, 1, length, c])
    b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape([n, 1, length, c], nlc, nhwc))
    return nhwc


def _conv1d_output(b: GraphBuilder, node: torch.fx.Node, nhwc: int) -> None:
    """NHWC [N, 1, L, O] -> [N, O, L]: a reshape and a transpose."""
    n, o, length = shape(node)
    nlo = b.define([n, length, o])
    b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape([n, length, o], nhwc, nlo))
    b.add_node(fbx.NodeUnion.XNNStaticTranspose, transpose([0, 2, 1], nlo, b.output(node)))


def _stable_keys(b: GraphBuilder, w_node, bias_node, bn) -> tuple[str | None, str | None]:
    """External weights: the filter's and bias's names (``conv.weight#filter``, with a folded
    BatchNorm ``conv.weight#filter+bn``; ``conv.bias#bias+bn``); None without stable keys."""
    if not b.stable_keys:
        return None, None
    weight = b.node_weight_name(w_node)
    fold = f"+{b.node_weight_name(bn.args[1]) or bn.name}" if bn is not None else ""
    source = b.node_weight_name(bias_node) if bias_node is not None else None
    filter_key = f"{weight}#filter{fold}" if weight else None
    bias_key = f"{source or (weight and weight + '~')}#bias{fold}" if (source or weight) else None
    return filter_key, bias_key


#: A folded BatchNorm's static arguments (``batch_norm(x, weight, bias, mean, var, ...)``).
BN_ROLES = ("bn_weight", "bn_bias", "bn_mean", "bn_var")


def conv_constants(args: dict, one_d: bool, transposed: bool, groups: int, bn: bool, eps: float | None,
                   exact: bool = True) -> tuple:
    """``(filter, bias or None, kernel, group_in, group_out, depthwise)`` of a convolution whose static
    ``args`` are ``weight`` ([O, I, (H,) W]), ``bias`` and a folded BatchNorm's (:data:`BN_ROLES`, with
    ``bn``), in float64 where ``exact`` (not a quantized weight's integers); the filter in XNNPACK's layout::

        OIHW -> OHWI;  depthwise -> [1, H, W, O];  transposed [g*in, out, H, W] -> [g*out, H, W, in]
        with a BatchNorm:  filter * scale (per output channel),  bias * scale + shift
    """
    weight = args["weight"].double() if exact else args["weight"]
    if one_d:
        weight = weight.unsqueeze(2)  # [O, I, K] -> [O, I, 1, K]
    bias = args["bias"].double() if args["bias"] is not None else None
    if bn:
        scale, shift = scale_shift(*(args[role] for role in BN_ROLES), eps)
        weight = weight * scale.reshape(-1, 1, 1, 1)
        bias = shift if bias is None else bias * scale + shift
    kernel = weight.shape
    if transposed:
        group_in, group_out = kernel[0] // groups, kernel[1]
    else:
        group_in, group_out = kernel[1], kernel[0] // groups
    depthwise = group_in == 1 and group_out % group_in == 0 and not transposed
    filt = weight.permute(TO_NHWC)  # OIHW -> OHWI
    if depthwise:
        filt = filt.permute(3, 1, 2, 0)  # -> [1, H, W, O]
    elif transposed:
        # [groups*in, out, H, W] -> [groups*out, H, W, in]: per group, swap in and out.
        w = weight.reshape(groups, group_in, group_out, kernel[2], kernel[3])
        filt = w.permute(0, 2, 3, 4, 1).reshape(groups * group_out, kernel[2], kernel[3], group_in)
    return filt, bias, kernel, group_in, group_out, depthwise


def conv_recipe(recipe: dict, args: dict) -> torch.Tensor:
    """A ``conv_filter`` / ``conv_bias`` recipe (:mod:`lowering.ptd_recipes`) on ``args`` (the
    static arguments :func:`conv_constants` takes, as tonight's weights): the filter or bias."""
    filt, bias, *_ = conv_constants(args, recipe["one_d"], recipe["transposed"], recipe["groups"], recipe["bn"],
                                    recipe["eps"])
    return filt if recipe["fn"] == "conv_filter" else bias


def lower_conv(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Conv2d / DepthwiseConv2d / ConvTranspose2d in NHWC, filter OHWI ([1,H,W,O] depthwise).
    A 1-D convolution is a 2-D one over [N, 1, L, C] (H = 1), reshaped in and out."""
    x_node, w_node, bias_node = node.args[0], node.args[1], node.args[2]
    one_d = len(shape(w_node)) == 3
    if one_d:
        stride, dilation = [1, int(node.args[3][0])], [1, int(node.args[5][0])]
        padding = [0, int(node.args[4][0])]
    else:
        stride, padding, dilation = pair(node.args[3]), pair(node.args[4]), pair(node.args[5])
    top, right, bottom, left = padding[0], padding[1], padding[0], padding[1]
    if x_node in b.pad_folds:  # a zero pad folded into this convolution
        pre, post = pads(x_node)
        top, bottom, left, right = top + pre[2], bottom + post[2], left + pre[3], right + post[3]
        x_node = x_node.args[0]
    transposed, output_padding, groups = bool(node.args[6]), pair(node.args[7]), int(node.args[8])
    qweight = b.qplan.weights.get(w_node) if b.qplan.quantized(node) else None
    bn = b.bn_folds.get(node) if qweight is None else None
    args = {"weight": qweight.data if qweight is not None else b.static_tensor(w_node),
            "bias": b.static_tensor(bias_node) if bias_node is not None else None,
            **{role: b.static_tensor(a) if bn is not None and a is not None else None
               for role, a in zip(BN_ROLES, bn.args[1:5] if bn is not None else (None,) * 4)}}
    config = {"one_d": one_d, "transposed": transposed, "groups": groups, "bn": bn is not None,
              "eps": float(bn.args[6]) if bn is not None else None}
    filt, bias, kernel, group_in, group_out, depthwise = conv_constants(args, **config, exact=qweight is None)
    if node in b.qplan.dynamic:  # quantized per image at run time; fp32 bias and result
        x = quantized.dynamic_input(b, b.qplan.dynamic[node], None, NHWC)
        filter_id = quantized.weight_constant(b, qweight, filt)
        bias_id = b.constant(bias.float()) if bias is not None else P.INVALID_ID
    elif qweight is not None:  # per-channel scales follow the output channel: dim 3 of a depthwise filter
        x = b.get(x_node, NHWC)
        filter_id = quantized.weight_constant(b, qweight, filt, channel_dim=3 if depthwise else 0)
        bias_id = (quantized.static_bias(b, bias, qweight, quantized.value_params(b, x))
                   if bias is not None else P.INVALID_ID)
    else:
        x = _conv1d_input(b, x_node) if one_d else b.get(x_node, NHWC)
        filter_key, bias_key = _stable_keys(b, w_node, bias_node, bn)
        filter_id = b.constant(b.derived(filt.float(), {"fn": "conv_filter", **config, "args": args}), key=filter_key)
        bias_id = b.constant(b.derived(bias.float(), {"fn": "conv_bias", **config, "args": args}), key=bias_key) \
            if bias is not None else P.INVALID_ID
    out = b.define([shape(node)[0], 1, shape(node)[2], shape(node)[1]]) if one_d else b.output(node, NHWC)
    body = fbx._XNNNodeConvT()
    body.paddingTop, body.paddingRight, body.paddingBottom, body.paddingLeft = top, right, bottom, left
    body.kernelHeight, body.kernelWidth = kernel[2], kernel[3]
    body.subsamplingHeight, body.subsamplingWidth = stride
    body.dilationHeight, body.dilationWidth = dilation
    body.groupInputChannels, body.groupOutputChannels, body.groups = group_in, group_out, groups
    body.adjustmentHeight, body.adjustmentWidth = (output_padding if transposed else [0, 0])
    body.input1Id, body.filterId, body.biasId, body.outputId, body.flags = x, filter_id, bias_id, out, 0
    kind = (fbx.NodeUnion.XNNDepthwiseConv2d if depthwise else
            fbx.NodeUnion.XNNConvTranspose2d if transposed else fbx.NodeUnion.XNNConv2d)
    b.add_node(kind, body, fusable_output=None if one_d else out)
    if one_d:
        _conv1d_output(b, node, out)
    if bn is not None:
        b.alias(bn, node)
