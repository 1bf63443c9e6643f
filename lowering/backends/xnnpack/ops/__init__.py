"""The table of ops XNNPACK takes: ATen target -> :class:`OpRule` (check + lowering).

Each op family's checks and lowerings live in its own room:

- :mod:`.elementwise`: binary and unary arithmetic, pow, clamps, leaky ReLU, PReLU;
- :mod:`.linear`: ``addmm`` / ``mm`` (FullyConnected), ``bmm``;
- :mod:`.convolution`: 1-D and 2-D, depthwise and transposed convolution;
- :mod:`.pooling`: max / average pooling, mean, amax, bilinear upsampling;
- :mod:`.normalization`: layer norm, BatchNorm, softmax;
- :mod:`.shape`: copies, reshapes, permute, slices, split, cat, pad, getitem.

:data:`OPS` is the one place that says what XNNPACK takes: the partitioner
asks :func:`check_node` (the generic fp32 / size checks, then the op's own
check) and reads :attr:`OpRule.static_operands`; preprocess lowers a node with
its rule's ``lower``, after running the :data:`PLANS` over the whole graph.
Adding an op (or a quantized form of one) is a check and a lowering in its
family's room and an entry here; :mod:`..fused` adds its fused ops with
:func:`register`.  ``getitem`` has no entry: the partitioner takes it with its
source, and the walk lowers every one with :func:`lower_getitem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..values import Context, val
from ..qparams import op_key
from . import convolution, elementwise, linear, normalization, pooling, quantized, shape
from .shape import lower_getitem

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten


def _no_check(node: torch.fx.Node, ctx: Context) -> str | None:
    return None


def _any_sizes(node: torch.fx.Node) -> str | None:
    return None


@dataclass(frozen=True)
class OpRule:
    """How one ATen op goes to XNNPACK.

    ``check(node, ctx)`` is why the op's attributes rule the node out (None: they
    do not); ``lower(builder, node)`` appends its XNN values and nodes.
    """

    lower: Callable[[GraphBuilder, torch.fx.Node], None]
    check: Callable[[torch.fx.Node, Context], str | None] = _no_check
    #: ``symbolic_sizes(node) -> reason or None`` when XNNPACK can take the op with
    #: symbolic sizes (the runtime reshapes the graph before each run); None: static sizes only.
    symbolic_sizes: Callable[[torch.fx.Node], str | None] | None = None
    #: Results after the first may be of any dtype (they must be unused, e.g. max pooling's indices).
    extra_results: bool = False
    #: The op's check looks at dtypes itself (a pattern with a bool value inside); the generic
    #: fp32 and 0-dim checks are skipped.
    checks_dtypes: bool = False
    #: Operand positions that must be static data owned by the partition (the partitioner
    #: takes the node only if every user of such an operand is taken too).
    static_operands: tuple[int, ...] = ()


def _each(targets, rule: OpRule) -> dict[Any, OpRule]:
    return dict.fromkeys(targets, rule)


OPS: dict[Any, OpRule] = {
    # elementwise
    **_each(elementwise.BINARY, OpRule(elementwise.lower_binary, elementwise.check_binary, symbolic_sizes=_any_sizes)),
    **_each(elementwise.UNARY, OpRule(elementwise.lower_unary, elementwise.check_unary, symbolic_sizes=_any_sizes)),
    aten.pow.Tensor_Scalar: OpRule(elementwise.lower_pow, elementwise.check_pow, symbolic_sizes=_any_sizes),
    aten.leaky_relu.default: OpRule(elementwise.lower_leaky_relu, symbolic_sizes=_any_sizes),
    **_each((aten.relu.default, aten.hardtanh.default, aten.clamp.default),
            OpRule(elementwise.lower_clamp, elementwise.check_clamp, symbolic_sizes=_any_sizes)),
    # PReLU: where(gt(x, 0), x, w * x), lowered at the where
    aten.where.self: OpRule(elementwise.lower_prelu, elementwise.check_where, checks_dtypes=True),
    aten.gt.Scalar: OpRule(elementwise.lower_gt, elementwise.check_gt, checks_dtypes=True),
    # linear
    **_each((aten.addmm.default, aten.mm.default),
            OpRule(linear.lower_fully_connected, linear.check_fully_connected, symbolic_sizes=_any_sizes)),
    aten.bmm.default: OpRule(linear.lower_bmm),
    # convolution
    aten.convolution.default: OpRule(convolution.lower_conv, convolution.check_conv, static_operands=(1, 2)),
    # pooling
    aten.max_pool2d_with_indices.default: OpRule(pooling.lower_pool, pooling.check_pool, extra_results=True),
    aten.avg_pool2d.default: OpRule(pooling.lower_pool, pooling.check_pool),
    aten.mean.dim: OpRule(pooling.lower_mean, pooling.check_mean),
    aten.amax.default: OpRule(pooling.lower_amax, pooling.check_amax),
    aten.upsample_bilinear2d.vec: OpRule(pooling.lower_upsample, pooling.check_upsample),
    # normalization
    aten.native_layer_norm.default: OpRule(normalization.lower_layer_norm, normalization.check_layer_norm,
                                           extra_results=True),
    aten._native_batch_norm_legit_no_training.default: OpRule(
        normalization.lower_batch_norm, normalization.check_batch_norm, extra_results=True,
        static_operands=(1, 2, 3, 4)),
    aten._softmax.default: OpRule(normalization.lower_softmax, normalization.check_softmax,
                                  symbolic_sizes=normalization.softmax_symbolic_sizes),
    # shape
    **_each((aten.clone.default, aten.alias_copy.default, aten._to_copy.default),
            OpRule(shape.lower_copy, shape.check_copy)),
    **_each((aten.view_copy.default, aten._unsafe_view.default, aten.squeeze_copy.dims, aten.squeeze_copy.dim,
             aten.squeeze_copy.default, aten.unsqueeze_copy.default),
            OpRule(shape.lower_reshape, symbolic_sizes=shape.reshape_symbolic_sizes)),
    aten.expand_copy.default: OpRule(shape.lower_expand, shape.check_expand),
    aten.permute_copy.default: OpRule(shape.lower_permute, symbolic_sizes=_any_sizes),
    aten.slice_copy.Tensor: OpRule(shape.lower_slice, shape.check_slice),
    aten.select_copy.int: OpRule(shape.lower_select),
    **_each((aten.split_with_sizes_copy.default, aten.split_copy.Tensor), OpRule(shape.lower_split)),
    aten.cat.default: OpRule(shape.lower_cat, shape.check_cat, symbolic_sizes=shape.cat_symbolic_sizes),
    aten.constant_pad_nd.default: OpRule(shape.lower_pad, shape.check_pad),
    # quantization (which nodes compute quantized: ..qplan); torchao's ops are keyed by name
    quantized.qd.quantize_per_tensor.default: OpRule(quantized.lower_act_q, quantized.check_act_q,
                                                     checks_dtypes=True),
    quantized.qd.dequantize_per_tensor.default: OpRule(quantized.lower_act_dq, quantized.check_dequantize_per_tensor,
                                                       checks_dtypes=True),
    **_each((quantized.qd.dequantize_per_channel.default, "torchao::dequantize_affine"),
            OpRule(quantized.lower_not_alone, quantized.check_weight_dq, checks_dtypes=True)),
    **_each((quantized.qd.choose_qparams.tensor, quantized.qd.quantize_per_tensor.tensor,
             quantized.qd.dequantize_per_tensor.tensor, "torchao::choose_qparams_affine",
             "torchao::quantize_affine"),
            OpRule(quantized.lower_not_alone, quantized.check_dynamic_part, checks_dtypes=True)),
}

#: Passes over the whole partition before the walk, each recording in the builder which
#: nodes a pattern lowers with another node (in this order).
PLANS: tuple[Callable[[GraphBuilder], None], ...] = (
    convolution.plan_batch_norm_folds,
    convolution.plan_pad_folds,
    linear.plan_weight_views,
    linear.plan_batched_inputs,
    linear.plan_quantized_batched_inputs,
    elementwise.plan_prelu,
)


def rule_of(target: Any) -> OpRule | None:
    """The rule of an op (torchao's looked up by name)."""
    return OPS.get(op_key(target))


def register(target: Any, rule: OpRule) -> None:
    """Add ``target`` to the table (for ops defined outside ATen, e.g. :mod:`..fused`)."""
    OPS[target] = rule


# --------------------------------------------------------------------------- checks


def check_node(node: torch.fx.Node, ctx: Context) -> str | None:
    """Why the runtime cannot take ``node`` (None if it can)."""
    rule = rule_of(node.target)
    if rule is None:
        return f"no XNNPACK lowering for {node.target}"
    if rule.checks_dtypes:
        return rule.check(node, ctx)
    reason = _check_dtypes(node, rule) or _check_zero_dim(node, ctx)
    return reason or rule.check(node, ctx)


def _check_zero_dim(node: torch.fx.Node, ctx: Context) -> str | None:
    """0-dim values could cross the delegate boundary, where the runtime sees no dims: keep
    them inside (static scalars are fine: they become 1-element constants)."""
    if isinstance(val(node), torch.Tensor) and val(node).dim() == 0:
        return "0-dim result"
    for a in node.all_input_nodes:
        if val(a).dim() == 0 and not ctx.is_static(a):
            return f"0-dim input {a.name!r}"
    return None


def _check_dtypes(node: torch.fx.Node, rule: OpRule) -> str | None:
    """Every tensor in and out is a non-empty fp32 tensor with static shape."""
    outs = val(node)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    ins = [val(a) for a in node.all_input_nodes]
    for i, t in enumerate(outs):
        if i > 0 and rule.extra_results:
            continue  # e.g. the indices of max_pool2d_with_indices (must be unused)
        if not isinstance(t, torch.Tensor):
            return "result is not a tensor"
    for t in [o for i, o in enumerate(outs) if not (i > 0 and rule.extra_results)] + ins:
        if not isinstance(t, torch.Tensor):
            return "an input is not a tensor"
        if t.dtype != torch.float32:
            return f"dtype {t.dtype} (only float32)"
        if any(not isinstance(d, int) for d in t.shape):
            reason = _dynamic_reason(node, rule)
            if reason:
                return reason
        if t.numel() == 0:
            return "empty tensor"
        if t.dim() > 6:
            return "more than 6 dims"
    return None


def _dynamic_reason(node: torch.fx.Node, rule: OpRule) -> str | None:
    """Why a node with a symbolic size cannot be delegated (None: it can).

    XNNPACK reshapes its graph to the actual input sizes at run time, which is
    right for ops whose attributes do not depend on the sizes: elementwise
    ops (and pow), fully connected (a dynamic batch of rows), softmax over a static
    last dim, reshape to one symbolic size, permute and concatenation along a static dim (:attr:`OpRule.symbolic_sizes`).  Others bake sizes into the graph
    (reshape, slice, concat, pad, ...) and stay in the portable program.
    """
    if rule.symbolic_sizes is None:
        return ("dynamic shape: XNNPACK takes symbolic sizes only in elementwise ops, "
                "fully connected and softmax")
    return rule.symbolic_sizes(node)


__all__ = ["OPS", "PLANS", "OpRule", "check_node", "lower_getitem", "register", "rule_of"]
