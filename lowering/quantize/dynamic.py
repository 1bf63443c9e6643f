"""``int8-dynamic`` and ``8da4w``: dynamic per-token activations, symmetric int weights.

A graph rewrite of the edge program (no re-export): every linear whose weight
is a constant gets its weight quantized now (torchao's ``quant_primitives``,
the arithmetic of ``Int8DynamicActivationIntxWeightConfig``) and its activation
quantized per token at runtime.

Before::

    %c__folded_permute = placeholder                                   # [K, N] fp32
    %addmm = aten.addmm.default(%p_fc_bias, %x, %c__folded_permute)

After (8da4w, group size gs)::

    %c__q_weight_addmm = placeholder                                   # int8 [N, K] in [-8, 7]
    %c__q_scale_addmm = placeholder                                    # fp32 [N, K/gs]
    %c__q_zero_point_addmm = placeholder                               # int8 [N, K/gs], zeros
    %cq = torchao.choose_qparams_affine(%x, "ASYMMETRIC", [1, K], int8, -128, 127, None, None, int8)
    %s = getitem(%cq, 0);  %zp = getitem(%cq, 1)
    %xq = torchao.quantize_affine(%x, [1, K], %s, %zp, int8, -128, 127)
    %xdq = torchao.dequantize_affine(%xq, [1, K], %s, %zp, int8, -128, 127)
    %wdq = torchao.dequantize_affine(%c__q_weight_addmm, [1, gs], %c__q_scale_addmm,
                                     %c__q_zero_point_addmm, int8, -8, 7)
    %wt = aten.permute_copy.default(%wdq, [1, 0])
    %addmm = aten.addmm.default(%p_fc_bias, %xdq, %wt)

``int8-dynamic`` is the same with one block per output channel (``[1, K]``) and
weights in [-127, 127] (XNNPACK's symmetric int8 range).  The bias stays fp32.

``int8-dynamic`` also quantizes 2-D convolutions as ExecuTorch's PT2E flow does
(``XNNPACKQuantizer``, dynamic config): BatchNorm folded first, then every
non-transposed, ungrouped conv with a constant 4-D weight of more than one input
channel per group, except one whose only reader is a ReLU (the quantizer leaves
conv+ReLU to a static-only pattern).  In ExecuTorch's ops and arguments::

    %dqw = quantized_decomposed.dequantize_per_channel(%c__q_weight_conv, %c__q_scale_conv,
                                                       %c__q_zero_point_conv, 0, -127, 127, int8)
    %cq = quantized_decomposed.choose_qparams.tensor(%x, -128, 127, 2**-12, int8)
    %xq = quantized_decomposed.quantize_per_tensor.tensor(%x, %cq[0], %cq[1], -128, 127, int8)
    %xdq = quantized_decomposed.dequantize_per_tensor.tensor(%xq, %cq[0], %cq[1], -128, 127, int8)
    %conv = aten.convolution.default(%xdq, %dqw, %bias, ...)
8da4w leaves fp32 a linear whose K is not a multiple of the group size (as
ExecuTorch's and optimum-executorch's filters do) and, unless the recipe says
``quantize_mha``, the linears traced inside ``nn.MultiheadAttention`` (its packed
in-projection is no ``nn.Linear`` and its out-projection a
``NonDynamicallyQuantizableLinear``, both of which torchao's ``quantize_`` filter
skips); :func:`quantize_dynamic` returns the names of both kinds.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch.export import ExportedProgram

from .graph import add_constant, call, constant_value, kept_fp32, target_of, unfold_linear_weights, value_digest
from .recipes import QuantRecipe
from .weights import WeightScheme, quantize_weight

#: The module class whose linears 8da4w leaves fp32 by default (see the module docstring).
MHA_CLASS = torch.nn.MultiheadAttention

#: Per-token activation quantization (torchao's ``int8_asym_per_token``).
ACT_QMIN, ACT_QMAX = -128, 127


def weight_scheme(recipe: QuantRecipe) -> WeightScheme:
    if recipe.name == "8da4w":
        return WeightScheme(recipe.group_size, -8, 7)
    return WeightScheme(0, -127, 127)


def quantize_dynamic(program: ExportedProgram, recipe: QuantRecipe) -> tuple[ExportedProgram, list[str], list[str]]:
    """Rewrite ``program`` in place (see the module docstring); returns it, the names of
    the linears left fp32 because K is not a multiple of the group size, and those left
    fp32 because they are inside ``nn.MultiheadAttention`` (:attr:`QuantRecipe.skips_mha`)."""
    import torchao.quantization.quant_primitives  # noqa: F401  (defines torch.ops.torchao.*: the ops put in the graph)

    scheme = weight_scheme(recipe)
    graph = program.graph
    skipped: list[str] = []
    in_mha: list[str] = []
    weights: dict[torch.fx.Node, torch.fx.Node] = {}  # a weight shared by several linears: once
    # W as views of the folded weights: one fp32 copy of the model's linears, not two, while
    # quantizing (each quantized W's view is dropped by remove_unused; the rest copied after)
    for gemm in unfold_linear_weights(program, views=True):
        if kept_fp32(gemm, recipe.keep_fp32):
            continue
        if recipe.skips_mha and _inside(gemm, MHA_CLASS):
            in_mha.append(gemm.name)
            continue
        permute = gemm.args[2] if gemm.target is torch.ops.aten.addmm.default else gemm.args[1]
        source = permute.args[0]
        k = source.meta["val"].shape[1]
        x = gemm.args[1] if gemm.target is torch.ops.aten.addmm.default else gemm.args[0]
        if not _is_float32(x) or not _is_float32(source):
            continue
        if scheme.block and k % scheme.block:
            skipped.append(gemm.name)
            continue
        if source not in weights:
            weights[source] = _dequantized_weight(program, gemm, source, scheme)
        permute.replace_input_with(source, weights[source])
        _quantize_activation(graph, gemm)
    from .graph import contiguous_constants, remove_unused

    if recipe.name == "int8-dynamic":
        _quantize_convs(program, recipe)
    if recipe.qembedding:
        from .embedding import quantize_embeddings

        quantize_embeddings(program, recipe.qembedding, recipe.keep_fp32)
    remove_unused(program)
    contiguous_constants(program)
    graph.lint()
    program.graph_module.recompile()
    return program, skipped, in_mha


#: PT2E's observers' eps (``get_symmetric_quantization_config``): weight scales and the
#: dynamic activation's scale are at least this.
PT2E_EPS = 2.0 ** -12


def _quantize_convs(program: ExportedProgram, recipe: QuantRecipe) -> None:
    """The convolutions of ``int8-dynamic`` (see the module docstring)."""
    from .bn_fold import fold_batch_norms

    fold_batch_norms(program)
    weights: dict[torch.fx.Node, torch.fx.Node] = {}
    for conv in list(program.graph.nodes):
        if not _dynamic_conv(program, conv) or kept_fp32(conv, recipe.keep_fp32):
            continue
        source = conv.args[1]
        if source not in weights:
            weights[source] = _per_channel_weight(program, conv, source)
        conv.replace_input_with(source, weights[source])
        _quantize_conv_input(program.graph, conv)


def _dynamic_conv(program: ExportedProgram, node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.convolution.default:
        return False
    weight = constant_value(program, node.args[1]) if isinstance(node.args[1], torch.fx.Node) else None
    if weight is None or weight.dim() != 4 or weight.dtype != torch.float32 or weight.shape[1] == 1:
        return False
    if node.args[6] or int(node.args[8]) != 1 or not _is_float32(node.args[0]):
        return False
    only = next(iter(node.users)) if len(node.users) == 1 else None
    return not (only is not None and only.op == "call_function" and only.target is torch.ops.aten.relu.default)


def _per_channel_weight(program: ExportedProgram, conv: torch.fx.Node, source: torch.fx.Node) -> torch.fx.Node:
    """int8 [-127, 127] per output channel, symmetric, as PT2E's PerChannelMinMaxObserver and
    ``convert_pt2e`` compute it; returns its ``dequantize_per_channel``."""
    qd = torch.ops.quantized_decomposed
    weight = constant_value(program, source)
    with torch.no_grad():
        scale = torch.clamp(weight.abs().amax(dim=(1, 2, 3)) / 127.0, min=PT2E_EPS)
        zero_point = torch.zeros(weight.shape[0], dtype=torch.int64)
        qdata = qd.quantize_per_channel.default(weight, scale, zero_point, 0, -127, 127, torch.int8)
    q = add_constant(program, f"_q_weight_{conv.name}", qdata, meta_from=conv)
    s = add_constant(program, f"_q_scale_{conv.name}", scale, meta_from=conv)
    zp = add_constant(program, f"_q_zero_point_{conv.name}", zero_point, meta_from=conv)
    with program.graph.inserting_before(min(source.users, key=_position)):
        return call(program.graph, qd.dequantize_per_channel.default, (q, s, zp, 0, -127, 127, torch.int8),
                    meta_from=conv)


def _quantize_conv_input(graph: torch.fx.Graph, conv: torch.fx.Node) -> None:
    """Per-tensor dynamic choose_qparams / quantize / dequantize of the conv's input."""
    qd = torch.ops.quantized_decomposed
    x = conv.args[0]
    with graph.inserting_before(conv):
        qparams = call(graph, qd.choose_qparams.tensor, (x, ACT_QMIN, ACT_QMAX, PT2E_EPS, torch.int8), meta_from=conv)
        scale = call(graph, operator.getitem, (qparams, 0), meta_from=conv)
        zero_point = call(graph, operator.getitem, (qparams, 1), meta_from=conv)
        xq = call(graph, qd.quantize_per_tensor.tensor, (x, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.int8),
                  meta_from=conv)
        xdq = call(graph, qd.dequantize_per_tensor.tensor, (xq, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.int8),
                   meta_from=conv)
    conv.replace_input_with(x, xdq)


def _dequantized_weight(program: ExportedProgram, gemm: torch.fx.Node, source: torch.fx.Node,
                        scheme: WeightScheme) -> torch.fx.Node:
    """Lift qdata / scale / zero point of ``source`` and add their ``dequantize_affine``."""
    weight = constant_value(program, source)
    qdata, scale, zero_point = quantize_weight(weight, scheme)
    recipe = ["q", target_of(program, source), scheme.block, scheme.qmin, scheme.qmax]
    digest = value_digest(weight)  # the source of all three: hashed once
    q = add_constant(program, f"_q_weight_{gemm.name}", qdata, meta_from=gemm, derived=([*recipe, 0], digest))
    s = add_constant(program, f"_q_scale_{gemm.name}", scale, meta_from=gemm, derived=([*recipe, 1], digest))
    zp = add_constant(program, f"_q_zero_point_{gemm.name}", zero_point, meta_from=gemm,
                      derived=([*recipe, 2], digest))
    users = [u for u in source.users]
    with program.graph.inserting_before(min(users, key=_position)):
        return call(program.graph, torch.ops.torchao.dequantize_affine.default,
                    (q, scheme.block_size(weight.shape[1]), s, zp, torch.int8, scheme.qmin, scheme.qmax),
                    meta_from=gemm)


def _quantize_activation(graph: torch.fx.Graph, gemm: torch.fx.Node) -> None:
    """Per-token choose_qparams / quantize / dequantize of the gemm's activation."""
    index = 1 if gemm.target is torch.ops.aten.addmm.default else 0
    x = gemm.args[index]
    block = [1] * (x.meta["val"].dim() - 1) + [x.meta["val"].shape[-1]]
    ops = torch.ops.torchao
    with graph.inserting_before(gemm):
        qparams = call(graph, ops.choose_qparams_affine.default,
                       (x, "ASYMMETRIC", block, torch.int8, ACT_QMIN, ACT_QMAX, None, None, torch.int8),
                       meta_from=gemm)
        scale = call(graph, operator.getitem, (qparams, 0), meta_from=gemm)
        zero_point = call(graph, operator.getitem, (qparams, 1), meta_from=gemm)
        xq = call(graph, ops.quantize_affine.default,
                  (x, block, scale, zero_point, torch.int8, ACT_QMIN, ACT_QMAX), meta_from=gemm)
        xdq = call(graph, ops.dequantize_affine.default,
                   (xq, block, scale, zero_point, torch.int8, ACT_QMIN, ACT_QMAX), meta_from=gemm)
    args = list(gemm.args)
    args[index] = xdq
    gemm.args = tuple(args)


def _inside(node: torch.fx.Node, cls: type) -> bool:
    """Whether ``node`` was traced inside a module of class ``cls`` (or a subclass); export
    records the class by its qualified name (or, in some versions, the class itself)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    for _, owner in (node.meta.get("nn_module_stack") or {}).values():
        if owner == name or (isinstance(owner, type) and issubclass(owner, cls)):
            return True
    return False


def _is_float32(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


def _position(node: torch.fx.Node) -> int:
    return list(node.graph.nodes).index(node)



def bf16_group_scales(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` whose 4-bit block scales (a ``dequantize_affine`` of [-8, 7]
    whose K is a multiple of 32) are rounded to bf16, as XNNPACK's blockwise FullyConnected
    stores them (lowering.backends.xnnpack.qparams / ops.quantized): the quantized reference of
    a program whose 4-bit weights XNNPACK runs.  ``program`` is not changed (the copy shares
    its graph)."""
    lifted = program.graph_signature.inputs_to_lifted_tensor_constants
    names = set()
    for node in program.graph.find_nodes(op="call_function", target=torch.ops.torchao.dequantize_affine.default):
        args = list(node.args) + [None] * 7
        qdata, scale, qmin, qmax = args[0], args[2], node.kwargs.get("quant_min", args[5]), node.kwargs.get("quant_max", args[6])
        if (qmin, qmax) == (-8, 7) and qdata.meta["val"].shape[-1] % 32 == 0 and scale.name in lifted:
            names.add(lifted[scale.name])
    rounded = copy.copy(program)
    rounded._constants = {name: value.to(torch.bfloat16).to(torch.float32) if name in names else value
                          for name, value in program.constants.items()}
    return rounded


#: How far :func:`nudged_activation_scales` moves every dynamic activation scale (relative):
#: a quantized activation moves by at most 127 · 2**-16 ≈ 0.002 of an int8 step, so only the
#: values that close to a rounding boundary flip by one step — the kind of 1-LSB difference a
#: runtime's own qparams arithmetic (reciprocal multiplies, fused rounding) makes.
NUDGE = 2.0 ** -16


def nudged_activation_scales(module: torch.fx.GraphModule, relative: float = NUDGE) -> torch.fx.GraphModule:
    """``module`` (a quantized program's ``.module()``, changed in place and returned) with the
    scale of every dynamic activation quantization multiplied by ``1 + relative``: the
    reference run the way a runtime that computes its qparams a rounding apart would run it.
    How far its outputs move measures how much the model amplifies 1-LSB requantization
    differences (:func:`lowering.accuracy.quantized_tolerance`).

    Before::

        %cq = torchao.choose_qparams_affine(%x, "ASYMMETRIC", [1, K], int8, -128, 127, None, None, int8)
        %s = getitem(%cq, 0)
        %xq = torchao.quantize_affine(%x, [1, K], %s, %zp, int8, -128, 127)

    After::

        %s = getitem(%cq, 0)
        %s_nudged = aten.mul.Tensor(%s, 1 + relative)
        %xq = torchao.quantize_affine(%x, [1, K], %s_nudged, %zp, int8, -128, 127)

    (the same for ``quantized_decomposed.choose_qparams.tensor``, int8-dynamic's convs).
    """
    choosers = (torch.ops.torchao.choose_qparams_affine.default, torch.ops.quantized_decomposed.choose_qparams.tensor)
    graph = module.graph
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].target in choosers):
            with graph.inserting_after(node):
                nudged = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 + relative))
            node.replace_all_uses_with(nudged, delete_user_cb=lambda user: user is not nudged)
    module.recompile()
    return module


def dequantized_weights(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` (a quantized program's ``.module()``, changed in place and returned) with
    every dequantize of constant data (a weight's) computed once now: the op's result becomes
    a tensor attribute of the module the graph reads, so calling it again (a reference run on
    several calls: verify's) does not dequantize every weight at every call.  The values are
    the op's own on the same inputs: outputs are unchanged.

    Before::

        %wdq = torchao.dequantize_affine(%_q_weight_addmm, [1, 32], %_q_scale_addmm, ...)
        %mm = aten.mm(%xdq, %wdq)

    After::

        %wdq = get_attr[_dequantized_wdq]
        %mm = aten.mm(%xdq, %wdq)
    """
    from functools import reduce

    from torch.utils import _pytree as pytree

    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not str(getattr(node.target, "__name__", "")).startswith("dequantize"):
            continue
        operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
        if not operands or any(a.op != "get_attr" for a in operands):
            continue
        args, kwargs = pytree.tree_map_only(
            torch.fx.Node, lambda a: reduce(getattr, a.target.split("."), module), (node.args, node.kwargs))
        with torch.no_grad():
            value = node.target(*args, **kwargs)
        name = f"_dequantized_{node.name}"
        setattr(module, name, value)  # a plain attribute: not a buffer (verify restores buffers)
        with graph.inserting_before(node):
            folded = graph.get_attr(name)
        folded.meta = dict(node.meta)
        node.replace_all_uses_with(folded)
        graph.erase_node(node)
        for operand in operands:
            if not operand.users and operand.graph is graph:
                graph.erase_node(operand)
    module.recompile()
    return module
