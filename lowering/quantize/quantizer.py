"""lowerflow's PT2E quantizer for XNNPACK: annotation rules on edge-form ops.

The same choices as ExecuTorch's ``XNNPACKQuantizer`` with
``get_symmetric_quantization_config(is_per_channel=True)``, written for the
edge ops of :mod:`lowering.export` (``addmm``/``mm`` + ``permute_copy``,
``aten.convolution``, ``*_copy`` views, ``max_pool2d_with_indices``):

- activations: int8 per tensor, [-128, 127], HistogramObserver (eps 2^-12);
- weights: int8 per output channel, symmetric [-127, 127], PerChannelMinMaxObserver;
  axis 0 (the natural ``[N, K]`` / ``[OC, ...]`` layout), axis 1 for a transposed
  convolution (groups 1 only);
- biases: not annotated (they stay fp32; the backend makes them int32);
- ``relu`` / ``hardtanh`` / ``clamp`` right after a linear / conv / add / mul
  (through ``view_copy``s) are fused: the output is observed after the activation;
- ``add`` / ``mul`` of two float tensors: each input and the output;
- ``cat``: all inputs and the output share one observer;
- share ops (views, permute, squeeze/unsqueeze, slice, clone, max pool, global
  average pool, unfused relu/hardtanh/clamp) reuse their producer's qparams.

A node in a module of ``keep_fp32`` (fqn prefix or class name) is not annotated.

Annotation of a linear (``prepare_pt2e`` then puts observers on the edges)::

    %w = get_attr[fc.weight]                          # [N, K]
    %permute_copy = permute_copy(%w, [1, 0])          # input_qspec_map {w: weight per-channel axis 0}
    %addmm = addmm(%b, %x, %permute_copy)             # input_qspec_map {x: act}, output act
"""

from __future__ import annotations

import dataclasses
import operator
from functools import cache

import torch
from torch.fx import Node

from .graph import kept_fp32

aten = torch.ops.aten

ACTIVATIONS = (aten.relu.default, aten.hardtanh.default, aten.clamp.default)
SHARE_OPS = (
    aten.view_copy.default, aten.permute_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
    aten.squeeze_copy.default, aten.unsqueeze_copy.default, aten.slice_copy.Tensor, aten.clone.default,
    aten.max_pool2d.default, aten.relu.default, aten.hardtanh.default, aten.clamp.default,
    aten.alias_copy.default,
)
GLOBAL_POOLS = (aten.mean.dim, aten._adaptive_avg_pool2d.default)


@cache
def specs():
    """``(activation, weight)`` QuantizationSpecs (built once: observers are classes)."""
    from torchao.quantization.pt2e.observer import HistogramObserver, PerChannelMinMaxObserver
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    act = QuantizationSpec(
        dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine,
        observer_or_fake_quant_ctr=HistogramObserver.with_args(eps=2**-12),
    )
    weight = QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=2**-12),
    )
    return act, weight


def make_quantizer(keep_fp32: tuple[str, ...] = ()):
    """A torchao ``Quantizer`` applying the rules above (the class is built lazily so that
    importing this room does not import torchao)."""
    from torchao.quantization.pt2e.quantizer import Quantizer

    class LowerflowXnnpackQuantizer(Quantizer):
        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            annotate_graph(model.graph, keep_fp32)
            return model

        def validate(self, model: torch.fx.GraphModule) -> None:
            return None

    return LowerflowXnnpackQuantizer()


def annotate_graph(graph: torch.fx.Graph, keep_fp32: tuple[str, ...]) -> None:
    """Annotate ``graph`` in two sweeps: anchors (gemm, conv, add, mul, cat), then shares."""
    for node in list(graph.nodes):
        if node.op != "call_function" or kept_fp32(node, keep_fp32) or _annotated(node):
            continue
        if node.target in (aten.addmm.default, aten.mm.default):
            _annotate_gemm(node)
        elif node.target is aten.convolution.default:
            _annotate_conv(node)
        elif node.target in (aten.add.Tensor, aten.mul.Tensor):
            _annotate_binary(node)
        elif node.target is aten.cat.default:
            _annotate_cat(node)
    for node in graph.nodes:
        if node.op != "call_function" or kept_fp32(node, keep_fp32) or _annotated(node):
            continue
        _annotate_share(node)


# ------------------------------------------------------------------ anchors


def _annotate_gemm(node: Node) -> None:
    x_index, w_index = (1, 2) if node.target is aten.addmm.default else (0, 1)
    x, permute = node.args[x_index], node.args[w_index]
    if not (_is_float(x) and isinstance(permute, Node) and permute.target is aten.permute_copy.default):
        return
    weight = permute.args[0]
    if not (isinstance(weight, Node) and weight.op == "get_attr" and _is_float(weight)):
        return
    act, weight_spec = specs()
    _set(permute, {weight: weight_spec}, None)
    _set_with_output(node, {x: act})


def _annotate_conv(node: Node) -> None:
    x, weight = node.args[0], node.args[1]
    if not (_is_float(x) and isinstance(weight, Node) and weight.op == "get_attr"):
        return
    act, weight_spec = specs()
    transposed, groups = node.args[6], node.args[8]
    if transposed:
        if groups != 1:
            return
        weight_spec = dataclasses.replace(weight_spec, ch_axis=1)
    _set_with_output(node, {x: act, weight: weight_spec})


def _annotate_binary(node: Node) -> None:
    inputs = node.args[:2]
    if not all(_is_float(a) for a in inputs) or not _is_float(node):
        return
    act, _ = specs()
    _set_with_output(node, {a: act for a in inputs})


def _annotate_cat(node: Node) -> None:
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    inputs = node.args[0]
    if not inputs or not all(_is_float(a) for a in inputs) or not _is_float(node):
        return
    act, _ = specs()
    source = next((a for a in inputs if _output_spec(a) is not None), inputs[0])
    shared = SharedQuantizationSpec((source, node))
    qmap = {a: (act if a is source else shared) for a in inputs}
    _set(node, qmap, shared)


def _set_with_output(node: Node, qmap: dict) -> None:
    """Annotate ``node``'s inputs; its output, or the fused activation's after it
    (through single-reader ``view_copy``s)."""
    act, _ = specs()
    activation = _fused_activation(node)
    _set(node, qmap, None if activation is not None else act)
    if activation is not None:
        _set(activation, {}, act)


def _fused_activation(node: Node) -> Node | None:
    current = node
    while len(current.users) == 1:
        (user,) = current.users
        if user.target is aten.view_copy.default:
            current = user
            continue
        if user.target in ACTIVATIONS and not _annotated(user) and _clamp_scalars(user):
            return user
        return None
    return None


def _clamp_scalars(node: Node) -> bool:
    return all(not isinstance(a, Node) for a in node.args[1:])


# ------------------------------------------------------------------ shares


def _annotate_share(node: Node) -> None:
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    if node.target is operator.getitem:
        pool = node.args[0]
        if pool.target is aten.max_pool2d_with_indices.default and node.args[1] == 0 and _annotated(pool):
            _set(node, {}, SharedQuantizationSpec(pool.args[0]))
        return
    if node.target is aten.max_pool2d_with_indices.default:
        share_from = node.args[0]
        if _output_spec(share_from) is not None:
            _set(node, {share_from: SharedQuantizationSpec(share_from)}, None)
        return
    if node.target in GLOBAL_POOLS and not _is_global_pool(node):
        return
    if node.target not in SHARE_OPS + GLOBAL_POOLS or not _is_float(node):
        return
    producer = node.args[0]
    if not isinstance(producer, Node) or _output_spec(producer) is None:
        return
    if node.target in ACTIVATIONS and not _clamp_scalars(node):
        return
    shared = SharedQuantizationSpec(producer)
    _set(node, {producer: shared}, shared)


def _is_global_pool(node: Node) -> bool:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return False
    if node.target is aten._adaptive_avg_pool2d.default:
        return list(node.args[1]) == [1, 1]
    dims = sorted(d % 4 for d in node.args[1])
    return dims == [2, 3]


# ------------------------------------------------------------------ helpers


def _set(node: Node, qmap: dict, output) -> None:
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation
    from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

    node.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=qmap, output_qspec=output, _annotated=True)


def _annotated(node: Node) -> bool:
    ann = node.meta.get("quantization_annotation")
    return ann is not None and ann._annotated


def _output_spec(node) -> object | None:
    ann = node.meta.get("quantization_annotation") if isinstance(node, Node) else None
    return ann.output_qspec if ann is not None else None


def _is_float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32
