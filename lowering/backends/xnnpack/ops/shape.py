"""Data movement: copies, reshapes, expand, permute, slice, select, split, cat, pad, getitem.

An op that moves no data (a clone, a reshape to the same dims, a full slice)
is its input's value (:meth:`GraphBuilder.alias`).  Reshapes, slices, selects
and splits work in NCHW; permute reads an NHWC input directly, cat and pad
stay in their inputs' layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import payload as P
from ..generated import xnngraph_generated as fbx
from ..values import NCHW, NHWC, TO_NHWC, XnnpackPreprocessError, shape, val
from ..xnodes import reshape, transpose

if TYPE_CHECKING:
    from ..builder import GraphBuilder

aten = torch.ops.aten

# --------------------------------------------------------------------------- copies and reshapes


def check_copy(node, ctx):
    if node.target is aten._to_copy.default:
        allowed = {"dtype": torch.float32, "memory_format": torch.contiguous_format}
        for k, v in node.kwargs.items():
            if k in allowed and v not in (None, allowed[k], torch.preserve_format):
                return f"{k}={v}"
            if k not in allowed and k not in ("layout", "device", "pin_memory", "non_blocking") and v:
                return f"{k}={v}"
    if node.target is aten.clone.default and node.kwargs.get("memory_format") not in (
        None, torch.contiguous_format, torch.preserve_format
    ):
        return "memory format change"
    return None


def lower_copy(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.alias(node, node.args[0])  # no data change; outputs that need a node get a Copy


def lower_reshape(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    if shape(node) == shape(source) or node in b.alias_views:
        b.alias(node, source)
        return
    x = b.get(source, NCHW)
    out = b.output(node)
    # a symbolic size (at most one: reshape_symbolic_sizes) is 0, which XNNPACK infers from the input
    dims = [d if isinstance(d, int) else 0 for d in node.meta["val"].shape]
    b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape(dims or [1], x, out))
    b.reshape_of[node] = source


def reshape_symbolic_sizes(node) -> str | None:
    """XNNPACK's static reshape infers one size given as 0 from the input's actual size."""
    if sum(not isinstance(d, int) for d in node.meta["val"].shape) > 1:
        return "dynamic shape: a reshape to more than one symbolic size"
    return None


def check_expand(node, ctx):
    if shape(node) != shape(node.args[0]) and not ctx.is_static(node.args[0]):
        return "broadcast of a runtime value (XNNPACK has no broadcast node)"
    return None


def lower_expand(b: GraphBuilder, node: torch.fx.Node) -> None:
    """An expand to the same shape is its input (an expand of static data is folded, never lowered)."""
    b.alias(node, node.args[0])


def lower_permute(b: GraphBuilder, node: torch.fx.Node) -> None:
    if node in b.weight_views:
        return  # read untransposed by the FullyConnected nodes using it
    source = node.args[0]
    rank = len(shape(source))
    perm = [int(p) % rank for p in node.args[1]]
    if b.layout(source) == NHWC and rank == 4:
        # Read the NHWC value directly: NCHW perm p over NHWC dims is perm [to_nhwc.index(d) for d in p].
        x = b.get(source, NHWC)
        perm = [TO_NHWC.index(d) for d in perm]
    else:
        x = b.get(source, NCHW)
    out = b.output(node)
    b.add_node(fbx.NodeUnion.XNNStaticTranspose, transpose(perm, x, out))


# --------------------------------------------------------------------------- slices


def _slice_bounds(node: torch.fx.Node) -> tuple[int, int, int, int]:
    src = shape(node.args[0])
    args = list(node.args) + [None] * 5
    dim = int(args[1] if args[1] is not None else 0) % len(src)
    start, end, step = args[2], args[3], args[4] if args[4] is not None else 1
    start = 0 if start is None else int(start)
    end = src[dim] if end is None else int(end)
    start = max(0, min(src[dim], start + src[dim] if start < 0 else start))
    end = max(start, min(src[dim], end + src[dim] if end < 0 else end))
    return dim, start, end, int(step)


def check_slice(node, ctx):
    if _slice_bounds(node)[3] != 1:
        return "step != 1"
    return None


def lower_slice(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    dim, start, end, _ = _slice_bounds(node)
    if start == 0 and end == shape(source)[dim]:
        b.alias(node, source)
        return
    x = b.get(source, NCHW)
    out = b.output(node)
    offsets = [0] * len(shape(source))
    offsets[dim] = start
    _slice_node(b, x, out, offsets, shape(node))


def _slice_node(b: GraphBuilder, x: int, out: int, offsets: list[int], sizes: list[int]) -> None:
    body = fbx.XNNStaticSliceT()
    body.numDims, body.offsets, body.sizes = len(sizes), list(offsets), list(sizes)
    body.inputId, body.outputId, body.flags = x, out, 0
    b.add_node(fbx.NodeUnion.XNNStaticSlice, body)


def lower_select(b: GraphBuilder, node: torch.fx.Node) -> None:
    """select = slice of size 1 + reshape dropping the dim."""
    source = node.args[0]
    src = shape(source)
    dim = int(node.args[1]) % len(src)
    index = int(node.args[2]) % src[dim]
    x = b.get(source, NCHW)
    sizes = list(src)
    sizes[dim] = 1
    offsets = [0] * len(src)
    offsets[dim] = index
    sliced = b.define(sizes)
    _slice_node(b, x, sliced, offsets, sizes)
    out = b.output(node)
    b.add_node(fbx.NodeUnion.XNNStaticReshape, reshape(shape(node) or [1], sliced, out))


def lower_split(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Each result is a StaticSlice; getitems pick them."""
    source = node.args[0]
    src = shape(source)
    dim = int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(src)
    x = b.get(source, NCHW)
    offset = 0
    results = []
    for piece in val(node):
        sizes = [int(s) for s in piece.shape]
        offsets = [0] * len(src)
        offsets[dim] = offset
        offset += sizes[dim]
        vid = b.define(sizes)
        _slice_node(b, x, vid, offsets, sizes)
        results.append(vid)
    b.results[node] = results


def lower_getitem(b: GraphBuilder, node: torch.fx.Node) -> None:
    """One result of a multi-result node: a value its lowering recorded in ``b.results``,
    or result 0 of a BatchNorm / layer norm, which is the node's own value."""
    source, index = node.args
    if source in b.results:
        item = b.results[source][index]
        vid, layout = item if isinstance(item, tuple) else (item, NCHW)
        b.set_value(node, vid, layout)
    elif index == 0 and source.target in (aten._native_batch_norm_legit_no_training.default,
                                          aten.native_layer_norm.default):
        b.alias(node, source)
    else:
        raise XnnpackPreprocessError(f"node {node.name!r}: result {index} of {source.name!r} has no XNNPACK value")


# --------------------------------------------------------------------------- cat and pad


def check_cat(node, ctx):
    tensors = node.args[0]
    if len(tensors) < 1:
        return "no inputs"
    return None


def cat_symbolic_sizes(node) -> str | None:
    """XNNPACK concatenates inputs of any (reshaped) sizes along an axis whose sizes are static."""
    rank = len(node.meta["val"].shape)
    dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    if any(not isinstance(a.meta["val"].shape[dim], int) for a in node.args[0]):
        return "dynamic shape: concatenation along a symbolic dim"
    return None


_CATS = {2: fbx.NodeUnion.XNNConcatenate2, 3: fbx.NodeUnion.XNNConcatenate3,
         4: fbx.NodeUnion.XNNConcatenate4, 5: fbx.NodeUnion.XNNConcatenate5}


def lower_cat(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Concatenate2..5; more inputs are chained (5, then the partial result and up to 4 more)."""
    inputs = list(node.args[0])
    rank = len(shape(node))
    dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    if len(inputs) == 1:
        b.alias(node, inputs[0])
        return
    active = [a for a in inputs if not b.ctx.is_static(a)]
    layout = NHWC if rank == 4 and active and all(b.layout(a) == NHWC for a in active) else NCHW
    axis = TO_NHWC.index(dim) if layout == NHWC else dim
    ids = [b.get(a, layout) for a in inputs]
    while ids:
        take, ids = ids[:5], ids[5:]
        if ids:  # partial result, then continue with it first
            partial = [b.dims[i] for i in take]
            dims = list(partial[0])
            dims[axis] = sum(d[axis] for d in partial)
            vid = b.define(dims)
        else:
            vid = b.output(node, layout)
        body = fbx._XNNCatT()
        body.axis, body.outputId, body.flags = axis, vid, 0
        slots = take + [P.INVALID_ID] * (5 - len(take))
        body.input1Id, body.input2Id, body.input3Id, body.input4Id, body.input5Id = slots
        b.add_node(_CATS[len(take)], body)
        if ids:
            ids = [vid] + ids


def check_pad(node, ctx):
    pads = node.args[1]
    if any(int(p) < 0 for p in pads):
        return "negative padding"
    if len(pads) // 2 > len(shape(node.args[0])):
        return "more pads than dims"
    return None


def pads(node: torch.fx.Node) -> tuple[list[int], list[int]]:
    """Per-dim (pre, post) padding of ``constant_pad_nd`` (its pad list runs from the last dim back)."""
    rank = len(shape(node.args[0]))
    pads = [int(p) for p in node.args[1]]
    pre, post = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        pre[rank - 1 - i], post[rank - 1 - i] = pads[2 * i], pads[2 * i + 1]
    return pre, post


def lower_pad(b: GraphBuilder, node: torch.fx.Node) -> None:
    """StaticConstantPad in its input's layout (a zero pad of H, W before a convolution is
    folded into the convolution's padding instead, see :func:`.convolution.plan_pad_folds`)."""
    if node in b.pad_folds:
        return
    source = node.args[0]
    pre, post = pads(node)
    layout = b.layout(source)
    if layout == NHWC:
        pre, post = [pre[i] for i in TO_NHWC], [post[i] for i in TO_NHWC]
    x = b.get(source, layout)
    out = b.output(node, layout)
    body = fbx.XNNStaticConstantPadT()
    body.prePaddings, body.postPaddings = pre, post
    body.paddingValue = float(node.args[2] if len(node.args) > 2 else 0.0)
    body.inputId, body.outputId, body.flags = x, out, 0
    b.add_node(fbx.NodeUnion.XNNStaticConstantPad, body)
