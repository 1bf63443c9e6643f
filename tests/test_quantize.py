"""The quantize stage (lowering.quantize): recipes, static int8, int8-dynamic and 8da4w."""

from __future__ import annotations

import copy
import hashlib
import json
import operator
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowering
from lowering.errors import LoweringError
from lowering.export import export
from lowering.quantize import RECIPE_NAMES, QuantizeError, QuantRecipe, parse_recipe, quantize

qd = torch.ops.quantized_decomposed
ao = torch.ops.torchao
aten = torch.ops.aten


# ---------------------------------------------------------------- recipes


def test_recipe_names_and_defaults():
    assert RECIPE_NAMES == ("int8", "int8-dynamic", "8da4w")
    assert issubclass(QuantizeError, LoweringError)
    r = parse_recipe("8da4w")
    assert r == QuantRecipe("8da4w", group_size=32, keep_fp32=())
    assert parse_recipe("int8").needs_calibration
    assert not parse_recipe("int8-dynamic").needs_calibration
    assert not parse_recipe("8da4w").needs_calibration
    assert parse_recipe(r) is r


def test_recipe_from_mapping():
    r = parse_recipe({"recipe": "8da4w", "group_size": 64, "keep_fp32": ["lm_head", "LayerNorm"]})
    assert r == QuantRecipe("8da4w", 64, ("lm_head", "LayerNorm"))
    assert parse_recipe({"recipe": "int8", "keep_fp32": "fc1"}).keep_fp32 == ("fc1",)
    assert parse_recipe(r.to_dict()) == r
    assert parse_recipe(QuantRecipe("int8", keep_fp32=("a",)).to_dict()) == QuantRecipe("int8", keep_fp32=("a",))


def test_recipe_key_text_is_stable():
    # Pinned: the quantize stage's cache keys are built from these strings.
    assert parse_recipe("int8").key_text() == '{"keep_fp32":[],"recipe":"int8"}'
    assert parse_recipe("int8-dynamic").key_text() == '{"keep_fp32":[],"recipe":"int8-dynamic"}'
    assert parse_recipe("8da4w").key_text() == \
        '{"group_size":32,"keep_fp32":[],"quantize_mha":false,"recipe":"8da4w"}'
    assert parse_recipe({"recipe": "8da4w", "quantize_mha": True}).key_text() == \
        '{"group_size":32,"keep_fp32":[],"quantize_mha":true,"recipe":"8da4w"}'
    r = parse_recipe({"recipe": "8da4w", "group_size": 128, "keep_fp32": ["lm_head", "attn", "lm_head"]})
    assert r.key_text() == '{"group_size":128,"keep_fp32":["attn","lm_head"],"quantize_mha":false,"recipe":"8da4w"}'
    # the order of keep_fp32 does not decide the output, so not the key either
    assert r.key_text() == parse_recipe({"recipe": "8da4w", "group_size": 128,
                                         "keep_fp32": ["attn", "lm_head"]}).key_text()
    # a group size is meaningless for int8: it is not in the key
    assert QuantRecipe("int8", group_size=64).key_text() == parse_recipe("int8").key_text()
    assert json.loads(r.key_text())["recipe"] == "8da4w"
    assert hash(r) == hash(QuantRecipe("8da4w", 128, ("lm_head", "attn", "lm_head")))
    # qembedding is in the key only when set (the keys above stay as they were)
    assert parse_recipe({"recipe": "8da4w", "qembedding": "4w"}).key_text() == \
        '{"group_size":32,"keep_fp32":[],"qembedding":"4w","quantize_mha":false,"recipe":"8da4w"}'
    assert parse_recipe({"recipe": "int8-dynamic", "qembedding": "8w"}).key_text() == \
        '{"keep_fp32":[],"qembedding":"8w","recipe":"int8-dynamic"}'


@pytest.mark.parametrize(
    "spec, words",
    [
        ("int4", ["'int4'", "did you mean 'int8'"]),
        ("8da4", ["'8da4'", "did you mean '8da4w'"]),
        ("int8_dynamic", ["did you mean 'int8-dynamic'"]),
        ("fp16", ["'fp16'", "int8, int8-dynamic, 8da4w"]),
        (8, ["expected a recipe name", "int"]),
        (None, ["expected a recipe name", "NoneType"]),
        ({"name": "int8"}, ["unknown key", "'name'"]),
        ({"recipe": "8da4w", "groupsize": 64}, ["did you mean 'group_size'"]),
        ({"group_size": 64}, ["missing 'recipe'"]),
        ({"recipe": "8da4w", "group_size": 48}, ["group_size 48", "multiple of 32"]),
        ({"recipe": "8da4w", "group_size": 0}, ["multiple of 32"]),
        ({"recipe": "8da4w", "group_size": "32"}, ["group_size must be an int"]),
        ({"recipe": "8da4w", "group_size": True}, ["group_size must be an int"]),
        ({"recipe": "int8", "group_size": 64}, ["applies to 8da4w only"]),
        ({"recipe": "int8-dynamic", "quantize_mha": True}, ["quantize_mha applies to 8da4w only"]),
        ({"recipe": "8da4w", "quantize_mha": "yes"}, ["quantize_mha must be true or false", "'yes'"]),
        ({"recipe": "int8", "keep_fp32": 3}, ["keep_fp32 must be a list"]),
        ({"recipe": "int8", "keep_fp32": ["fc", ""]}, ["non-empty strings"]),
        ({"recipe": 8}, ["'recipe' must be a string"]),
        ({"recipe": "8da4w", "qembedding": "4bit"}, ["qembedding '4bit' is not one of 8w, 4w"]),
        ({"recipe": "int8", "qembedding": "8w"}, ["qembedding applies to int8-dynamic and 8da4w"]),
    ],
)
def test_bad_recipe_names_the_input(spec, words):
    with pytest.raises(QuantizeError) as info:
        parse_recipe(spec)
    for word in words:
        assert word in str(info.value)


def test_recipe_is_frozen():
    r = parse_recipe("int8")
    with pytest.raises(Exception):
        r.name = "8da4w"
    assert str(parse_recipe({"recipe": "8da4w", "group_size": 64, "keep_fp32": ["x"]})) == \
        "8da4w, group_size=64, keep_fp32=['x']"


# ---------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, hidden=256, last_in=256):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, last_in)
        self.head = nn.Linear(last_in, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    """conv-BN-ReLU, conv-BN + residual add + ReLU, max pool, global average pool, linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.c2 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = F.relu(self.bn1(self.c1(x)))
        z = F.relu(self.bn2(self.c2(y)) + y)
        z = F.max_pool2d(z, 2)
        return self.fc(z.mean((2, 3)))


def mlp_case(**kw):
    torch.manual_seed(0)
    return MLP(**kw).eval(), [(torch.randn(4, 64),) for _ in range(4)]


def cnn_case():
    torch.manual_seed(0)
    model = CNN().eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return model, [(torch.randn(1, 3, 16, 16),) for _ in range(4)]


class _Hidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, return_dict=True).last_hidden_state


def vit_case():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, attn_implementation="eager")
    model = _Hidden(transformers.ViTModel(config, add_pooling_layer=False).eval()).eval()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(3)]


def bert_case():
    pytest.importorskip("transformers")
    from examples.hf_models import bert

    model, (ids, mask) = bert()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randint(0, 128, (2, 12), generator=g), mask) for _ in range(3)]


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False, return_dict=True).logits


def llama_case():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="eager",
        tie_word_embeddings=False,
    )
    model = _Logits(transformers.LlamaForCausalLM(config).eval()).eval()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randint(0, 128, (1, 16), generator=g),) for _ in range(3)]


# ---------------------------------------------------------------- helpers


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def outputs(fn, batches):
    with torch.no_grad():
        return torch.cat([first(fn(*b)).flatten() for b in batches])


def sqnr(ref, out):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def rel(ref, out):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def calls(program, target):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


def value_of(program, node):
    spec = dict(zip([n for n in program.graph.nodes if n.op == "placeholder"],
                    program.graph_signature.input_specs))[node]
    return (program.constants if spec.target in program.constants else program.state_dict)[spec.target]


def executorch_int8(model, batches):
    """ExecuTorch's stock flow: XNNPACKQuantizer (per-channel symmetric) with PT2E."""
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    module = torch.export.export(model, batches[0], strict=False).module()
    prepared = prepare_pt2e(module, XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True)))
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return convert_pt2e(prepared)


def torchao_dynamic(model, weight_dtype=torch.int4, group_size=32):
    """torchao's own ``quantize_`` with the config ExecuTorch's 8da4w uses (same K filter)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    model = copy.deepcopy(model)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=weight_dtype,
                                                          weight_granularity=PerGroup(group_size)),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and m.in_features % group_size == 0)
    return model


def check_static_weights(program):
    """Every weight dq is per channel, symmetric int8 [-127, 127], from int8 constants."""
    dqs = calls(program, qd.dequantize_per_channel.default)
    for dq in dqs:
        w, scales, zps, axis, qmin, qmax, dtype = dq.args
        assert (qmin, qmax, dtype) == (-127, 127, torch.int8)
        assert w.op == scales.op == zps.op == "placeholder"
        wv, sv, zv = value_of(program, w), value_of(program, scales), value_of(program, zps)
        assert wv.dtype == torch.int8 and wv.abs().max() <= 127
        assert sv.dtype == torch.float32 and sv.shape == (wv.shape[axis],)
        assert zv.dtype == torch.int64 and not zv.any()
    return dqs


def check_static_activations(program):
    qs = calls(program, qd.quantize_per_tensor.default)
    for q in qs:
        scale, zp, qmin, qmax, dtype = q.args[1:]
        assert isinstance(scale, float) and isinstance(zp, int)
        assert (qmin, qmax, dtype) == (-128, 127, torch.int8)
        assert q.users and all(u.target is qd.dequantize_per_tensor.default and u.args[1:] == q.args[1:]
                               for u in q.users)
    return qs


# ---------------------------------------------------------------- int8 static


def test_int8_mlp_graph_and_accuracy_match_executorch():
    model, batches = mlp_case()
    program = export(model, batches[0])
    quantized = quantize(program, "int8", batches)
    # linear layers: int8 [N, K] -> dequantize_per_channel(axis 0) -> permute_copy -> addmm, bias fp32
    dqs = check_static_weights(quantized)
    assert len(dqs) == 3
    for dq in dqs:
        assert dq.args[3] == 0
        (permute,) = dq.users
        assert permute.target is aten.permute_copy.default and permute.args[1] == [1, 0]
        (addmm,) = permute.users
        assert addmm.target is aten.addmm.default
        assert value_of(quantized, addmm.args[0]).dtype == torch.float32   # the bias stays fp32
        assert addmm.args[1].target is qd.dequantize_per_tensor.default
    assert value_of(quantized, dqs[0].args[0]).shape == (256, 64)
    assert len(check_static_activations(quantized)) == 4    # input, fc1+relu, fc2+relu, head
    # relu fused: the relu, not the addmm, feeds the quantize
    assert all(q.args[0].target in (aten.relu.default, aten.addmm.default) for q in calls(quantized, qd.quantize_per_tensor.default)[1:])
    assert not [n for n in quantized.graph.nodes if n.op == "placeholder" and "folded" in n.name]
    # the same user inputs and outputs
    assert quantized.call_spec == program.call_spec
    assert [s.arg.name for s in quantized.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == ["x"]
    ref, ours = outputs(model, batches), outputs(quantized.module(), batches)
    theirs = outputs(executorch_int8(model, batches), batches)
    assert rel(ref, ours) < 0.05 and sqnr(ref, ours) > 30
    assert sqnr(ref, ours) >= sqnr(ref, theirs) - 0.5


def test_int8_cnn_folds_batch_norm_and_shares_qparams():
    model, batches = cnn_case()
    program = export(model, batches[0])
    code, names = program.graph_module.code, (list(program.state_dict), list(program.constants))
    quantized = quantize(program, "int8", batches)
    # the input program is untouched
    assert program.graph_module.code == code and (list(program.state_dict), list(program.constants)) == names
    assert torch.allclose(outputs(program.module(), batches), outputs(model, batches), atol=1e-5)
    assert not calls(quantized, aten._native_batch_norm_legit_no_training.default)
    assert len(check_static_weights(quantized)) == 3
    convs = calls(quantized, aten.convolution.default)
    assert all(c.args[0].target is qd.dequantize_per_tensor.default for c in convs)
    assert all(c.args[1].target is qd.dequantize_per_channel.default for c in convs)
    assert all(value_of(quantized, c.args[2]).dtype == torch.float32 for c in convs)
    qs = check_static_activations(quantized)
    # conv1 + relu fused; the residual add + relu fused
    (relu1, relu2) = calls(quantized, aten.relu.default)
    assert relu1.args[0] is convs[0] and relu2.args[0].target is aten.add.Tensor
    # max pool and the global average pool keep their producer's scale / zero point
    (pool,) = calls(quantized, aten.max_pool2d_with_indices.default)
    (mean,) = calls(quantized, aten.mean.dim)
    q_in = pool.args[0].args[0]
    (getitem,) = pool.users
    (q_pool,) = getitem.users
    (q_mean,) = mean.users
    assert q_in.args[1:3] == q_pool.args[1:3] == q_mean.args[1:3]
    assert len(qs) == 7
    ref, ours = outputs(model, batches), outputs(quantized.module(), batches)
    theirs = outputs(executorch_int8(model, batches), batches)
    assert rel(ref, ours) < 0.05 and sqnr(ref, ours) > 30
    assert sqnr(ref, ours) >= sqnr(ref, theirs) - 0.5


def test_int8_vit_is_close_to_executorch():
    model, batches = vit_case()
    quantized = quantize(export(model, batches[0]), "int8", batches)
    assert len(check_static_weights(quantized)) == 13  # patch conv + 2 x (q, k, v, o, up, down)
    check_static_activations(quantized)
    ref, ours = outputs(model, batches), outputs(quantized.module(), batches)
    theirs = outputs(executorch_int8(model, batches), batches)
    assert sqnr(ref, ours) > 20
    assert sqnr(ref, ours) >= sqnr(ref, theirs) - 0.5


def test_int8_cat_shares_one_scale():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)

        def forward(self, x):
            return self.c(torch.cat([self.a(x), 3 * self.b(x)], dim=1))

    torch.manual_seed(0)
    model, batches = Cat().eval(), [(torch.randn(2, 8),) for _ in range(3)]
    quantized = quantize(export(model, batches[0]), "int8", batches)
    (cat,) = calls(quantized, aten.cat.default)
    params = {dq.args[0].args[1:3] for dq in cat.args[0]}
    (q_out,) = cat.users
    assert len(params) == 1 and q_out.args[1:3] in params


def test_int8_keep_fp32_by_name_and_class():
    model, batches = cnn_case()
    program = export(model, batches[0])
    by_name = quantize(program, {"recipe": "int8", "keep_fp32": ["fc"]}, batches)
    assert len(calls(by_name, qd.dequantize_per_channel.default)) == 2
    (addmm,) = calls(by_name, aten.addmm.default)
    assert addmm.args[2].target is aten.permute_copy.default and addmm.args[2].args[0].op == "placeholder"
    by_class = quantize(program, {"recipe": "int8", "keep_fp32": ["Conv2d"]}, batches)
    assert len(calls(by_class, qd.dequantize_per_channel.default)) == 1
    assert all(c.args[1].op == "placeholder" for c in calls(by_class, aten.convolution.default))
    # An entry that names no module is reported (quantize logs it as a warning; lowering's
    # loggers are configured by other tests of a session, so the list is checked itself).
    from lowering.quantize.graph import unmatched_keep_fp32

    assert unmatched_keep_fp32(program.graph, ("fc", "Conv2d")) == []
    assert unmatched_keep_fp32(program.graph, ("fc2", "Conv2d")) == ["fc2"]
    quantize(program, {"recipe": "int8", "keep_fp32": ["fc2", "Conv2d"]}, batches)


def test_int8_without_calibration_or_with_bad_batches_names_them():
    model, batches = mlp_case()
    program = export(model, batches[0])
    with pytest.raises(QuantizeError, match="needs calibration data"):
        quantize(program, "int8")
    with pytest.raises(QuantizeError, match="needs calibration data"):
        quantize(program, "int8", [])
    cases = [
        ([batches[0], (torch.randn(4, 64), torch.randn(4, 64))], "batch 1 has 2 input"),
        ([batches[0], batches[1], (torch.randn(4, 64, dtype=torch.float64),)], "batch 2, input 'x'.*float64"),
        ([(torch.randn(64),)], "batch 0, input 'x'.*rank 1.*rank 2"),
        ([(torch.randn(2, 64),)], r"batch 0, input 'x'.*\[2, 64\].*\[4, 64\].*fixed at export"),
        ([("not a tensor",)], "batch 0, input 'x': expected a tensor"),
        ([3], "batch 0 must be a tuple"),
        (torch.randn(4, 64), "iterable of input tuples"),
    ]
    for calibration, words in cases:
        with pytest.raises(QuantizeError, match=words):
            quantize(program, "int8", calibration)
    # a callable returning the batches is accepted
    assert calls(quantize(program, "int8", lambda: batches[:1]), qd.quantize_per_tensor.default)
    with pytest.raises(QuantizeError, match="recipe 'int4': unknown name"):
        quantize(program, "int4", batches)


def test_int8_refuses_dynamic_shapes():
    model, batches = mlp_case()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = export(model, batches[0], dynamic_shapes={"x": {0: batch}})
    with pytest.raises(QuantizeError, match="needs static shapes.*'x'"):
        quantize(program, "int8", batches)
    assert calls(quantize(program, "8da4w"), ao.dequantize_affine.default)  # the dynamic recipes do not re-export


# ---------------------------------------------------------------- dynamic


def check_dynamic(program, gs, qmin, qmax):
    """Every weight dq: int8 qdata [N, K] -> dequantize_affine([1, gs]) -> permute_copy -> gemm,
    whose activation is per-token choose_qparams / quantize / dequantize."""
    weight_dqs = [n for n in calls(program, ao.dequantize_affine.default) if n.args[0].op == "placeholder"]
    for dq in weight_dqs:
        q, block, scale, zp, dtype, lo, hi = dq.args
        qv, sv, zv = value_of(program, q), value_of(program, scale), value_of(program, zp)
        n, k = qv.shape
        assert block == [1, gs or k] and (dtype, lo, hi) == (torch.int8, qmin, qmax)
        assert qv.dtype == torch.int8 and qmin <= qv.min() and qv.max() <= qmax
        assert sv.dtype == torch.float32 and sv.shape == (n, k // (gs or k))
        assert zv.dtype == torch.int8 and zv.shape == sv.shape and not zv.any()
        (permute,) = dq.users
        assert permute.target is aten.permute_copy.default and permute.args[1] == [1, 0]
        (gemm,) = permute.users
        x = gemm.args[1] if gemm.target is aten.addmm.default else gemm.args[0]
        assert x.target is ao.dequantize_affine.default
        xq, xblock, xs, xzp = x.args[:4]
        assert x.args[4:] == (torch.int8, -128, 127) and xblock == [1, k]
        assert xq.target is ao.quantize_affine.default and xq.args[1:] == (xblock, xs, xzp, torch.int8, -128, 127)
        assert xs.target is operator.getitem and xs.args[1] == 0 and xzp.args[1] == 1
        choose = xs.args[0]
        assert choose.target is ao.choose_qparams_affine.default
        assert choose.args == (xq.args[0], "ASYMMETRIC", [1, k], torch.int8, -128, 127, None, None, torch.int8)
    return weight_dqs


def test_8da4w_llama_matches_torchao_quantize():
    model, batches = llama_case()
    program = export(model, batches[0])
    quantized = quantize(program, "8da4w", batches)
    dqs = check_dynamic(quantized, 32, -8, 7)
    assert len(dqs) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
    reference = torchao_dynamic(model)
    # the same integers and scales as torchao's IntxUnpackedToInt8Tensor, bit for bit
    ours = {value_of(quantized, dq.args[0]).numpy().tobytes(): value_of(quantized, dq.args[2]) for dq in dqs}
    linears = [m for m in reference.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == len(dqs)
    for linear in linears:
        assert torch.equal(ours[linear.weight.qdata.numpy().tobytes()], linear.weight.scale)
    ref, out, theirs = outputs(model, batches), outputs(quantized.module(), batches), outputs(reference, batches)
    assert (out - theirs).abs().max() < 1e-5
    assert sqnr(ref, out) > 12


def test_8da4w_leaves_linears_whose_k_does_not_divide_fp32():
    model, batches = mlp_case(hidden=256, last_in=48)   # head: K = 48
    program = export(model, batches[0])
    quantized = quantize(program, "8da4w", batches)
    assert len(check_dynamic(quantized, 32, -8, 7)) == 2
    assert quantized.state_dict["fc1.bias"] is program.state_dict["fc1.bias"]  # weights shared, not copied
    assert "fc1.weight#t" in program.constants and "fc1.weight#t" not in quantized.constants
    assert quantized.graph_module.meta["lowerflow_quantize_skipped"] == ("addmm_2",)
    assert len(check_dynamic(quantize(program, {"recipe": "8da4w", "group_size": 128}, batches), 128, -8, 7)) == 1
    out, theirs = outputs(quantized.module(), batches), outputs(torchao_dynamic(model), batches)
    assert (out - theirs).abs().max() < 1e-5


class _Encoder(nn.Module):
    """Two ``nn.TransformerEncoderLayer``s: MultiheadAttention (packed in-projection,
    NonDynamicallyQuantizableLinear out-projection) and a two-linear feed-forward each."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


def test_8da4w_leaves_multihead_attention_fp32_as_torchao_does_unless_quantize_mha():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    torch.manual_seed(0)
    model = _Encoder().eval()
    batches = [(torch.randn(1, 8, 64),) for _ in range(3)]
    program = export(model, batches[0])
    quantized = quantize(program, "8da4w")
    assert len(check_dynamic(quantized, 32, -8, 7)) == 2 * 2            # linear1, linear2 per layer
    assert len(quantized.graph_module.meta["lowerflow_quantize_skipped"]) == 2 * 2  # in_proj, out_proj
    # ExecuTorch's 8da4w flow: torchao's quantize_ with its default filter (nn.Linear modules,
    # NonDynamicallyQuantizableLinear excluded)
    reference = copy.deepcopy(model)
    quantize_(reference, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(32)))
    assert (outputs(quantized.module(), batches) - outputs(reference, batches)).abs().max() < 1e-5
    everything = quantize(program, {"recipe": "8da4w", "quantize_mha": True})
    assert len(check_dynamic(everything, 32, -8, 7)) == 4 * 2
    assert everything.graph_module.meta["lowerflow_quantize_skipped"] == ()
    # int8-dynamic follows ExecuTorch's PT2E flow, which quantizes every linear op, MHA's too
    assert len(check_dynamic(quantize(program, "int8-dynamic"), 0, -127, 127)) == 4 * 2
    ref = outputs(model, batches)
    assert rel(ref, outputs(quantized.module(), batches)) < rel(ref, outputs(everything.module(), batches))


class MultiheadAttention(nn.Module):
    """A user's attention module that happens to share the name: nn.Linear projections."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 3 * 64), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v))


def test_8da4w_quantizes_the_linears_of_a_user_module_named_multihead_attention():
    torch.manual_seed(0)
    program = export(MultiheadAttention().eval(), (torch.randn(1, 8, 64),))
    quantized = quantize(program, "8da4w")
    assert len(check_dynamic(quantized, 32, -8, 7)) == 2   # nn.Linear modules, as torchao's filter takes them
    assert quantized.graph_module.meta["lowerflow_quantize_skipped"] == ()


def test_int8_dynamic_bert_and_keep_fp32():
    model, batches = bert_case()
    program = export(model, batches[0])
    quantized = quantize(program, "int8-dynamic")
    dqs = check_dynamic(quantized, 0, -127, 127)
    assert len(dqs) == 2 * 6 + 1   # q, k, v, o, up, down per layer + pooler
    ref, out = outputs(model, batches), outputs(quantized.module(), batches)
    assert rel(ref, out) < 0.01 and sqnr(ref, out) > 40
    kept = quantize(program, {"recipe": "int8-dynamic", "keep_fp32": ["model.encoder.layer.1", "BertPooler"]})
    assert len(check_dynamic(kept, 0, -127, 127)) == 6
    assert program.graph_module.code != quantized.graph_module.code  # the input program is untouched
    assert not calls(program, ao.dequantize_affine.default)


def executorch_dynamic(model, batches):
    """ExecuTorch's stock int8-dynamic flow: XNNPACKQuantizer (per-channel, dynamic) with PT2E."""
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    prepared = prepare_pt2e(torch.export.export(model, batches[0], strict=False).module(),
                            XNNPACKQuantizer().set_global(config))
    with torch.no_grad():
        prepared(*batches[0])
    return convert_pt2e(prepared)


def test_int8_dynamic_quantizes_the_convs_executorch_does_and_8da4w_only_linears():
    from tests._interop import run_in_executorch

    from lowering.runtime import load
    from lowering.targets import partitioner_for

    model, batches = cnn_case()
    program = export(model, batches[0])
    quantized = quantize(program, "int8-dynamic")
    assert len(check_dynamic(quantized, 0, -127, 127)) == 1                     # fc
    assert not calls(quantized, aten._native_batch_norm_legit_no_training.default)  # folded, as PT2E does
    # c2 (conv-BN, then the residual add); c1's only reader is a ReLU, which the quantizer leaves fp32
    [ours] = calls(quantized, qd.dequantize_per_channel.default)
    theirs = executorch_dynamic(model, batches)
    [their_dq] = [n for n in theirs.graph.nodes if n.target is qd.dequantize_per_channel.default
                  and getattr(theirs, n.args[0].target).dim() == 4]   # (its linear weight is per channel too)
    assert ours.args[3:] == their_dq.args[3:] == (0, -127, 127, torch.int8)
    their_w = getattr(theirs, their_dq.args[0].target)
    assert (value_of(quantized, ours.args[0]).int() - their_w.int()).abs().max() <= 1  # BN folds round alike
    (conv,) = ours.users
    assert conv.args[0].target is qd.dequantize_per_tensor.tensor
    assert conv.args[0].args[0].args[1].args[0].target is qd.choose_qparams.tensor  # dq <- q <- scale <- choose
    ref, out, et = outputs(model, batches), outputs(quantized.module(), batches), outputs(theirs, batches)
    assert rel(et, out) < 0.01 and sqnr(ref, out) > 30
    # lowered to xnnpack (a dynamic conv and a dynamic linear), run by ExecuTorch's runtime
    pte = lowering.lower(model, batches[0], quantize="int8-dynamic", partitioner=partitioner_for("xnnpack")).pte
    with torch.no_grad():
        want = quantized.module()(*batches[0])
    [[got]] = run_in_executorch(pte, batches[0])
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    [ours_got] = load(pte).run("forward", list(batches[0]))
    assert (ours_got - got).abs().max() <= 1e-5 * got.abs().max()   # lowering.runtime: XNNPACK's arithmetic
    # 8da4w: torchao's quantize_ takes nn.Linear modules only
    da4w = quantize(program, "8da4w")
    assert len(check_dynamic(da4w, 32, -8, 7)) == 1
    assert calls(da4w, aten._native_batch_norm_legit_no_training.default) and not calls(
        da4w, qd.dequantize_per_channel.default)


# ---------------------------------------------------------------- determinism


def fingerprint(program) -> str:
    h = hashlib.sha256(program.graph_module.code.encode())
    for table in (program.state_dict, program.constants):
        for name in sorted(table):
            value = table[name]
            if isinstance(value, torch.Tensor):
                h.update(name.encode() + str(value.dtype).encode() + value.detach().contiguous().numpy().tobytes())
    for spec in program.graph_signature.input_specs:
        h.update(f"{spec.kind}:{spec.target}".encode())
    return h.hexdigest()


_FINGERPRINT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.test_quantize import cnn_case, mlp_case, fingerprint
from lowering.export import export
from lowering.quantize import quantize
model, batches = cnn_case()
print(fingerprint(quantize(export(model, batches[0]), "int8", batches)))
model, batches = mlp_case()
print(fingerprint(quantize(export(model, batches[0]), "8da4w")))
"""


def test_quantize_is_deterministic_within_and_across_processes():
    model, batches = cnn_case()
    program = export(model, batches[0])
    a, b = quantize(program, "int8", batches), quantize(program, "int8", batches)
    assert a.graph_module.code == b.graph_module.code
    assert fingerprint(a) == fingerprint(b)
    mlp, mlp_batches = mlp_case()
    mlp_fp = fingerprint(quantize(export(mlp, mlp_batches[0]), "8da4w"))
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _FINGERPRINT_SCRIPT.format(root=root)], capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [fingerprint(a), mlp_fp]


# ---------------------------------------------------------------- lower


def test_lower_runs_quantize_between_export_and_to_backend():
    model, batches = mlp_case()
    plain = lowering.lower(model, batches[0])
    assert plain.timings["quantize"] == 0.0 and list(plain.timings)[:2] == ["export", "quantize"]
    with pytest.raises(LoweringError, match="no quantize recipe"):
        lowering.lower(model, batches[0], calibration=batches)
    with pytest.raises(QuantizeError, match="model 'MLP'.*needs calibration"):
        lowering.lower(model, batches[0], quantize="int8")
    with pytest.raises(QuantizeError, match="model 'MLP'.*batch 0 has 2 input"):
        lowering.lower(model, batches[0], quantize="int8", calibration=[batches[0] * 2])
    with pytest.raises(QuantizeError, match="unknown name"):
        lowering.lower(model, batches[0], quantize="int3")
    methods = {"a": (model, batches[0]), "b": (model, batches[0])}
    with pytest.raises(LoweringError, match="calibration must be a dict"):
        lowering.lower(methods, quantize="int8", calibration=batches)
    with pytest.raises(QuantizeError, match="model 'b'.*needs calibration"):
        lowering.lower(methods, quantize="int8", calibration={"a": batches})


def test_lower_int8_without_partitioner_gives_bytes():
    """The portable program keeps its q/dq ops at the top level: the stock runtime's
    quantized kernels (quantized_decomposed::*.out) run them, and so does lowerflow's."""
    from lowering.verify import verify

    model, batches = mlp_case()
    result = lowering.lower(model, batches[0], quantize="int8", calibration=batches)
    assert result.timings["quantize"] > 0 and result.pte
    assert calls(result.exported_program, qd.quantize_per_tensor.default)  # the q/dq stay at the top level
    reference = quantize(export(model, batches[0]), "int8", calibration=batches)
    report = verify(result.pte, model, batches[0], reference=reference)
    assert report.ok and {c.runtime for c in report.checks if c.ok} >= {"lowerflow"}, report.to_dict()


def test_lower_dynamic_recipes_without_partitioner_are_refused():
    model, batches = mlp_case()
    for recipe in ("8da4w", "int8-dynamic"):
        with pytest.raises(QuantizeError, match=f"recipe '{recipe}' cannot quantize a program without a backend"):
            lowering.lower(model, batches[0], quantize=recipe)
