"""lowering.runtime on quantized programs made by ExecuTorch, against ExecuTorch's runtime.

Delegated (XNNPACK payloads with qint8 / qcint8 / qcint32 / qdint8 / qbint4 values) and
portable (quantized_decomposed::*.out kernels at the top level) programs from three recipes
(PT2E static int8, PT2E dynamic int8, torchao 8da4w) on an MLP, a conv-BN-ReLU CNN, a
mixed depthwise/transposed-conv graph and a small transformer encoder.

Static delegated programs compute in XNNPACK's integer/fp32 arithmetic: their outputs must
be bit-exact.  Dynamic (fp32 output) programs must agree to fp32 rounding.  Portable
programs run fp32 ops (convolution, mean) between q and dq that round differently from
ExecuTorch's portable kernels: within one quantization step of the output.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("executorch")

from lowering.backends.xnnpack import payload as P  # noqa: E402
from lowering.backends.xnnpack.generated import xnngraph_generated as fbx  # noqa: E402
from lowering.backends.xnnpack.runtime import XnnpackRuntime  # noqa: E402
from lowering.backends.xnnpack.runtime_qvalues import D, decode_constant  # noqa: E402
from lowering.pte import deserialize, serialize  # noqa: E402
from lowering.pte.format import decode_string  # noqa: E402
from lowering.runtime import ExecutorError, load  # noqa: E402

from ._interop import ExecutorchMethod  # noqa: E402
from ._quant_programs import delegated_pte, portable_pte  # noqa: E402

K = fbx.NodeUnion
NAMES = P.node_kind_names()
ROOT = Path(__file__).resolve().parents[1]


def compare(pte: bytes, x: torch.Tensor) -> list[dict]:
    """Per output: max |ours - ExecuTorch|, elements that differ, its quantization step (or None)."""
    program = load(pte)
    ours = program.run("forward", [x])
    reference = ExecutorchMethod(pte).execute([x])
    assert len(ours) == len(reference)
    found = []
    for a, b, step in zip(ours, reference, output_steps(program)):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        diff = (a - b).abs()
        found.append({"max": float(diff.max()), "differ": int((diff > 0).sum()), "numel": diff.numel(),
                      "ref": float(b.abs().max()), "step": step})
    print(pte_summary(program), found)
    return found


def output_steps(program) -> list[float | None]:
    """The scale of each method output that a delegate dequantizes (Convert qint8 -> fp32)."""
    method = program.method("forward")
    step_of = {}
    for step in method.steps:
        if step.kind != "delegate":
            continue
        _, handle = method.delegates[step.target]
        producers = {node.xnodeUnion.outputId: node for node in handle.graph.xnodes or []}
        for evalue, (_, vid) in zip(step.args[step.split:], handle.outputs):
            node = producers.get(vid)
            if node is not None and node.xnodeUnionType == K.XNNConvert and node.xnodeUnion.inputId in handle.qparams:
                step_of[evalue] = handle.qparams[node.xnodeUnion.inputId].scale
    for step in method.steps:  # top-level dequantize_per_tensor.out(input, scale, ..., out)
        if step.kind == "kernel" and step.target.qualified_name == "quantized_decomposed::dequantize_per_tensor.out":
            step_of[step.args[7]] = float(method.values[step.args[1]])
    return [step_of.get(i) for i in method.outputs]


def quantized_kinds(program) -> set[str]:
    """Kinds of the delegate nodes that ran on quantized values, plus the quantized datatypes."""
    kinds = set()
    for _, handle in program.method("forward").delegates:
        for index, node in enumerate(handle.graph.xnodes or []):
            if index in handle.quantized_nodes:
                kinds.add(NAMES[node.xnodeUnionType])
        kinds.update(p.name for p in handle.qparams.values())
    return kinds


def pte_summary(program) -> str:
    return f"{len(program.method('forward').delegates)} delegates"


# ------------------------------------------------------------------ delegated

STATIC_KINDS = {
    "mlp": {"XNNFullyConnected", "XNNConvert", "qint8", "qcint8", "qcint32"},
    "cnn": {"XNNConv2d", "XNNMaxPooling2d", "XNNAdd", "XNNGlobalAvgPooling2d", "XNNFullyConnected",
            "XNNStaticTranspose", "XNNStaticReshape"},
    "mixed": {"XNNDepthwiseConv2d", "XNNConvTranspose2d", "XNNConcatenate2", "XNNClamp", "XNNMultiply",
              "XNNConv2d", "XNNFullyConnected"},
}


@pytest.mark.parametrize("name", sorted(STATIC_KINDS))
def test_static_int8_is_bit_exact(name):
    pte, x = delegated_pte(name, "static")
    assert STATIC_KINDS[name] <= quantized_kinds(load(pte))
    for out in compare(pte, x):
        assert out["step"] is not None  # a dequantized qint8 output
        assert out["differ"] == 0, out


def test_static_int8_encoder_agrees_to_fp32_rounding():
    """14 delegates with Converts at every boundary; layer norm and softmax run in portable fp32."""
    pte, x = delegated_pte("encoder", "static")
    assert {"XNNFullyConnected", "XNNConvert", "qint8"} <= quantized_kinds(load(pte))
    for out in compare(pte, x):
        assert out["max"] <= 1e-5 * out["ref"], out


DYNAMIC_KINDS = {"dynamic": {"XNNFullyConnected", "XNNConvert", "qdint8", "qcint8"},
                 "8da4w": {"XNNFullyConnected", "XNNConvert", "qdint8", "qbint4"}}


@pytest.mark.parametrize("recipe", sorted(DYNAMIC_KINDS))
@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder"])
def test_dynamic_quantization_agrees_to_fp32_rounding(name, recipe):
    pte, x = delegated_pte(name, recipe)
    assert DYNAMIC_KINDS[recipe] <= quantized_kinds(load(pte))
    for out in compare(pte, x):
        assert out["max"] <= 1e-5 * out["ref"], out


@pytest.mark.parametrize("name", ["mixed", "shared"])
def test_dynamic_convolutions_agree_to_fp32_rounding(name):
    """Conv2d and ConvTranspose2d on qdint8 (num_nonbatch_dims 3).  A 1x1 conv is defined by
    XNNPACK as fully connected and its qdint8 input is then quantized per pixel; a 3x3 conv
    sharing that input reads the params of its first rows as per-image params ("shared"):
    ExecuTorch's result is then far from the model's, and ours is the same."""
    pte, x = delegated_pte(name, "dynamic")
    assert {"XNNConv2d", "qdint8"} <= quantized_kinds(load(pte))
    for out in compare(pte, x):
        assert out["max"] <= 1e-5 * out["ref"], out


def test_8da4w_linear_of_the_mixed_graph():
    pte, x = delegated_pte("mixed", "8da4w")
    assert "qbint4" in quantized_kinds(load(pte))
    for out in compare(pte, x):
        assert out["max"] <= 1e-5 * out["ref"], out


# ------------------------------------------------------------------ portable

def operators(pte: bytes) -> set[str]:
    plan = deserialize(pte).program.executionPlan[0]
    return {f"{decode_string(op.name)}.{decode_string(op.overload)}" for op in plan.operators}


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed"])
def test_portable_static_program_within_one_step(name):
    """q/dq kernels are ExecuTorch's arithmetic; the fp32 ops between them (convolution, mean)
    are torch's, which round differently from ExecuTorch's portable kernels, so a value on a
    rounding edge may be quantized one step apart."""
    pte, x = portable_pte(name, "static")
    ops = operators(pte)
    assert {"quantized_decomposed::quantize_per_tensor.out", "quantized_decomposed::dequantize_per_tensor.out",
            "quantized_decomposed::dequantize_per_channel.out"} <= ops
    assert not deserialize(pte).program.executionPlan[0].delegates
    for out in compare(pte, x):
        assert out["step"] is not None
        assert out["max"] <= out["step"] * 1.0001, out


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_portable_dynamic_program_chooses_qparams_as_executorch(name):
    pte, x = portable_pte(name, "dynamic")
    assert {"quantized_decomposed::choose_qparams.Tensor_out",
            "quantized_decomposed::quantize_per_tensor.Tensor_out"} <= operators(pte)
    for out in compare(pte, x):
        assert out["max"] <= 1e-5 * out["ref"], out


# ------------------------------------------------------------------ without executorch

_CHILD = textwrap.dedent("""
    import sys, torch
    from lowering.runtime import load
    names = sys.argv[1:]
    results = {n: load(open(n + ".pte", "rb").read()).run("forward", [torch.load(n + ".x")]) for n in names}
    assert not any(m == "executorch" or m.startswith("executorch.") for m in sys.modules), "executorch was imported"
    torch.save(results, "ours.pt")
""")


def test_runs_quantized_programs_in_a_process_without_executorch(tmp_path):
    """lowerflow's runtime alone (the `verify` path): quantized delegates and top-level q/dq kernels."""
    cases = {"static_cnn": delegated_pte("cnn", "static"), "w4_mlp": delegated_pte("mlp", "8da4w"),
             "portable_mlp": portable_pte("mlp", "static"), "portable_dyn": portable_pte("mlp", "dynamic")}
    for name, (pte, x) in cases.items():
        (tmp_path / f"{name}.pte").write_bytes(pte)
        torch.save(x, tmp_path / f"{name}.x")
    subprocess.run([sys.executable, "-c", _CHILD, *cases], cwd=tmp_path, check=True, timeout=600,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    ours = torch.load(tmp_path / "ours.pt")
    for name, (pte, x) in cases.items():
        for a, b in zip(ours[name], ExecutorchMethod(pte).execute([x])):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------ values and errors

def test_4bit_weights_unpack_low_nibble_first_with_zero_point_8():
    w = torch.tensor([[-8, 7, 0, 1], [3, -1, -2, 5]], dtype=torch.int32)
    nibbles = (w + 8).to(torch.uint8)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()
    for datatype in (D.xnn_datatype_qbint4, D.xnn_datatype_qcint4):
        assert torch.equal(decode_constant(7, datatype, [2, 4], packed.numpy().tobytes()), w)
    with pytest.raises(ExecutorError, match="constant 7 has 3 bytes"):
        decode_constant(7, D.xnn_datatype_qbint4, [2, 4], packed.numpy().tobytes()[:3])


def _cnn_payload():
    pte = deserialize(delegated_pte("cnn", "static")[0])
    graph, _ = P.deserialize_payload(pte.delegate_data[0])
    return graph, pte.named_data


def test_a_quantized_node_xnnpack_refuses_is_named_at_load():
    graph, named = _cnn_payload()
    index = next(i for i, n in enumerate(graph.xnodes) if n.xnodeUnionType == K.XNNMaxPooling2d)
    graph.xnodes[index].xnodeUnionType = K.XNNAvgPooling2d  # qint8 average pooling: XNNPACK refuses it
    with pytest.raises(ExecutorError, match=rf"node {index} \(XNNAvgPooling2d, output value \d+\).*quantized"):
        XnnpackRuntime().init(P.serialize_payload(graph), named_data=named)


def test_a_missing_scale_blob_is_named():
    graph, named = _cnn_payload()
    keys = {decode_string(c.namedKey) for c in graph.constantData if c.namedKey}
    scale_key = next(k for k in sorted(keys) if k.startswith("scale_"))
    with pytest.raises(ExecutorError, match=f"{scale_key}.*not in the program's named data"):
        XnnpackRuntime().init(P.serialize_payload(graph), named_data={k: v for k, v in named.items() if k != scale_key})


# ------------------------------------------------------------------ edited payloads, both runtimes

def _with_requantizing_convert(scale_factor: float, zero_shift: int) -> bytes:
    """The static MLP with a qint8 -> qint8 Convert (new scale and zero point) inserted
    between its input Convert and its first FullyConnected."""
    pte = deserialize(delegated_pte("mlp", "static")[0])
    graph, _ = P.deserialize_payload(pte.delegate_data[0])
    first = graph.xnodes[0]
    assert first.xnodeUnionType == K.XNNConvert
    source = graph.xvalues[first.xnodeUnion.outputId]
    value = copy.deepcopy(source)
    value.xvalueUnion.tensorValue.idOut = len(graph.xvalues)
    params = value.xvalueUnion.quantParams
    params.scale *= scale_factor
    params.zeroPoint = max(-128, min(127, params.zeroPoint + zero_shift))
    graph.xvalues.append(value)
    convert = copy.deepcopy(first)
    convert.xnodeUnion.inputId = first.xnodeUnion.outputId
    convert.xnodeUnion.outputId = value.xvalueUnion.tensorValue.idOut
    fc = next(n for n in graph.xnodes if n.xnodeUnionType == K.XNNFullyConnected)
    fc.xnodeUnion.input1Id = convert.xnodeUnion.outputId
    graph.xnodes.insert(1, convert)
    pte.delegate_data[0] = P.serialize_payload(graph)
    return serialize(pte)


@pytest.mark.parametrize("scale_factor, zero_shift", [(1.37, 5), (0.61, -9), (3.0, 0)])
def test_a_requantizing_convert_is_bit_exact(scale_factor, zero_shift):
    pte = _with_requantizing_convert(scale_factor, zero_shift)
    assert "XNNConvert" in quantized_kinds(load(pte))
    x = delegated_pte("mlp", "static")[1] * 3
    for out in compare(pte, x):
        assert out["differ"] == 0, out


def _as_qcint4_per_channel() -> bytes:
    """The per-axis 8da4w MLP (qbint4 weights with group size = IC) with every weight
    rewritten as qcint4 PerChannelQuant with inline fp32 scales: a form AoT never emits and
    the ExecuTorch runtime accepts."""
    pte_bytes = delegated_pte("mlp", "8da4w-axis")[0]
    _, handle = load(pte_bytes).method("forward").delegates[0]
    pte = deserialize(pte_bytes)
    graph, _ = P.deserialize_payload(pte.delegate_data[0])
    rewritten = 0
    for value in graph.xvalues:
        tensor = value.xvalueUnion.tensorValue if value.xvalueUnionType == fbx.ValueUnion.XNNQuantizedTensorValue else None
        if tensor is None or tensor.datatype != D.xnn_datatype_qbint4:
            continue
        scales = handle.qparams[tensor.idOut].scale
        assert scales.shape[1] == 1  # one block per row: per channel
        params = fbx.PerChannelQuantT()
        params.scale, params.channelDim, params.scaleBufferIdx, params.numScales = scales[:, 0].tolist(), 0, 0, scales.shape[0]
        tensor.datatype = D.xnn_datatype_qcint4
        value.xvalueUnion.quantParamsType, value.xvalueUnion.quantParams = fbx.QuantParams.PerChannelQuant, params
        rewritten += 1
    assert rewritten == 3
    pte.delegate_data[0] = P.serialize_payload(graph)
    return serialize(pte)


def test_per_axis_4bit_weights_as_qbint4_and_as_qcint4():
    pte, x = delegated_pte("mlp", "8da4w-axis")
    assert "qbint4" in quantized_kinds(load(pte))
    edited = _as_qcint4_per_channel()
    assert "qcint4" in quantized_kinds(load(edited))
    for program in (pte, edited):
        for out in compare(program, x):
            assert out["max"] <= 1e-5 * out["ref"], out
    torch.testing.assert_close(load(edited).run("forward", [x]), load(pte).run("forward", [x]), atol=1e-6, rtol=1e-5)


class _Lookup(torch.nn.Module):
    """An embedding table (rows of 64) looked up, then scaled (the scale is delegated)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(50, 64)

    def forward(self, ids):
        return self.table(ids) * 2.0


@pytest.mark.parametrize("qembedding, op", [("8w", "embedding_byte"), ("4w", "embedding_4bit")])
def test_quantized_embedding_lookups_are_bit_exact_with_executorch_and_the_reference(qembedding, op):
    """lowerflow's qembedding tables (int8 per row; int4 two a byte, value 2j in the high nibble,
    a scale per 32 values) read by ExecuTorch's quantized_decomposed::embedding_byte/4bit.out and
    by lowerflow's own kernels: the same bits, and the quantized reference's (torch) too."""
    import executorch.kernels.quantized  # noqa: F401  (the kernels, in this process)

    from lowering import lower
    from lowering.backends.xnnpack import XnnpackPartitioner
    from lowering.export import export
    from lowering.quantize import quantize

    ids = torch.tensor([[0, 7, 49, 7, 3, 21]])
    recipe = {"recipe": "8da4w", "qembedding": qembedding}
    pte = lower(_Lookup(), (ids,), quantize=recipe, partitioner=XnnpackPartitioner()).pte
    assert f"quantized_decomposed::{op}.out" in operators(pte)
    assert [found["max"] for found in compare(pte, ids)] == [0.0]
    reference = quantize(export(_Lookup(), (ids,)), recipe).module()(ids)
    assert torch.equal(load(pte).run("forward", [ids])[0], reference)
    fp32 = _Lookup()(ids)
    assert 0 < (reference - fp32).abs().max() < fp32.abs().max() / (10 if qembedding == "4w" else 100)
