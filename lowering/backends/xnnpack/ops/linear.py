"""Matrix products: ``addmm`` / ``mm`` (FullyConnected) and ``bmm``.

A static weight is a constant in ``[K, N]`` read with the transpose-weights
flag; a runtime weight that is a transpose of a delegate input is read
untransposed (:func:`plan_weight_views`).  An N-D input flattened for the
product and unflattened after it is read and written N-D (:func:`plan_batched_inputs`).
``bmm`` by a static weight repeated over the batch is a FullyConnected too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ....delegation import SHARED_WITH_TOP_LEVEL
from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..qparams import ACT_DQ, ACT_Q, is_op
from ..values import NCHW, shape, val
from ..xnodes import node2x1
from . import quantized

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten

#: Ops with ``addmm``'s arguments (bias, input, transposed weight): ``aten.addmm`` and
#: the fused ops of :mod:`..fused` that add an activation to it.
ADDMM_LIKE: set[Any] = {aten.addmm.default}


def check_fully_connected(node, ctx):
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "alpha/beta != 1"
    weight = node.args[2] if node.target in ADDMM_LIKE else node.args[1]
    if not ctx.is_static(weight) and val(weight).dim() != 2:
        return "weight is not 2-D"
    if node.target in ADDMM_LIKE:
        bias = node.args[0]
        if val(bias).numel() != val(node).shape[-1]:
            return "bias is not one value per output"
    return None


def plan_weight_views(b: GraphBuilder) -> None:
    """Transposes of runtime 2-D values used only as FullyConnected weights.

    Before::  %t = permute_copy(%w, [1, 0])    %mm = mm(%x, %t)      (%w a delegate input)
    After::   FullyConnected(x, w) without the transpose-weights flag: w is [N, K] already
    """
    weight_arg = {aten.mm.default: 1, **dict.fromkeys(ADDMM_LIKE, 2)}
    for node in b.ep.graph.nodes:
        if (
            node.target is aten.permute_copy.default
            and not b.ctx.is_static(node)
            and len(shape(node)) == 2
            and [int(p) % 2 for p in node.args[1]] == [1, 0]
            and node.users
            and all(weight_arg.get(u.target) is not None and u.args[weight_arg[u.target]] is node
                    and node not in u.args[:weight_arg[u.target]] for u in node.users)
        ):
            b.weight_views.add(node)


def plan_batched_inputs(b: GraphBuilder) -> None:
    """An fp32 or statically quantized product whose input is an N-D value flattened to 2-D,
    and whose only user unflattens the result to the same leading dims, reads and writes N-D
    (FullyConnected takes every dim but the last as its batch, as ExecuTorch lowers ``linear``;
    quantized, the two reshapes compute on qint8 with the product's input and output parameters).

    Before::  %flat = view_copy(%x, [S, K])   %mm = mm(%flat, %w)   %y = view_copy(%mm, [1, S, N])
              (%x: [1, S, K]; %flat and %mm have no other users)
    After::   FullyConnected(x [1, S, K], w) -> y [1, S, N]: no StaticReshape before or after
    """
    input_arg = {aten.mm.default: 0, **dict.fromkeys(ADDMM_LIKE, 1)}
    for node in b.ep.graph.nodes:
        index = input_arg.get(node.target)
        if index is None or node in b.qplan.dynamic or node in b.qplan.dynamic_parts:
            continue
        flat = node.args[index]
        if not _is_view(flat) or len(flat.users) != 1 or b.ctx.is_static(flat) or len(node.users) != 1:
            continue
        (unflat,) = node.users
        x = flat.args[0]
        x_dims, flat_dims = val(x).shape, val(flat).shape
        if not (_is_view(unflat) and isinstance(x, torch.fx.Node) and len(x_dims) > 2 and len(flat_dims) == 2):
            continue
        y_dims = val(unflat).shape
        if (
            str(x_dims[-1]) == str(flat_dims[-1])
            and len(y_dims) == len(x_dims)
            and [str(d) for d in y_dims[:-1]] == [str(d) for d in x_dims[:-1]]
        ):
            b.batched_inputs[node] = (x, unflat)
            b.skip.update((flat, unflat))


def plan_quantized_batched_inputs(b: GraphBuilder) -> None:
    """A statically quantized product whose input is quantized after an N-D value is flattened,
    and whose result is unflattened to the same leading dims after its dequantization, reads and
    writes N-D qint8 (lowerflow's ``int8`` recipe quantizes the decomposed ``linear``; ExecuTorch's
    quantizes ``linear`` before it is decomposed, without the reshapes).

    Before::  %flat = view_copy(%x, [S, K])  %q = quantize(%flat)  %dq = dequantize(%q)
              %mm = addmm(%b, %dq, %w)  %q1 = quantize(%mm)  %dq1 = dequantize(%q1)
              %y = view_copy(%dq1, [1, S, N])                 (%x: [1, S, K]; each has one user)
    After::   Convert(x [1, S, K] -> qint8), FullyConnected -> [1, S, N] qint8: %flat and %y are
              their inputs' values (:attr:`~..builder.GraphBuilder.alias_views`), no StaticReshape
    """
    for node in b.ep.graph.nodes:
        if node.target not in ADDMM_LIKE or node not in b.qplan.qout:
            continue
        dq = node.args[1]
        q = dq.args[0] if _only_user(dq, node) and is_op(dq, ACT_DQ) else None
        flat = q.args[0] if q is not None and _only_user(q, dq) and is_op(q, ACT_Q) else None
        if not (_is_view(flat) and _only_user(flat, q)) or len(node.users) != 1:
            continue
        (q1,) = node.users
        dq1 = next(iter(q1.users)) if is_op(q1, ACT_Q) and len(q1.users) == 1 else None
        unflat = next(iter(dq1.users)) if is_op(dq1, ACT_DQ) and len(dq1.users) == 1 else None
        x = flat.args[0]
        if not (_is_view(unflat) and isinstance(x, torch.fx.Node)) or b.ctx.is_static(x):
            continue
        x_dims, y_dims = shape(x), shape(unflat)
        if len(x_dims) > 2 and len(shape(flat)) == 2 and len(y_dims) == len(x_dims) and x_dims[:-1] == y_dims[:-1]:
            b.alias_views.update((flat, unflat))
            b.batched_dims[node] = y_dims


def _only_user(node: Any, user: torch.fx.Node) -> bool:
    return isinstance(node, torch.fx.Node) and list(node.users) == [user]


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is aten.view_copy.default


def lower_fully_connected(b: GraphBuilder, node: torch.fx.Node) -> None:
    """``addmm(bias, x, W[in,out])`` -> FullyConnected(x, W, bias, TRANSPOSE_WEIGHTS)."""
    is_addmm = node.target in ADDMM_LIKE
    x_node, w_node = (node.args[1], node.args[2]) if is_addmm else (node.args[0], node.args[1])
    x_node, result_node = b.batched_inputs.get(node, (x_node, node))  # plan_batched_inputs
    if b.qplan.quantized(node):  # the quantized weight [N, K] read through permute_copy
        quantized.fully_connected(b, node, x_node, w_node.args[0], node.args[0] if is_addmm else None, result_node)
        return
    x = b.get(x_node, NCHW)
    flags = P.FLAG_TRANSPOSE_WEIGHTS
    if _transposed_shared_weight(b, w_node) is not None:
        # [N, K] as the top-level program holds it (a tied embedding): the .pte stores the bytes once.
        filter_id, flags = b.constant(b.static_tensor(w_node.args[0])), 0
    elif b.ctx.is_static(w_node):
        filter_id = b.constant(b.static_tensor(w_node))
    elif w_node in b.weight_views:
        # A runtime weight (e.g. tied to an embedding the top level keeps): its [N, K] source as the filter.
        filter_id, flags = b.get(w_node.args[0], NCHW), 0
    else:
        filter_id = b.get(w_node, NCHW)
    bias_id, add_bias = P.INVALID_ID, None
    if is_addmm:
        bias_node = node.args[0]
        if b.ctx.is_static(bias_node):
            bias_id = b.constant(b.static_tensor(bias_node).reshape(-1))
        else:
            add_bias = bias_node
    out = b.output(result_node) if add_bias is None else b.define(shape(result_node))
    body = fbx.XNNFullyConnectedT()
    body.input1Id, body.filterId, body.biasId, body.outputId = x, filter_id, bias_id, out
    body.flags = flags
    b.add_node(fbx.NodeUnion.XNNFullyConnected, body, fusable_output=out if add_bias is None else None)
    if add_bias is not None:
        result = b.output(result_node)
        b.add_node(fbx.NodeUnion.XNNAdd, node2x1(out, b.get(add_bias, NCHW), result), fusable_output=result)


def _transposed_shared_weight(b: GraphBuilder, w_node: Any) -> torch.fx.Node | None:
    """The placeholder of a static ``permute_copy(%w, [1, 0])`` weight whose ``%w`` the top level keeps too.

    Such a weight (``SHARED_WITH_TOP_LEVEL``: e.g. an lm_head tied to an
    embedding) is read as ``[N, K]`` without the transpose flag, in the
    top-level constant's layout; other static weights keep ``[K, N]``.
    """
    if not (isinstance(w_node, torch.fx.Node) and w_node.target is aten.permute_copy.default):
        return None
    source = w_node.args[0]
    if (
        isinstance(source, torch.fx.Node)
        and source.op == "placeholder"
        and source.meta.get(SHARED_WITH_TOP_LEVEL)
        and b.ctx.is_static(source)
        and len(shape(source)) == 2
        and [int(p) % 2 for p in w_node.args[1]] == [1, 0]
    ):
        return source
    return None


def _batch_broadcast_weight(b: GraphBuilder, arg: Any) -> torch.Tensor | None:
    """The [K, N] matrix a static [B, K, N] operand repeats over its batch, if it does."""
    if not b.ctx.is_static(arg):
        return None
    t = b.static_tensor(arg)
    first = t[0]
    return first if bool((t == first.unsqueeze(0)).all()) else None


def lower_bmm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """BatchMatrixMultiply; with a static right operand repeated over the batch (an
    expanded weight), a FullyConnected over the flattened batch instead::

        bmm(%x [B,M,K], expand_copy(%w [K,N], [B,K,N]))  ->  FullyConnected(x, w, TRANSPOSE_WEIGHTS)
    """
    weight = _batch_broadcast_weight(b, node.args[1])
    if weight is not None:
        x = b.get(node.args[0], NCHW)
        out = b.output(node)
        body = fbx.XNNFullyConnectedT()
        body.input1Id, body.filterId, body.biasId, body.outputId = x, b.constant(weight), P.INVALID_ID, out
        body.flags = P.FLAG_TRANSPOSE_WEIGHTS
        b.add_node(fbx.NodeUnion.XNNFullyConnected, body, fusable_output=out)
        return
    x, y = b.get(node.args[0], NCHW), b.get(node.args[1], NCHW)
    out = b.output(node)
    b.add_node(fbx.NodeUnion.XNNBatchMatrixMultiply, node2x1(x, y, out))
