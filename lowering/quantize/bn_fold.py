"""BatchNorm after a convolution, folded into the convolution (before observing).

Static int8 quantizes the convolution's weight; the BatchNorm's affine map
would otherwise run in fp32 between a dequantize and a quantize.  With
``s = gamma / sqrt(var + eps)``: ``W' = W * s`` (per output channel) and
``b' = (b - mean) * s + beta``.

Before::

    %conv = aten.convolution.default(%x, %p_c1_weight, %p_c1_bias, ...)
    %bn = aten._native_batch_norm_legit_no_training.default(%conv, %p_bn_weight, %p_bn_bias,
                                                            %b_bn_running_mean, %b_bn_running_var, 0.1, 1e-05)
    %getitem = getitem(%bn, 0)
    %relu = aten.relu.default(%getitem)

After::

    %c__bn_folded_weight_conv = placeholder   # W'
    %c__bn_folded_bias_conv = placeholder     # b'
    %conv = aten.convolution.default(%x, %c__bn_folded_weight_conv, %c__bn_folded_bias_conv, ...)
    %relu = aten.relu.default(%conv)

Only a non-transposed convolution whose only reader is the BatchNorm, with
constant weight / bias / statistics, is folded; anything else stays as it is.
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram

from .graph import add_constant, constant_value, remove_unused

BATCH_NORM = torch.ops.aten._native_batch_norm_legit_no_training.default


def fold_batch_norms(program: ExportedProgram) -> int:
    """Fold every foldable conv -> BatchNorm pair of ``program`` in place; returns the count.
    The caller recompiles."""
    count = 0
    for bn in list(program.graph.nodes):
        if bn.op == "call_function" and bn.target is BATCH_NORM and _fold(program, bn):
            count += 1
    if count:
        remove_unused(program)
    return count


def _fold(program: ExportedProgram, bn: torch.fx.Node) -> bool:
    conv = bn.args[0]
    if not (isinstance(conv, torch.fx.Node) and conv.target is torch.ops.aten.convolution.default):
        return False
    if len(conv.users) != 1 or conv.args[6]:  # read elsewhere, or transposed
        return False
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in bn.users):
        return False
    weight = constant_value(program, conv.args[1])
    bias = constant_value(program, conv.args[2]) if conv.args[2] is not None else None
    if weight is None or (conv.args[2] is not None and bias is None):
        return False
    stats = [constant_value(program, a) if isinstance(a, torch.fx.Node) else None for a in bn.args[1:5]]
    gamma, beta, mean, var = stats
    if mean is None or var is None or any(
        a is not None and s is None for a, s in zip(bn.args[1:3], stats[:2])
    ):
        return False
    eps = float(bn.args[6])
    with torch.no_grad():
        scale = (gamma if gamma is not None else torch.ones_like(var)) / torch.sqrt(var + eps)
        new_weight = weight * scale.reshape([-1] + [1] * (weight.dim() - 1))
        base = bias if bias is not None else torch.zeros_like(mean)
        new_bias = (base - mean) * scale + (beta if beta is not None else torch.zeros_like(mean))
    w = add_constant(program, f"_bn_folded_weight_{conv.name}", new_weight.to(weight.dtype), meta_from=conv)
    b = add_constant(program, f"_bn_folded_bias_{conv.name}", new_bias.to(weight.dtype), meta_from=conv)
    args = list(conv.args)
    args[1], args[2] = w, b
    conv.args = tuple(args)
    for user in list(bn.users):
        user.replace_all_uses_with(conv)
        program.graph.erase_node(user)
    program.graph.erase_node(bn)
    return True
