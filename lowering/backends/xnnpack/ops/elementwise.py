"""Elementwise ops: binary arithmetic, unary math, pow, clamps, leaky ReLU, PReLU.

Elementwise ops follow their inputs' layout (a 4-D value stays NHWC after a
convolution), so they add no transposes.  A relu / hardtanh / clamp after a
node that can take an ``output_min_max`` (FC, convolution, add, subtract,
multiply) with no other user becomes that node's clamp.  ``where(gt(x, 0), x,
w * x)`` with a static per-channel ``w`` (a decomposed PReLU) is one PReLU node.
A tanh-approximate GELU (XNNPACK's Gelu is exact) is its formula in six nodes::

    gelu(x, approximate="tanh")  ->  x * sigmoid(x * (a + b * x^2))    a = 2 sqrt(2/pi), b = 0.044715 a
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..values import NCHW, NHWC, Context, XnnpackPreprocessError, shape, val
from ..xnodes import min_max, node1x1, node2x1

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten

_INF = float("inf")

# --------------------------------------------------------------------------- binary

BINARY = {
    aten.add.Tensor: fbx.NodeUnion.XNNAdd,
    aten.sub.Tensor: fbx.NodeUnion.XNNSubtract,
    aten.mul.Tensor: fbx.NodeUnion.XNNMultiply,
    aten.div.Tensor: fbx.NodeUnion.XNNDiv,
    aten.maximum.default: fbx.NodeUnion.XNNMaximum,
    aten.minimum.default: fbx.NodeUnion.XNNMinimum,
    aten.add.Scalar: fbx.NodeUnion.XNNAdd,
    aten.sub.Scalar: fbx.NodeUnion.XNNSubtract,
    aten.mul.Scalar: fbx.NodeUnion.XNNMultiply,
    aten.div.Scalar: fbx.NodeUnion.XNNDiv,
}
_FUSABLE_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar}


def check_binary(node, ctx):
    if node.kwargs.get("alpha", 1) != 1 or (len(node.args) > 2 and node.args[2] != 1):
        return "alpha != 1"
    if node.kwargs.get("rounding_mode") is not None:
        return "rounding mode"
    for a in node.args[:2]:
        if not isinstance(a, (torch.fx.Node, int, float)) or isinstance(a, bool):
            return f"operand {a!r} is not a tensor or number"
    return None


def _operand_layout(b: GraphBuilder, node: torch.fx.Node) -> str:
    """NHWC when an activation operand is NHWC and every tensor operand is 4-D or a single number."""
    tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    active = [a for a in tensors if not b.ctx.is_static(a)]
    if not any(b.layout(a) == NHWC for a in active):
        return NCHW
    for a in tensors:
        t = val(a)
        if t.dim() != 4 and not (b.ctx.is_static(a) and t.numel() == 1):
            return NCHW
    if val(node).dim() != 4:
        return NCHW
    return NHWC


def _operand(b: GraphBuilder, arg: Any, layout: str) -> int:
    if not isinstance(arg, torch.fx.Node):
        return b.scalar(arg)
    static = b.static_qint8(arg, layout if val(arg).dim() == 4 else NCHW)
    if static is not None:
        return static
    if b.ctx.is_static(arg) and val(arg).numel() == 1:
        return b.constant(b.static_tensor(arg).reshape(1))
    if val(arg).dim() != 4:
        return b.get(arg, NCHW)
    return b.get(arg, layout)


def lower_binary(b: GraphBuilder, node: torch.fx.Node) -> None:
    layout = _operand_layout(b, node)
    x, y = (_operand(b, a, layout) for a in node.args[:2])
    out = b.output(node, layout)
    fusable = out if node.target in _FUSABLE_BINARY else None
    b.add_node(BINARY[node.target], node2x1(x, y, out), fusable_output=fusable)


# --------------------------------------------------------------------------- unary

UNARY = {
    aten.sigmoid.default: fbx.NodeUnion.XNNSigmoid,
    aten.tanh.default: fbx.NodeUnion.XNNTanh,
    aten.hardswish.default: fbx.NodeUnion.XNNHardswish,
    aten.abs.default: fbx.NodeUnion.XNNAbs,
    aten.neg.default: fbx.NodeUnion.XNNNegate,
    aten.exp.default: fbx.NodeUnion.XNNExp,
    aten.log.default: fbx.NodeUnion.XNNLog,
    aten.sqrt.default: fbx.NodeUnion.XNNSquareRoot,
    aten.rsqrt.default: fbx.NodeUnion.XNNReciprocalSquareRoot,
    aten.floor.default: fbx.NodeUnion.XNNFloor,
    aten.ceil.default: fbx.NodeUnion.XNNCeiling,
    aten.sin.default: fbx.NodeUnion.XNNSin,
    aten.cos.default: fbx.NodeUnion.XNNCos,
    aten.gelu.default: fbx.NodeUnion.XNNGelu,
}


def check_unary(node, ctx):
    return None  # a tanh-approximate GELU is lowered as its formula (_lower_gelu_tanh)


def lower_unary(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    if node.target is aten.gelu.default and node.kwargs.get("approximate", "none") == "tanh":
        _lower_gelu_tanh(b, x, out)
        return
    b.add_node(UNARY[node.target], node1x1(x, out))


#: 0.5 (1 + tanh(z)) = sigmoid(2z): gelu_tanh(x) = x * sigmoid(x * (_GELU_A + _GELU_B * x^2)).
_GELU_A = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_B = _GELU_A * 0.044715


def _lower_gelu_tanh(b: GraphBuilder, x: int, out: int) -> None:
    """The tanh-approximate GELU (XNNPACK's Gelu node is the exact one), as six nodes:
    Square, Multiply, Add, Multiply, Sigmoid, Multiply.  Left to the portable kernel it
    costs more than the six nodes (its scalar tanh) and cuts the delegate in two."""
    dims = b.dims[x]
    square, scaled, inner, arg, gate = (b.define(dims, datatype=P.DATATYPE_FP32) for _ in range(5))
    b.add_node(fbx.NodeUnion.XNNSquare, node1x1(x, square))
    b.add_node(fbx.NodeUnion.XNNMultiply, node2x1(square, b.scalar(_GELU_B), scaled))
    b.add_node(fbx.NodeUnion.XNNAdd, node2x1(scaled, b.scalar(_GELU_A), inner))
    b.add_node(fbx.NodeUnion.XNNMultiply, node2x1(inner, x, arg))
    b.add_node(fbx.NodeUnion.XNNSigmoid, node1x1(arg, gate))
    b.add_node(fbx.NodeUnion.XNNMultiply, node2x1(x, gate, out))


_POWERS = {2: "square", 3: "cube", 0.5: "sqrt", -0.5: "rsqrt"}


def check_pow(node, ctx):
    exponent = node.args[1]
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or exponent not in _POWERS:
        return f"exponent {exponent!r} (XNNPACK takes 2, 3, 0.5, -0.5)"
    return None


def lower_pow(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x**2 -> Square; x**3 -> Square, Multiply by x; x**0.5 -> SquareRoot; x**-0.5 -> ReciprocalSquareRoot."""
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    kind = _POWERS[node.args[1]]
    if kind == "cube":
        square = b.define(b.dims[x])
        b.add_node(fbx.NodeUnion.XNNSquare, node1x1(x, square))
        b.add_node(fbx.NodeUnion.XNNMultiply, node2x1(square, x, b.output(node, layout)))
        return
    op = {"square": fbx.NodeUnion.XNNSquare, "sqrt": fbx.NodeUnion.XNNSquareRoot,
          "rsqrt": fbx.NodeUnion.XNNReciprocalSquareRoot}[kind]
    b.add_node(op, node1x1(x, b.output(node, layout)))


# --------------------------------------------------------------------------- activations


def lower_leaky_relu(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    body = fbx.XNNLeakyReLUT()
    body.negativeSlope = float(node.args[1] if len(node.args) > 1 else 0.01)
    body.inputId, body.outputId, body.flags = x, out, 0
    b.add_node(fbx.NodeUnion.XNNLeakyReLU, body)


def _clamp_bounds(node: torch.fx.Node) -> tuple[float, float]:
    if node.target is aten.relu.default:
        return 0.0, _INF
    if node.target is aten.hardtanh.default:
        args = list(node.args) + [None, None]
        return float(args[1] if args[1] is not None else -1.0), float(args[2] if args[2] is not None else 1.0)
    args = list(node.args) + [None, None]
    lo = node.kwargs.get("min", args[1])
    hi = node.kwargs.get("max", args[2])
    return (-_INF if lo is None else float(lo)), (_INF if hi is None else float(hi))


def check_clamp(node, ctx):
    if node.target is aten.clamp.default:
        args = list(node.args[1:]) + list(node.kwargs.values())
        if any(isinstance(a, torch.fx.Node) for a in args):
            return "tensor bounds"
    return None


def lower_clamp(b: GraphBuilder, node: torch.fx.Node) -> None:
    """relu / hardtanh / clamp: the producer's ``output_min_max`` if it can take it, else a Clamp."""
    source = node.args[0]
    lo, hi = _clamp_bounds(node)
    if b.fuse_clamp(node, source, lo, hi):
        return
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    b.add_node(fbx.NodeUnion.XNNClamp, node1x1(x, out)).outputMinMax = min_max(lo, hi)


# --------------------------------------------------------------------------- PReLU


def prelu_parts(node: torch.fx.Node, ctx: Context):
    """``(x, slope node, gt, mul)`` if ``node`` is a decomposed PReLU, else None::

        %gt = gt.Scalar(%x, 0)   %mul = mul.Tensor(%w, %x)   %where = where.self(%gt, %x, %mul)

    with ``w`` static, one slope per channel (dim 1) or one for all, ``x`` fp32 2-D or 4-D,
    and ``gt`` and ``mul`` read only by the ``where``.
    """
    if node.target is not aten.where.self or len(node.args) != 3:
        return None
    cond, x, mul = node.args
    if not all(isinstance(a, torch.fx.Node) for a in (cond, x, mul)):
        return None
    if cond.target is not aten.gt.Scalar or cond.args[0] is not x or cond.args[1] != 0:
        return None
    if mul.target is not aten.mul.Tensor or x not in mul.args or len(cond.users) != 1 or len(mul.users) != 1:
        return None
    slope = mul.args[0] if mul.args[1] is x else mul.args[1]
    t = val(x)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() not in (2, 4):
        return None
    if not ctx.is_static(slope) or val(slope).numel() not in (1, t.shape[1]) or val(slope).dtype != torch.float32:
        return None
    dims = [1] * (t.dim() - val(slope).dim()) + list(val(slope).shape)  # as broadcast against x
    if len(dims) != t.dim() or any(d != 1 for i, d in enumerate(dims) if i != 1):
        return None  # the slopes must run along the channel dim
    return x, slope, cond, mul


def plan_prelu(b: GraphBuilder) -> None:
    """The comparison and the product of a decomposed PReLU are computed by its PReLU node."""
    for node in b.ep.graph.nodes:
        parts = prelu_parts(node, b.ctx) if node.target is aten.where.self else None
        if parts is not None:
            b.skip.update(parts[2:])


def check_where(node, ctx):
    return None if prelu_parts(node, ctx) is not None else "where other than a decomposed PReLU"


def check_gt(node, ctx):
    users = list(node.users)
    if len(users) == 1 and prelu_parts(users[0], ctx) is not None:
        return None
    return "comparison other than a decomposed PReLU's"


def lower_prelu(b: GraphBuilder, node: torch.fx.Node) -> None:
    """PReLU: channels last (NHWC for 4-D), one slope per channel."""
    x_node, slope_node, _, _ = prelu_parts(node, b.ctx)
    channels = shape(x_node)[1]
    slope = b.static_tensor(slope_node).reshape(-1).expand(channels)
    layout = NHWC if len(shape(x_node)) == 4 else NCHW
    x = b.get(x_node, layout)
    out = b.output(node, layout)
    b.add_node(fbx.NodeUnion.XNNPReLU, node2x1(x, b.constant(slope), out))


def lower_gt(b: GraphBuilder, node: torch.fx.Node) -> None:
    raise XnnpackPreprocessError(f"node {node.name!r}: a comparison is only lowered inside a PReLU")
