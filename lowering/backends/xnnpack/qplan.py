"""Which nodes of a program XNNPACK computes quantized: the plan both partitioner and preprocess follow.

Static groups (every tensor input a dq, or a node computing quantized already;
the single user, after an optional fused clamp, a q)::

    %dq = dequantize_per_tensor(%q0, s0, z0)   %w = permute_copy(dequantize_per_channel(%w_i8, ...), [1, 0])
    %fc = addmm(%b, %dq, %w)   %r = relu(%fc)   %q1 = quantize_per_tensor(%r, s1, z1)
    ->  FC(qint8 s0/z0, qcint8, qcint32) -> qint8 s1/z1 with output_min_max (0, inf); %q1 is its value

Dynamic groups (the activation quantized per row at run time, fp32 out)::

    %cq = choose_qparams(%x)  %s, %z = getitem(%cq, 0/1)
    %xq = quantize(%x, %s, %z)  %xd = dequantize(%xq, %s, %z)  [%v = view_copy(%xd)]
    %y = addmm(%b, %v, permute_copy(%w_dq, [1, 0]))
    ->  Convert(x -> qdint8) -> FC(qdint8, qcint8 | qbint4, fp32) -> fp32

Every other per-tensor q/dq is a Convert (fp32 <-> qint8); an op whose quantized
form the runtime refuses (qint8 softmax, average pooling, bmm; max pooling,
pads, copies and reshapes with different in/out parameters) runs in fp32
between Converts.  Weights XNNPACK would compute wrong are recorded in
:attr:`QuantPlan.refusals` (the partitioner raises them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from .qparams import (ACT_DQ, ACT_Q, CHOOSE_QPARAMS, DYNAMIC_DQ, DYNAMIC_Q, WEIGHT_DQ, QParams, QuantWeightError,
                      QWeight, act_qparams, is_op, per_token_block, weight_of)

aten = torch.ops.aten

CLAMPS = {aten.relu.default, aten.hardtanh.default, aten.clamp.default}
GEMMS = {aten.addmm.default, aten.mm.default}
#: Ops XNNPACK computes on qint8 with any input and output parameters.
FREE_PARAMS = GEMMS | CLAMPS | {aten.convolution.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
                                aten.mean.dim}
#: Ops XNNPACK computes on qint8 only when the input and output parameters are equal.
SAME_PARAMS = {aten.max_pool2d_with_indices.default, aten.cat.default, aten.permute_copy.default,
               aten.view_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims,
               aten.squeeze_copy.dim, aten.slice_copy.Tensor, aten.clone.default, aten.alias_copy.default}
#: Reshapes a static group may reach through (they compute quantized with the group's parameters).
RESHAPES = {aten.view_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims, aten.squeeze_copy.dim}
#: Ops that may read a static per-tensor dq (an int8 constant) as a qint8 constant operand.
STATIC_OPERAND = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor}
#: Ops whose quantized result may carry a fused clamp.
FUSING = GEMMS | {aten.convolution.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor}


@dataclass
class QuantPlan:
    #: node -> the parameters of its qint8 result (the node computes quantized).
    qout: dict[torch.fx.Node, QParams] = field(default_factory=dict)
    #: dynamic gemm -> the fp32 node its activation quantizes (before choose_qparams).
    dynamic: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    #: weight dq node -> its integers and scales (of gemms / convolutions computing quantized).
    weights: dict[torch.fx.Node, QWeight] = field(default_factory=dict)
    #: nodes of dynamic groups lowered with their gemm (choose_qparams, getitems, q, dq, views).
    dynamic_parts: set[torch.fx.Node] = field(default_factory=set)
    #: node -> why XNNPACK would compute its quantized weight wrong.
    refusals: dict[torch.fx.Node, str] = field(default_factory=dict)
    #: static per-tensor dq (of an int8 constant) -> its parameters, read as a qint8 constant by
    #: the elementwise nodes computing quantized (:data:`STATIC_OPERAND`); fp32 readers read it dequantized.
    static_q: dict[torch.fx.Node, QParams] = field(default_factory=dict)

    def quantized(self, node: torch.fx.Node) -> bool:
        return node in self.qout or node in self.dynamic


def plan_quantization(graph: torch.fx.Graph, ctx) -> QuantPlan:
    plan = QuantPlan()
    if not any(is_op(n, WEIGHT_DQ | DYNAMIC_DQ) for n in graph.nodes):
        return plan  # fp32: nothing to plan
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if (node.target in GEMMS or node.target is aten.convolution.default) and _plan_dynamic(plan, node, ctx):
            continue
        if node.target in FREE_PARAMS or node.target in SAME_PARAMS:
            _plan_static(plan, node, ctx)
    _drop_partial_dynamic_groups(plan, [n for n in graph.nodes if _dynamic_group(n) is not None])
    return plan


# --------------------------------------------------------------------------- weights


def _weight(plan: QuantPlan, node: torch.fx.Node, dq: torch.fx.Node, ctx) -> QWeight | None:
    """The quantized weight read through ``dq`` by ``node`` (refusals recorded), or None."""
    if not is_op(dq, WEIGHT_DQ) or not ctx.is_static(dq):
        return None
    try:
        w = weight_of(dq, lambda a: ctx.static_value(a))
    except QuantWeightError as e:
        plan.refusals[node] = f"weight {dq.name!r}: {e}"
        return None
    plan.weights[dq] = w
    return w


def _gemm_weight_dq(node: torch.fx.Node) -> torch.fx.Node | None:
    """``W`` of ``addmm(b, x, permute_copy(W, [1, 0]))`` / ``mm(x, permute_copy(W, [1, 0]))``."""
    w = node.args[2] if node.target is aten.addmm.default else node.args[1]
    if is_op(w, aten.permute_copy.default) and [int(p) % 2 for p in w.args[1]] == [1, 0]:
        return w.args[0]
    return None


def _bias_ok(node: torch.fx.Node, ctx) -> bool:
    bias = node.args[0] if node.target is aten.addmm.default else (
        node.args[2] if node.target is aten.convolution.default else None)
    if bias is None or not ctx.is_static(bias):
        return bias is None
    return bias.meta["val"].dtype == torch.float32 and bias.meta["val"].numel() == node.meta["val"].shape[
        1 if node.target is aten.convolution.default else -1]


# --------------------------------------------------------------------------- dynamic


def _plan_dynamic(plan: QuantPlan, node: torch.fx.Node, ctx) -> bool:
    if node.target is aten.convolution.default:
        return _plan_dynamic_conv(plan, node, ctx)
    act = node.args[1] if node.target is aten.addmm.default else node.args[0]
    views = []
    while is_op(act, aten.view_copy.default) and len(act.users) == 1:
        views.append(act)
        act = act.args[0]
    group = _dynamic_group(act)
    if group is None:
        return False
    dq_w = _gemm_weight_dq(node)
    if dq_w is None or not _bias_ok(node, ctx):
        return False
    w = _weight(plan, node, dq_w, ctx)
    if w is not None and w.kind == "tensor":
        plan.refusals[node] = (f"weight {dq_w.name!r}: per-tensor weight with a dynamically quantized activation "
                               "(XNNPACK needs per-channel or per-group weights)")
    if w is None or w.kind == "tensor" or w.axis != 0:
        return False
    plan.dynamic[node] = group[0]
    plan.dynamic_parts.update(group[1:] + views)
    return True


def _plan_dynamic_conv(plan: QuantPlan, node: torch.fx.Node, ctx) -> bool:
    """A 2-D, non-transposed, ungrouped convolution of a dynamically quantized activation
    (qdint8 per image in NHWC, qcint8 filter, fp32 bias and result)."""
    group = _dynamic_group(node.args[0])
    w_shape = node.args[1].meta["val"].shape
    if group is None or len(w_shape) != 4 or w_shape[1] == 1 or node.args[6] or int(node.args[8]) != 1:
        return False
    if not _bias_ok(node, ctx):
        return False
    w = _weight(plan, node, node.args[1], ctx)
    if w is None or w.kind != "channel" or w.bits != 8 or w.axis != 0:
        return False
    plan.dynamic[node] = group[0]
    plan.dynamic_parts.update(group[1:])
    return True


def _drop_partial_dynamic_groups(plan: QuantPlan, dqs: list[torch.fx.Node]) -> None:
    """A dynamic group is lowered with its gemms: every reader of its dq (through reshapes) must
    be a gemm planned dynamic, or nothing of the group is (it has no fp32 value to give), and the
    first other reader is refused (the program would keep q/dq ops it has no kernel for)."""
    for dq in dqs:
        readers, frontier = [], list(dq.users)
        while frontier:
            user = frontier.pop()
            if user in plan.dynamic_parts and user.target is aten.view_copy.default:
                frontier.extend(user.users)
            else:
                readers.append(user)
        if all(r in plan.dynamic for r in readers):
            continue
        other = next(r for r in readers if r not in plan.dynamic)
        for r in readers:
            plan.dynamic.pop(r, None)
        plan.refusals.setdefault(other, (
            f"it reads the dynamically quantized activation {dq.name!r}: XNNPACK takes dynamic quantization only "
            "into linears (addmm / mm of a quantized weight) and 2-D convolutions, and leftover dynamic q/dq "
            "ops have no kernel in the program"))
        q = dq.args[0]
        scale = q.args[2] if is_op(q, "torchao::quantize_affine") else q.args[1]
        group = {dq, q, scale.args[0], *scale.args[0].users}
        views = {v for v in plan.dynamic_parts if v.target is aten.view_copy.default and _reaches(v, dq)}
        plan.dynamic_parts -= group | views


def _reaches(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    while node.target is aten.view_copy.default:
        node = node.args[0]
    return node is source


def _dynamic_group(dq: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``[x, choose_qparams, getitem 0, getitem 1, q, dq]`` of a dynamically quantized activation."""
    if not is_op(dq, DYNAMIC_DQ):
        return None
    q = dq.args[0]
    if not is_op(q, DYNAMIC_Q):
        return None
    affine = is_op(q, "torchao::quantize_affine")
    x, scale, zp = (q.args[0], q.args[2], q.args[3]) if affine else q.args[:3]
    if affine and not (per_token_block(q) and per_token_block(dq)):
        return None
    if not (scale.target is operator.getitem and zp.target is operator.getitem and scale.args[0] is zp.args[0]):
        return None
    choose = scale.args[0]
    if not is_op(choose, CHOOSE_QPARAMS) or choose.args[0] is not x:
        return None
    if x.meta["val"].dtype != torch.float32:
        return None
    return [x, choose, scale, zp, q, dq]


# --------------------------------------------------------------------------- static


def _plan_static(plan: QuantPlan, node: torch.fx.Node, ctx) -> None:
    inputs = _activation_inputs(node)
    if inputs is None or not inputs:
        return
    statics = {a: _static_params(a, ctx) for a in inputs} if node.target in STATIC_OPERAND else {}
    statics = {a: p for a, p in statics.items() if p is not None}
    found = [(statics[a], []) if a in statics else _input_params(plan, a) for a in inputs]
    if any(f is None for f in found) or len(statics) == len(inputs):
        return
    in_params = [f[0] for f in found]
    if node.target in GEMMS or node.target is aten.convolution.default:
        if not _static_weight_ok(plan, node, ctx):
            return
    out = _output_params(node)
    if out is None:
        return
    if node.target in SAME_PARAMS and not all(out.same(p) for p in in_params):
        return  # XNNPACK needs equal parameters: fp32 between Converts
    if node.target is aten.mean.dim and not _global_pool(node):
        return
    plan.qout[node] = out
    plan.static_q.update(statics)
    for params, views in found:
        plan.qout.update(dict.fromkeys(views, params))
    if node.target is aten.max_pool2d_with_indices.default:
        plan.qout[next(iter(node.users))] = out  # its getitem 0


def _activation_inputs(node: torch.fx.Node) -> list | None:
    """The operands that carry activations (weights and biases excluded); None if one is not a node."""
    if node.target is aten.addmm.default:
        return [node.args[1]]
    if node.target in (aten.mm.default, aten.convolution.default):
        return [node.args[0]]
    if node.target is aten.cat.default:
        args = list(node.args[0])
    elif node.target in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor):
        if node.kwargs.get("alpha", 1) != 1:
            return None
        args = list(node.args[:2])
    else:
        args = [node.args[0]]
    return args if all(isinstance(a, torch.fx.Node) for a in args) else None


def _input_params(plan: QuantPlan, arg: torch.fx.Node) -> tuple[QParams, list] | None:
    """The parameters ``arg`` carries, and the reshapes between it and a dq (they compute quantized too)."""
    views = []
    while arg not in plan.qout and arg.target in RESHAPES and len(arg.users) == 1:
        views.append(arg)
        arg = arg.args[0]
    if arg in plan.qout:
        return plan.qout[arg], views
    if is_op(arg, ACT_DQ):
        params = act_qparams(arg)
        if params is not None and params.same(act_qparams(arg.args[0])):
            return params, views
    return None


def _static_params(arg: torch.fx.Node, ctx) -> QParams | None:
    """The parameters of ``arg`` if it is a per-tensor int8 dq of a static int8 tensor (a constant
    the quantizer folded, e.g. BERT's position embeddings), else None.

    Before: ``%c = dequantize_per_tensor(%_frozen_param14, 0.00054, -15, -128, 127, int8)``
            ``%a = add(%dq_x, %c)``  ->  fp32 Add of a dequantized fp32 constant (4 bytes a value)
    After:  qint8 Add of the int8 constant with those parameters (1 byte a value, no Converts)
    """
    params = act_qparams(arg) if is_op(arg, ACT_DQ) else None
    source = arg.args[0] if params is not None else None
    if source not in ctx.static_targets or ctx.tensor(source).dtype != torch.int8:
        return None
    return params


def _static_weight_ok(plan: QuantPlan, node: torch.fx.Node, ctx) -> bool:
    if node.target is aten.convolution.default:
        dq, transposed, groups = node.args[1], bool(node.args[6]), int(node.args[8])
        if len(node.args[1].meta["val"].shape) != 4:
            return False
    else:
        dq, transposed, groups = _gemm_weight_dq(node), False, 1
    if dq is None or not _bias_ok(node, ctx):
        return False
    w = _weight(plan, node, dq, ctx)
    if w is None or w.bits != 8 or w.kind == "group":
        return False
    if w.kind == "channel" and w.axis != (1 if transposed else 0):
        return False
    return not (transposed and groups != 1 and w.kind == "channel")


def _output_params(node: torch.fx.Node) -> QParams | None:
    """The parameters of the q reading ``node`` (through a fused clamp, or max pooling's getitem 0)."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if node.target is aten.max_pool2d_with_indices.default:
        if user.target is not operator.getitem or user.args[1] != 0 or len(user.users) != 1:
            return None
        user = next(iter(user.users))
    user = _past_reshapes(user)
    if node.target in FUSING and user.target in CLAMPS and len(user.users) == 1:
        if user.target is aten.clamp.default and any(isinstance(a, torch.fx.Node) for a in user.args[1:]):
            return None
        user = _past_reshapes(next(iter(user.users)))
    params = act_qparams(user) if is_op(user, ACT_Q) else None
    return params


def _past_reshapes(node: torch.fx.Node) -> torch.fx.Node:
    while node.target in RESHAPES and len(node.users) == 1:
        node = next(iter(node.users))
    return node


def _global_pool(node: torch.fx.Node) -> bool:
    dims = sorted(int(d) % 4 for d in node.args[1])
    return len(node.args[0].meta["val"].shape) == 4 and dims == [2, 3]
