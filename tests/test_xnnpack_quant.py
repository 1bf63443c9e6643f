"""Quantized programs through the XNNPACK backend, checked on ExecuTorch's own runtime.

Inputs are quantized the standard way, independent of lowerflow's quantize stage:

- ``int8``: ExecuTorch's XNNPACKQuantizer (per-channel symmetric) + torchao
  ``prepare_pt2e`` / calibration / ``convert_pt2e``;
- ``int8-dynamic``: the same quantizer with ``is_dynamic=True``;
- ``8da4w``: torchao ``quantize_`` with ``Int8DynamicActivationIntxWeightConfig(int4, PerGroup(32))``
  and ``unwrap_tensor_subclass``.

PT2E modules go through ``lowering.export``; ``lowering.export`` decomposes torchao's
affine ops into ATen arithmetic, so 8da4w programs are exported with those ops
preserved (:func:`edge_keeping_torchao_ops`).  Each ``.pte`` runs on
``executorch.runtime`` and is compared with the quantized eager module, its
payload is decoded, and its size is compared with ExecuTorch's own lowering
(``to_edge_transform_and_lower`` + ``XnnpackPartitioner``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("executorch")
pytest.importorskip("torchao")

import lowering  # noqa: E402
from lowering.backends.xnnpack import XnnpackPartitioner  # noqa: E402
from lowering.backends.xnnpack import payload as P  # noqa: E402
from lowering.backends.xnnpack.generated import xnngraph_generated as fbx  # noqa: E402
from lowering.errors import LoweringError  # noqa: E402
from lowering.lowered_module import LoweredBackendModule  # noqa: E402
from tests._interop import ExecutorchMethod  # noqa: E402

DT = fbx.XNNDatatype
KIND = P.node_kind_names()

# --------------------------------------------------------------------------- models


class MLP(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                         torch.nn.Linear(256, 10))


class CNN(torch.nn.Module):
    """conv-BN-ReLU, maxpool, conv-BN-ReLU, conv-BN + residual add + ReLU, GAP, linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.c2, self.b2 = torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32)
        self.c3, self.b3 = torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32, 10)
        for bn in (self.b1, self.b2, self.b3):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        y = torch.relu(self.b2(self.c2(x)))
        y = torch.relu(self.b3(self.c3(y)) + y)
        return self.fc(y.mean(dim=(2, 3)))


class Mixed(torch.nn.Module):
    """hardtanh, depthwise conv, cat, mul, average pooling (fp32 between Converts), linear."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.c2 = torch.nn.Conv2d(32, 16, 1)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        a = torch.nn.functional.hardtanh(self.c1(x), 0.0, 6.0)
        b = self.dw(a)
        c = self.c2(torch.cat([a, b], dim=1))
        d = c * b
        d = torch.nn.functional.avg_pool2d(d, 2)
        return self.fc(d.flatten(1))


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x)


class Up(torch.nn.Module):
    """A transposed convolution (per-channel weights on axis 1) after a conv + ReLU."""

    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(torch.relu(self.c(x)))


class PoolLinear(torch.nn.Module):
    """maxpool -> permute -> linear: the linear's input comes from an NHWC-computed value."""

    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32, 16)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(self.c(x), 2)
        return self.fc(y.permute(0, 2, 3, 1).reshape(-1, 32))


class MulRelu(torch.nn.Module):
    """Quantized mul + ReLU (fused), fp32 sub + ReLU between Converts, convolutions sharing weights."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c(torch.relu(self.a(x) * self.b(x)) + torch.relu(self.a(x) - self.b(x)))


class PosAdd(torch.nn.Module):
    """A learned position table added to the activations (as BERT's embeddings): the quantizer
    folds it into an int8 constant, which XNNPACK's quantized add reads as a qint8 constant."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 16))

    def forward(self, x):
        return self.b(self.a(x) + self.pos)


class TwoHeads(torch.nn.Module):
    """Two linears reading one 3-D value (as attention's query and key), their sum into a third."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.o(self.q(x) + self.k(x))


class K48(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


MODELS = {"k48": (K48, (4, 48)), "posadd": (PosAdd, (2, 8, 16)), "twoheads": (TwoHeads, (2, 6, 16)), "mulrelu": (MulRelu, (1, 3, 8, 8)), "pool_linear": (PoolLinear, (1, 3, 8, 8)), "up": (Up, (1, 3, 8, 8)), "mlp": (MLP, (4, 64)), "cnn": (CNN, (1, 3, 32, 32)), "mixed": (Mixed, (1, 3, 16, 16)),
          "encoder": (Encoder, (1, 16, 64))}


def build(name: str):
    torch.manual_seed(0)
    cls, size = MODELS[name]
    return cls().eval(), (torch.randn(size),)


# --------------------------------------------------------------------------- quantization


def pt2e(model, inputs, *, dynamic: bool, per_channel: bool = True):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer, get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=per_channel,
                                                                              is_dynamic=dynamic))
    prepared = prepare_pt2e(torch.export.export(model, inputs).module(), quantizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(8):
        prepared(torch.randn(inputs[0].shape, generator=generator))
    return convert_pt2e(prepared)


def da4w(model, *, group_size=32, mapping=None, weight_dtype=torch.int4):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.utils import unwrap_tensor_subclass

    extra = {} if mapping is None else {"weight_mapping_type": mapping}
    granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(
        weight_dtype=weight_dtype, weight_granularity=granularity, **extra))
    unwrap_tensor_subclass(model)
    return model


def edge_keeping_torchao_ops(model, inputs):
    """The edge form of ``model`` with torchao's affine ops kept (``lowering.export`` decomposes them)."""
    from torch._export.utils import _special_op_to_preserve_cia

    table = torch.export.default_decompositions()
    for name in ("choose_qparams_affine", "quantize_affine", "dequantize_affine"):
        table[getattr(torch.ops.torchao, name).default] = _special_op_to_preserve_cia
    ep = torch.export.export(model, inputs).run_decompositions(table)
    aten = torch.ops.aten
    copies = {aten.view.default: aten.view_copy.default, aten.permute.default: aten.permute_copy.default,
              aten.unsqueeze.default: aten.unsqueeze_copy.default, aten.expand.default: aten.expand_copy.default,
              aten.t.default: aten.t_copy.default, aten.squeeze.dims: aten.squeeze_copy.dims,
              aten.select.int: aten.select_copy.int, aten.slice.Tensor: aten.slice_copy.Tensor,
              aten.transpose.int: aten.transpose_copy.int, aten.alias.default: aten.alias_copy.default}
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in copies:
            node.target = copies[node.target]
    ep.graph_module.recompile()
    return ep


@dataclass
class Case:
    reference: torch.nn.Module  # the quantized eager module
    program: object  # lowerflow's edge program
    inputs: tuple


@functools.lru_cache(maxsize=None)
def case(name: str, recipe: str) -> Case:
    model, inputs = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if recipe.startswith("8da"):  # 8da8w: int8 per output channel; 8da4w-axis: int4 per output channel
            ref = (da4w(model) if recipe == "8da4w" else da4w(model, group_size=None) if recipe == "8da4w-axis"
                   else da4w(model, group_size=None, weight_dtype=torch.int8))
            return Case(ref, edge_keeping_torchao_ops(ref, inputs), inputs)
        ref = pt2e(model, inputs, dynamic=recipe == "int8-dynamic", per_channel=recipe != "int8-per-tensor")
        return Case(ref, lowering.export(ref, inputs), inputs)


@functools.lru_cache(maxsize=None)
def lowered(name: str, recipe: str):
    c = case(name, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lowering.lower(c.program, partitioner=XnnpackPartitioner())


@functools.lru_cache(maxsize=None)
def executorch_pte(name: str, recipe: str) -> bytes:
    """ExecuTorch's own lowering of the same quantized module."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner as EtPartitioner
    from executorch.exir import to_edge_transform_and_lower

    c = case(name, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(c.reference, c.inputs)
        return bytes(to_edge_transform_and_lower(ep, partitioner=[EtPartitioner()]).to_executorch().buffer)


def segment_bytes(pte: bytes) -> int:
    """Bytes of a .pte's segments: the delegate payloads and their named data (the backend's output)."""
    import json
    import struct

    from executorch.exir._serialize._flatbuffer import _program_flatbuffer_to_json

    program_size = struct.unpack_from("<Q", pte, 16)[0]
    program = json.loads(_program_flatbuffer_to_json(pte[:program_size]))
    return sum(s["size"] for s in program.get("segments", []))


def payloads(result) -> list[tuple[fbx.XNNGraphT, dict[str, bytes]]]:
    found = []
    for module in result.exported_program.graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            graph, _ = P.deserialize_payload(module.processed_bytes)
            found.append((graph, module.named_data))
    return found


def values_of(graph):
    """id -> (datatype, quant params or None, dims, tensor value)."""
    out = {}
    for v in graph.xvalues:
        t = v.xvalueUnion
        quant = None
        if isinstance(t, fbx.XNNQuantizedTensorValueT):
            t, quant = t.tensorValue, t.quantParams
        out[t.idOut] = (t.datatype, quant, list(t.dims), t)
    return out


def key(graph, index: int) -> str:
    k = graph.constantData[index].namedKey
    return k.decode() if isinstance(k, bytes) else k


def kinds(graph) -> list[str]:
    return [KIND[n.xnodeUnionType] for n in graph.xnodes]


def output_step(program) -> float | None:
    """The scale of the quantization the program's output is dequantized from (None: fp32 output)."""
    out = program.graph.output_node().args[0][0]
    if out.target is not torch.ops.quantized_decomposed.dequantize_per_tensor.default:
        return None
    return float(out.args[1])


def run(name: str, recipe: str):
    c = case(name, recipe)
    method = ExecutorchMethod(lowered(name, recipe).pte)
    got = method.execute(c.inputs)[0]
    with torch.no_grad():
        want = c.reference(*c.inputs)
    return got, want


# --------------------------------------------------------------------------- static int8


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_static_int8_is_bit_exact_with_the_quantized_module(name):
    got, want = run(name, "int8")
    assert got.shape == want.shape
    assert (got - want).abs().max().item() == 0.0


def test_static_transposed_convolution_is_within_one_output_step():
    got, want = run("up", "int8")
    assert (got - want).abs().max().item() <= output_step(case("up", "int8").program) * 1.001
    (graph, _), = payloads(lowered("up", "int8"))
    vals = values_of(graph)
    up = next(n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNConvTranspose2d")
    assert vals[up.filterId][0] == DT.xnn_datatype_qcint8 and vals[up.filterId][2] == [4, 2, 2, 8]
    assert vals[up.filterId][1].channelDim == 0 and vals[up.filterId][1].numScales == 4


def test_static_per_tensor_weights_are_qint8_with_qint32_bias():
    got, want = run("mlp", "int8-per-tensor")
    assert (got - want).abs().max().item() <= output_step(case("mlp", "int8-per-tensor").program) * 1.001
    (graph, _), = payloads(lowered("mlp", "int8-per-tensor"))
    vals = values_of(graph)
    for fc in (n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"):
        assert vals[fc.filterId][0] == DT.xnn_datatype_qint8 and vals[fc.biasId][0] == DT.xnn_datatype_qint32
        assert vals[fc.filterId][1].zeroPoint == 0


def test_static_mul_relu_is_fused_and_bit_exact():
    """(ExecuTorch 1.5.1's own lowering of this model fails to load: "Failed to create convolution node".)"""
    got, want = run("mulrelu", "int8")
    assert (got - want).abs().max().item() == 0.0
    (graph, _), = payloads(lowered("mulrelu", "int8"))
    vals = values_of(graph)
    mul = next(n for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNMultiply")
    assert vals[mul.xnodeUnion.outputId][0] == DT.xnn_datatype_qint8
    assert (mul.outputMinMax.outputMin, mul.outputMinMax.outputMax) == (0.0, float("inf"))


def test_a_folded_int8_constant_is_a_qint8_operand_of_the_quantized_add():
    """4 bytes a value fewer than the dequantized fp32 constant, and no Converts around the add
    (ExecuTorch feeds it to the delegate as a qint8 input; a 2-layer BERT's position and token type
    embeddings are two such constants).  The quantized linears read and write 3-D values."""
    got, want = run("posadd", "int8")
    assert (got - want).abs().max().item() == 0.0
    (graph, named), = payloads(lowered("posadd", "int8"))
    vals = values_of(graph)
    add = next(n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNAdd")
    operand = vals[add.input2Id]
    assert operand[0] == DT.xnn_datatype_qint8 and operand[2] == [1, 8, 16] and operand[3].constantBufferIdx
    assert len(named[key(graph, operand[3].constantBufferIdx)]) == 8 * 16
    assert vals[add.outputId][0] == DT.xnn_datatype_qint8
    # ExecuTorch's nodes: Convert, FullyConnected on [2, 8, 16] (no reshapes), Add, FullyConnected, Convert
    assert kinds(graph) == ["XNNConvert", "XNNFullyConnected", "XNNAdd", "XNNFullyConnected", "XNNConvert"]


def test_lowerflows_int8_linears_of_3d_values_read_and_write_them_3d():
    """lowerflow's recipe quantizes the decomposed linear (``view_copy -> q -> dq -> addmm -> q -> dq ->
    view_copy``): its FullyConnected nodes take the 3-D value as ExecuTorch's do, no StaticReshape, and
    the two linears reading one value share one Convert of it."""
    from lowering.export import export
    from lowering.quantize import quantize

    model, (x,) = build("twoheads")
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(x.shape, generator=generator),) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lowering.lower(model, (x,), quantize="int8", calibration=batches, partitioner=XnnpackPartitioner())
        reference = quantize(export(model, (x,)), "int8", batches)
    (graph, _), = payloads(result)
    assert kinds(graph) == ["XNNConvert", "XNNFullyConnected", "XNNFullyConnected", "XNNAdd", "XNNFullyConnected",
                            "XNNConvert"]
    got = ExecutorchMethod(result.pte).execute((x,))[0]
    with torch.no_grad():
        want = reference.module()(x)
    assert got.shape == want.shape == (2, 6, 8)
    assert (got - want).abs().max().item() <= output_step(reference) * 1.001


def test_static_mixed_graph_is_within_one_output_step():
    got, want = run("mixed", "int8")
    step = output_step(case("mixed", "int8").program)
    assert (got - want).abs().max().item() <= step * 1.001


def test_static_encoder_matches_the_quantized_module():
    """Its output is a layer norm's (fp32), so no output step: requantization differences of one
    step inside (ExecuTorch's own lowering shows them too) must stay small."""
    got, want = run("encoder", "int8")
    assert output_step(case("encoder", "int8").program) is None
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_static_mlp_payload():
    (graph, named), = payloads(lowered("mlp", "int8"))
    vals = values_of(graph)
    assert kinds(graph) == ["XNNConvert", "XNNFullyConnected", "XNNFullyConnected", "XNNFullyConnected",
                            "XNNConvert"]
    first, last = graph.xnodes[0].xnodeUnion, graph.xnodes[-1].xnodeUnion
    assert vals[first.inputId][0] == DT.xnn_datatype_fp32 and vals[first.outputId][0] == DT.xnn_datatype_qint8
    assert vals[last.inputId][0] == DT.xnn_datatype_qint8 and vals[last.outputId][0] == DT.xnn_datatype_fp32
    x_quant = vals[first.outputId][1]
    program = case("mlp", "int8").program
    q_in = next(n for n in program.graph.nodes if n.name == "quantize_per_tensor")
    assert (x_quant.scale, x_quant.zeroPoint) == pytest.approx((q_in.args[1], q_in.args[2]))
    for node in graph.xnodes[1:4]:
        fc = node.xnodeUnion
        w_type, w_quant, w_dims, w = vals[fc.filterId]
        b_type, b_quant, _, b = vals[fc.biasId]
        assert (w_type, b_type) == (DT.xnn_datatype_qcint8, DT.xnn_datatype_qcint32)
        assert isinstance(w_quant, fbx.PerChannelQuantT) and w_quant.numScales == w_dims[0]
        assert fc.flags == 0  # weights [N, K]
        scale_key = key(graph, w_quant.scaleBufferIdx)
        assert scale_key.startswith("scale_") and len(named[scale_key]) == 4 * w_dims[0]
        assert len(named[key(graph, w.constantBufferIdx)]) == w_dims[0] * w_dims[1]
        assert len(named[key(graph, b.constantBufferIdx)]) == 4 * w_dims[0]
        assert vals[fc.outputId][0] == DT.xnn_datatype_qint8
    assert graph.xnodes[1].outputMinMax.outputMin == 0.0  # relu fused
    assert graph.xnodes[3].outputMinMax is None


def test_static_bias_is_int32_of_weight_and_input_scales():
    (graph, named), = payloads(lowered("mlp", "int8"))
    vals = values_of(graph)
    program = case("mlp", "int8").program
    state = {**program.state_dict, **program.constants}
    fc = graph.xnodes[1].xnodeUnion
    s_in = vals[fc.input1Id][1].scale
    bias = torch.frombuffer(bytearray(named[key(graph, vals[fc.biasId][3].constantBufferIdx)]),
                            dtype=torch.int32)
    expect = torch.round(state["0.bias"] / (state["_scale_0"] * s_in)).to(torch.int32)
    assert (bias - expect).abs().max().item() <= 1


def test_static_cnn_payload():
    (graph, _), = payloads(lowered("cnn", "int8"))
    vals = values_of(graph)
    ks = kinds(graph)
    assert ks[0] == "XNNConvert" and ks[-1] == "XNNConvert" and ks.count("XNNConvert") == 2
    assert ks.count("XNNConv2d") == 3 and "XNNMaxPooling2d" in ks and "XNNGlobalAvgPooling2d" in ks
    assert "XNNAdd" in ks
    for node in graph.xnodes[1:-1]:
        body = node.xnodeUnion
        out = getattr(body, "outputId", None)
        assert vals[out][0] == DT.xnn_datatype_qint8, KIND[node.xnodeUnionType]
    pool = next(n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNMaxPooling2d")
    qi, qo = vals[pool.inputId][1], vals[pool.outputId][1]
    assert (qi.scale, qi.zeroPoint) == (qo.scale, qo.zeroPoint)


# --------------------------------------------------------------------------- dynamic


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed", "encoder"])
def test_dynamic_int8_matches_the_quantized_module(name):
    got, want = run(name, "int8-dynamic")
    assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()


@pytest.mark.parametrize("recipe", ["int8-dynamic", "8da4w"])
def test_layout_transposes_come_before_the_dynamic_convert(recipe):
    """ExecuTorch 1.5.1 emits Convert(qdint8) -> StaticTranspose, which its runtime refuses at load."""
    got, want = run("pool_linear", recipe)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    for graph, _ in payloads(lowered("pool_linear", recipe)):
        vals = values_of(graph)
        for node in graph.xnodes:
            if KIND[node.xnodeUnionType] in ("XNNStaticTranspose", "XNNStaticReshape"):
                assert vals[node.xnodeUnion.inputId][0] != DT.xnn_datatype_qdint8


def test_dynamic_mlp_payload():
    (graph, _), = payloads(lowered("mlp", "int8-dynamic"))
    vals = values_of(graph)
    assert kinds(graph) == ["XNNConvert", "XNNFullyConnected"] * 3
    for convert, fc in zip(graph.xnodes[0::2], graph.xnodes[1::2]):
        c, f = convert.xnodeUnion, fc.xnodeUnion
        assert vals[c.outputId][0] == DT.xnn_datatype_qdint8
        assert isinstance(vals[c.outputId][1], fbx.PerTokenDynamicQuantT)
        assert vals[c.outputId][1].numNonbatchDims == 1
        assert f.input1Id == c.outputId
        assert vals[f.filterId][0] == DT.xnn_datatype_qcint8
        assert vals[f.biasId][0] == DT.xnn_datatype_fp32 and vals[f.outputId][0] == DT.xnn_datatype_fp32


# --------------------------------------------------------------------------- 8da4w


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed", "encoder"])
def test_8da4w_matches_the_quantized_module(name):
    got, want = run(name, "8da4w")
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()


def test_8da4w_payload_is_blockwise_int4_with_bf16_scales():
    (graph, named), = payloads(lowered("mlp", "8da4w"))
    vals = values_of(graph)
    program = case("mlp", "8da4w").program
    state = {**program.state_dict, **program.constants}
    fcs = [n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"]
    assert len(fcs) == 3
    fc = fcs[0]
    w_type, quant, dims, w = vals[fc.filterId]
    assert w_type == DT.xnn_datatype_qbint4 and dims == [256, 64]
    assert isinstance(quant, fbx.PerChannelGroupQuantT)
    assert (quant.groupSize, quant.numScales, quant.channelDim) == (32, 256 * 2, 0)
    qdata = state["0.parametrizations.weight.original0"]
    blob = named[key(graph, w.constantBufferIdx)]
    packed = torch.frombuffer(bytearray(blob), dtype=torch.uint8).reshape(256, 32)
    assert torch.equal((packed & 15).to(torch.int16) - 8, qdata[:, 0::2].to(torch.int16))
    assert torch.equal((packed >> 4).to(torch.int16) - 8, qdata[:, 1::2].to(torch.int16))
    scales = named[key(graph, quant.scaleBufferIdx)]
    expect = state["0.parametrizations.weight.original1"].to(torch.bfloat16).contiguous()
    assert scales == expect.view(torch.uint8).numpy().tobytes()
    assert vals[fc.input1Id][0] == DT.xnn_datatype_qdint8


def test_8da8w_per_channel_affine_weights_are_qcint8():
    got, want = run("mlp", "8da8w")
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()
    (graph, _), = payloads(lowered("mlp", "8da8w"))
    vals = values_of(graph)
    for fc in (n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"):
        assert vals[fc.filterId][0] == DT.xnn_datatype_qcint8 and vals[fc.input1Id][0] == DT.xnn_datatype_qdint8


def test_4bit_per_channel_weights_are_qcint4_or_one_block_per_row():
    """Rows of 48 values are no block size (a multiple of 32): qcint4; rows of 32 are one block: qbint4."""
    got, want = run("k48", "8da4w-axis")
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()
    (graph, named), = payloads(lowered("k48", "8da4w-axis"))
    vals = values_of(graph)
    fcs = [n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"]
    (t1, q1, d1, w1), (t2, q2, d2, _) = vals[fcs[0].filterId], vals[fcs[1].filterId]
    assert (t1, d1, type(q1)) == (DT.xnn_datatype_qcint4, [32, 48], fbx.PerChannelQuantT)
    assert len(named[key(graph, w1.constantBufferIdx)]) == 32 * 24
    assert (t2, d2, type(q2), q2.groupSize) == (DT.xnn_datatype_qbint4, [10, 32], fbx.PerChannelGroupQuantT, 32)


def test_asymmetric_4bit_weight_is_refused_naming_the_node():
    from torchao.quantization.quant_primitives import MappingType

    model, inputs = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = edge_keeping_torchao_ops(da4w(model, mapping=MappingType.ASYMMETRIC), inputs)
    with pytest.raises(LoweringError, match=r"node 'addmm.*asymmetric weight.*not 0"):
        lowering.lower(program, partitioner=XnnpackPartitioner())


def test_dynamic_activation_read_by_an_op_xnnpack_cannot_take_quantized_is_refused_naming_it():
    """A linear over a permuted 4-D input decomposes to expand + bmm: its dynamically quantized input
    has no XNNPACK lowering, and the program has no kernel for leftover dynamic q/dq ops."""

    class Linear4d(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc(x.permute(0, 2, 3, 1))

    torch.manual_seed(0)
    model, inputs = Linear4d().eval(), (torch.randn(1, 32, 2, 4),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = lowering.export(pt2e(model, inputs, dynamic=True), inputs)
    with pytest.raises(LoweringError, match=r"node 'expand' .*reads the dynamically quantized activation 'dequantize_per_tensor'"):
        lowering.lower(program, partitioner=XnnpackPartitioner())


def test_group_size_16_is_refused_naming_the_node():
    model, inputs = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = edge_keeping_torchao_ops(da4w(model, group_size=16), inputs)
    with pytest.raises(LoweringError, match=r"node 'addmm.*group size 16 is not a multiple of 32"):
        lowering.lower(program, partitioner=XnnpackPartitioner())


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("recipe", ["int8", "int8-dynamic", "8da4w"])
def test_payload_and_weights_are_not_larger_than_executorchs(name, recipe):
    """Payload + named data: the backend's bytes; and the whole .pte (the container writes the
    segment needing the most padding last)."""
    ours, theirs = lowered(name, recipe).pte, executorch_pte(name, recipe)
    assert segment_bytes(ours) <= segment_bytes(theirs)
    assert len(ours) <= len(theirs)


def test_same_program_same_bytes():
    a = lowered("cnn", "int8").pte
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = lowering.lower(case("cnn", "int8").program, partitioner=XnnpackPartitioner()).pte
    assert bytes(a) == bytes(b)
