"""The ``xnnpack`` target: programs the stock ExecuTorch runtime runs on its XNNPACK backend.

Every model is lowered by lowerflow, then run by ExecuTorch's runtime (the test
extra) and by lowerflow's own executor (whose XNNPACK runtime interprets the
payload on torch ops), and compared with eager.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowering
from examples.models import MODELS
from lowering.pte import deserialize
from lowering.runtime import load
from lowering.targets import partitioner_for
from tests._models import mlp_with_head

REPO = Path(__file__).resolve().parents[1]

xnn = pytest.importorskip("lowering.backends.xnnpack")
from lowering.backends.xnnpack import payload as P  # noqa: E402
from lowering.backends.xnnpack.generated import xnngraph_generated as fbx  # noqa: E402

KIND = P.node_kind_names()


def _lower(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack"))


def _eager(factory, calls=1):
    """Outputs of ``calls`` successive eager calls on a fresh model (state carries over)."""
    model, inputs = factory()
    with torch.no_grad():
        return [torch.utils._pytree.tree_leaves(model(*inputs)) for _ in range(calls)], inputs


def _assert_close(actual, expected, what):
    """atol 1e-3, and relative to the output's magnitude (outputs of random nets may be tiny)."""
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, (what, i, a.shape, e.shape, a.dtype, e.dtype)
        if not e.dtype.is_floating_point:
            assert torch.equal(a, e), (what, i)
            continue
        diff = float((a - e).abs().max()) if e.numel() else 0.0
        scale = float(e.abs().max()) if e.numel() else 0.0
        assert diff <= 1e-3, (what, i, diff)
        assert diff <= 1e-4 * scale + 1e-6, (what, i, diff, scale)


def _run_executorch(pte, inputs, calls=1):
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(pte).load_method("forward")
    return [list(method.execute(list(inputs))) for _ in range(calls)]


def _payloads(pte: bytes):
    data = deserialize(pte)
    plan = data.program.executionPlan[0]
    out = []
    for d in plan.delegates or []:
        assert d.id.decode() == "XnnpackBackend"
        out.append(data.delegate_data[d.processed.index])
    return data, out


def _kernel_calls(pte: bytes) -> int:
    plan = deserialize(pte).program.executionPlan[0]
    return sum(1 for ins in plan.chains[0].instructions
               if ins.instrArgsType == lowering.pte.schema.InstructionArguments.KernelCall)


def _node_kinds(payload: bytes) -> Counter:
    graph, _ = P.deserialize_payload(payload)
    return Counter(KIND[n.xnodeUnionType] for n in graph.xnodes)


# --------------------------------------------------------------------------- every model


_ALL_MODELS = {**MODELS, "mlp_with_head": mlp_with_head}


@pytest.mark.parametrize("name", sorted(_ALL_MODELS))
def test_model_runs_on_executorch_and_ours(name):
    pytest.importorskip("executorch")
    expected, inputs = _eager(_ALL_MODELS[name], calls=2)
    model, _ = _ALL_MODELS[name]()
    result = _lower(model, inputs)
    _, payloads = _payloads(result.pte)
    if name != "integer_inputs":  # nothing float to delegate there
        assert payloads, f"{name}: nothing delegated"
    ours = load(result.pte).method("forward")
    for call in range(2):  # twice: state (buffer_mutation) carries over
        _assert_close(ours.execute(list(inputs)), expected[call], f"{name} ours call {call}")
    for call, outputs in enumerate(_run_executorch(result.pte, inputs, calls=2)):
        _assert_close(outputs, expected[call], f"{name} executorch call {call}")


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "mobilenet_v2":
        model = transformers.MobileNetV2Model(
            transformers.MobileNetV2Config(image_size=64, depth_multiplier=0.35)
        ).eval()
        with torch.no_grad():  # non-trivial batch norms and weights: outputs of a visible size
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 1.5)
                if isinstance(m, torch.nn.Conv2d):
                    torch.nn.init.kaiming_normal_(m.weight)

        class Pooled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, x):
                return self.model(x, return_dict=True).pooler_output

        return Pooled().eval(), (torch.randn(1, 3, 64, 64),)
    if name == "gpt2":  # tied LM head, tanh GELU with x**3, layer norms, causal mask
        config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                         use_cache=False, attn_implementation="eager")
        lm = transformers.GPT2LMHeadModel(config).eval()

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = lm

            def forward(self, ids):
                return self.model(input_ids=ids, use_cache=False, return_dict=True).logits

        return Logits().eval(), (torch.randint(0, 128, (1, 16)),)
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, attn_implementation="sdpa",
    )
    model = transformers.BertModel(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(ids, attention_mask=mask, return_dict=True).last_hidden_state

    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return Hidden().eval(), (torch.randint(0, 128, (2, 12)), mask)


@pytest.mark.parametrize("name", ["mobilenet_v2", "bert", "gpt2"])
def test_transformers_models(name):
    pytest.importorskip("executorch")
    model, inputs = _hf(name)
    with torch.no_grad():
        expected = torch.utils._pytree.tree_leaves(model(*inputs))
    assert max(float(e.abs().max()) for e in expected) > 1e-2  # not a vanishing output
    result = _lower(model, inputs)
    _, payloads = _payloads(result.pte)
    if name == "mobilenet_v2":
        assert len(payloads) == 1 and _kernel_calls(result.pte) == 0
        kinds = _node_kinds(payloads[0])
        assert "XNNDepthwiseConv2d" in kinds and kinds["XNNStaticTranspose"] <= 2, kinds
    if name == "gpt2":  # the LM head's weight is the embedding's, stored once
        assert len(payloads) == 1
        wte = model.model.transformer.wte.weight.detach().numpy().tobytes()
        assert result.pte.count(wte) == 1
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, f"{name} ours")
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, f"{name} executorch")


# --------------------------------------------------------------------------- payload


def test_mlp_payload_header_and_graph():
    model, inputs = MODELS["mlp"]()
    result = _lower(model, inputs)
    data, (payload,) = _payloads(result.pte)
    # Header: zero, magic, length 30, flatbuffer at 32, constants right after it (none inline).
    assert payload[:4] == b"\0\0\0\0" and payload[4:8] == b"XH00"
    header = P.read_header(payload)
    assert int.from_bytes(payload[8:10], "little") == 30
    assert header.flatbuffer_offset == 32 and header.constant_data_size == 0
    assert header.constant_data_offset == 32 + header.flatbuffer_size + (-header.flatbuffer_size) % 16
    assert payload[36:40] == b"XN01"
    graph, inline = P.deserialize_payload(payload)
    assert inline == b""
    # Round trip: the decoded graph serializes to the same payload.
    assert P.serialize_payload(graph) == payload
    assert graph.numExterns == 2 and list(graph.inputIds) == [0] and len(graph.outputIds) == 1
    fcs = [n for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"]
    assert len(fcs) == len(graph.xnodes) == 3
    assert [(n.outputMinMax.outputMin, n.outputMinMax.outputMax) if n.outputMinMax else None for n in fcs] == [
        (0.0, float("inf")), (0.0, float("inf")), None]  # relus fused
    for value in graph.xvalues:
        t = value.xvalueUnion
        assert t.idOut == graph.xvalues.index(value)
        assert (t.flags == 0) == (t.externalId == P.INVALID_ID)
    # Weights: named data keyed by sha256, stored once each in the program.
    keys = [e.namedKey.decode() for e in graph.constantData[1:]]
    assert len(keys) == 6 and set(keys) == set(data.named_data)
    for key, blob in data.named_data.items():
        assert hashlib.sha256(blob).hexdigest() == key
    assert data.named_data[keys[0]] == model.fc1.weight.detach().t().contiguous().numpy().tobytes()


def test_named_data_segments_deduplicated_and_aligned():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight)
                self.b.bias.zero_()
                self.a.bias.zero_()

        def forward(self, x):
            return self.b(torch.sin(self.a(x)))  # sin is delegated too; equal weights anyway

    torch.manual_seed(0)
    model, inputs = Twice().eval(), (torch.randn(2, 16),)
    pte = _lower(model, inputs).pte
    data = deserialize(pte)
    keys = list(data.named_data)
    assert len(keys) == 2  # one weight, one (zero) bias: equal bytes, one key
    program = load(pte).pte.program
    del program
    from lowering.pte.generated import program_generated as fb

    raw = fb.ProgramT.InitFromPackedBuf(pte[:int.from_bytes(pte[16:24], "little")], 0)
    assert len({n.segmentIndex for n in raw.namedData}) == len(raw.namedData)
    for segment in raw.segments:
        assert segment.offset % 128 == 0
    _assert_close(_run_executorch(pte, inputs)[0], [model(*inputs).detach()], "dedup")


def test_cnn_batch_norm_folded_activations_fused_two_transposes():
    model, inputs = MODELS["cnn"]()
    result = _lower(model, inputs)
    _, (payload,) = _payloads(result.pte)
    kinds = _node_kinds(payload)
    assert kinds == Counter({"XNNConv2d": 3, "XNNStaticTranspose": 2, "XNNMaxPooling2d": 1, "XNNAdd": 1,
                             "XNNAvgPooling2d": 1, "XNNStaticReshape": 1, "XNNFullyConnected": 1}), kinds
    graph, _ = P.deserialize_payload(payload)
    convs = [n for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNConv2d"]
    assert [bool(n.outputMinMax) for n in convs] == [True, True, True]
    filt = graph.xvalues[convs[0].xnodeUnion.filterId].xvalueUnion
    assert list(filt.dims) == [16, 3, 3, 3]  # OHWI


def test_scalar_ops_squeeze_and_repeated_cat_are_delegated():
    class Beyond(torch.nn.Module):
        def forward(self, x):
            y = (x * 0.5) / 4.0
            z = torch.cat([y, y], dim=1).unsqueeze(0).squeeze(0)
            return torch.softmax(z, -1), x.clone()

    model, inputs = Beyond().eval(), (torch.randn(3, 8),)
    result = _lower(model, inputs)
    assert _kernel_calls(result.pte) == 0
    _, (payload,) = _payloads(result.pte)
    graph, _ = P.deserialize_payload(payload)
    # x.clone() is returned: a Copy node, never the input value itself as an output.
    assert not set(graph.outputIds) & set(graph.inputIds)
    assert "XNNCopy" in _node_kinds(payload)
    with torch.no_grad():
        expected = list(model(*inputs))
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "beyond executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "beyond ours")


# --------------------------------------------------------------------------- partition constraints


def test_weight_used_outside_the_delegate_keeps_its_conv_out():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3, 3, 3))

        def forward(self, x):
            y = torch.nn.functional.conv2d(x, self.w)
            return torch.relu(y) + self.w.sum(dim=(0, 1, 2, 3), keepdim=False)  # sum stays portable

    torch.manual_seed(0)
    model, inputs = Shared().eval(), (torch.randn(1, 3, 8, 8),)
    result = _lower(model, inputs)
    top = Counter(str(n.target) for n in result.exported_program.graph.nodes if n.op == "call_function")
    assert top["aten.convolution.default"] == 1  # not delegated: its filter would be a runtime input
    with torch.no_grad():
        expected = [model(*inputs)]
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "shared weight")


def test_non_float_ops_stay_outside():
    model, inputs = MODELS["integer_inputs"]()
    result = _lower(model, inputs)
    _, payloads = _payloads(result.pte)
    assert payloads == []


def test_partitioner_reasons_name_the_constraint():
    from lowering.backends.xnnpack.preprocess import Context, check_node

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, 1), torch.nn.functional.gelu(x, approximate="tanh"), x + 2 * x

    ep = lowering.export(M(), (torch.randn(2, 3, 4),))
    ctx = Context(ep)
    reasons = {n.target: check_node(n, ctx) for n in ep.graph.nodes if n.op == "call_function"}
    assert "last" in reasons[torch.ops.aten._softmax.default]
    assert reasons[torch.ops.aten.gelu.default] is None  # tanh GELU: its formula (test_gelu_tanh_...)


def test_preprocess_error_names_the_node():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.sum(dim=1)

    ep = lowering.export(M(), (torch.randn(2, 3),))
    with pytest.raises(lowering.BackendError, match=r"node 'sum\w*'.*no XNNPACK lowering for aten.sum"):
        lowering.to_backend("XnnpackBackend", ep, ())


# --------------------------------------------------------------------------- storage, determinism


def test_delegated_program_with_named_data_round_trips_through_serialize():
    from lowering.emit import emit_program
    from lowering.memory_plan import memory_plan
    from lowering.serialize import deserialize_delegated_program, serialize_delegated_program

    model, inputs = MODELS["cnn"]()
    result = _lower(model, inputs)
    stored = serialize_delegated_program(result.exported_program, keep_stack_traces=False)
    again = deserialize_delegated_program(stored.manifest, stored.get_blob)
    lowered = [m for m in again.graph_module.children() if hasattr(m, "named_data")]
    assert lowered and all(m.named_data for m in lowered)
    assert emit_program(again, memory_plan(again)) == result.pte
    # Blobs are content-addressed: each named blob is stored under its own digest.
    for m in lowered:
        for key, blob in m.named_data.items():
            assert stored.blobs[hashlib.sha256(blob).hexdigest()] == blob


_LOWER_IN_SUBPROCESS = """
import sys, warnings, hashlib
warnings.simplefilter("ignore")
import lowering
from lowering.targets import partitioner_for
from examples.models import MODELS
model, inputs = MODELS[sys.argv[1]]()
pte = lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte
print(hashlib.sha256(pte).hexdigest())
"""


def test_bytes_identical_across_processes():
    model, inputs = MODELS["cnn"]()
    here = hashlib.sha256(_lower(model, inputs).pte).hexdigest()
    there = subprocess.run(
        [sys.executable, "-c", _LOWER_IN_SUBPROCESS, "cnn"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert here == there


def test_transformer_expanded_weights_become_fully_connected():
    """``bmm(x, expand(W))`` is a FullyConnected on W; same-shape expands vanish; relu after
    ``view(addmm)`` is fused into the FullyConnected."""
    model, inputs = MODELS["transformer"]()
    result = _lower(model, inputs)
    top = Counter(str(n.target) for n in result.exported_program.graph.nodes if n.op == "call_function")
    assert "aten.expand_copy.default" not in top and "aten.bmm.default" not in top
    data, payloads = _payloads(result.pte)
    kinds = sum((_node_kinds(p) for p in payloads), Counter())
    # 4 projections + 2 per layer norm (its means)
    assert kinds["XNNFullyConnected"] == 8 and kinds["XNNBatchMatrixMultiply"] == 2, kinds
    assert "XNNClamp" not in kinds
    # The expanded in-projection weight is stored once, unexpanded ([64, 192] fp32).
    assert max(len(b) for b in data.named_data.values()) == 64 * 192 * 4


def test_partition_over_the_extern_limit_is_left_out(monkeypatch):
    """More inputs + outputs than the runtime allows: the partition is dropped, not delegated."""
    model, inputs = MODELS["multi_output"]()  # one partition: 2 inputs, 4 outputs
    monkeypatch.setattr(P, "MAX_EXTERNS", 5)
    result = _lower(model, inputs)
    assert _payloads(result.pte)[1] == []
    monkeypatch.setattr(P, "MAX_EXTERNS", 6)
    assert len(_payloads(_lower(model, inputs).pte)[1]) == 1


def test_layer_norm_and_powers_are_delegated():
    """Beyond ExecuTorch 1.5.1's partitioner: layer norm (means as FullyConnected by 1/K) and
    x**3 / x**0.5 (GPT-2's tanh GELU uses x**3)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(32)
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)

        def forward(self, x):
            y = self.norm(x * 3.0 + 1.0)
            return y + 0.044715 * torch.pow(y, 3), torch.pow(y.abs(), 0.5)

    torch.manual_seed(0)
    model, inputs = M().eval(), (torch.randn(2, 5, 32),)
    result = _lower(model, inputs)
    assert _kernel_calls(result.pte) == 0
    with torch.no_grad():
        expected = list(model(*inputs))
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "layer norm executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "layer norm ours")


class _TiedHead(torch.nn.Module):
    """An embedding and an LM head sharing its weight (GPT-2 style)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)

    def forward(self, ids, y):
        h = torch.relu(self.emb(ids) + y)
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_tied_weight_stored_once(target):
    """The transposed view of a weight something else reads is not folded into a second
    constant; the XNNPACK head reads it as a static [N, K] weight (FullyConnected, no transpose:
    ~5x faster than a runtime weight) whose named data is a window onto the top-level constant."""
    torch.manual_seed(0)
    model, inputs = _TiedHead().eval(), (torch.randint(0, 64, (2, 5)), torch.randn(2, 5, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lowering.lower(model, inputs, partitioner=partitioner_for(target))
    weight = model.emb.weight.detach().numpy().tobytes()
    transposed = model.emb.weight.detach().t().contiguous().numpy().tobytes()
    assert result.pte.count(weight) == 1 and result.pte.count(transposed) == 0
    if target == "xnnpack":
        _, (payload,) = _payloads(result.pte)
        graph, _ = P.deserialize_payload(payload)
        (fc,) = [n.xnodeUnion for n in graph.xnodes if KIND[n.xnodeUnionType] == "XNNFullyConnected"]
        filt = graph.xvalues[fc.filterId].xvalueUnion
        assert fc.flags == 0 and filt.flags == 0 and filt.constantBufferIdx != 0
        assert list(deserialize(result.pte).named_data.values()).count(weight) == 1
    with torch.no_grad():
        expected = [model(*inputs)]
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, f"tied {target} executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, f"tied {target} ours")


def test_tied_llama_head_once_and_smaller_than_executorch():
    """transformers' Llama with ``tie_word_embeddings``: the embedding (portable, top level) and the
    lm_head (XNNPACK, static weight) read one copy of the table; ExecuTorch's .pte holds two."""
    transformers = pytest.importorskip("transformers")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    llama = transformers.LlamaForCausalLM(config).eval()
    assert llama.lm_head.weight is llama.model.embed_tokens.weight

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, ids):
            return self.llama(input_ids=ids).logits

    model, inputs = Logits().eval(), (torch.randint(0, 512, (1, 8)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte
        with torch.no_grad():
            ep = torch.export.export(model, inputs, strict=False)
            theirs = bytes(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    table = llama.lm_head.weight.detach().numpy().tobytes()  # [V, H]: the embedding's and the FC's layout
    assert ours.count(table) == 1 and theirs.count(table) == 2
    assert len(ours) < len(theirs) - len(table) // 2
    _, payloads = _payloads(ours)
    filters = []
    for payload in payloads:
        graph, _ = P.deserialize_payload(payload)
        filters += [graph.xvalues[n.xnodeUnion.filterId].xvalueUnion for n in graph.xnodes
                    if KIND[n.xnodeUnionType] == "XNNFullyConnected"]
    assert filters and all(f.constantBufferIdx != 0 and f.flags == 0 for f in filters)  # static weights only
    with torch.no_grad():
        expected = [model(*inputs)]
    _assert_close(_run_executorch(ours, inputs)[0], expected, "tied llama executorch")


class _ConvZoo(nn.Module):
    """Strides, dilation, depthwise with a multiplier, groups, transposed convolutions, BN after
    one (decomposed), fused and unfused activations, NHWC mean, pools with padding, a 7-way cat."""

    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        s.dw = nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=8)   # depthwise, multiplier 2
        s.g = nn.Conv2d(16, 16, 1, groups=4)
        s.ct = nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1)
        s.ctg = nn.ConvTranspose2d(8, 8, 2, stride=2, groups=2)
        s.bn = nn.BatchNorm2d(8)
        s.c1x = nn.Conv2d(1, 4, 3, padding=1)
        with torch.no_grad():
            s.bn.running_mean.uniform_(-1, 1); s.bn.running_var.uniform_(0.5, 2)
    def forward(s, x, m):
        y = F.hardswish(s.c1(x))
        y = F.relu6(s.dw(y))
        y = F.leaky_relu(s.g(y), 0.1)
        y = s.bn(s.ct(y))           # bn not after a conv: transposed conv -> decomposed
        y = torch.sigmoid(s.ctg(y)) * y.mean((2, 3), keepdim=True)
        z = F.max_pool2d(y, 3, 2, padding=1)
        w = F.avg_pool2d(y, 3, 2, padding=1, count_include_pad=False)
        u = torch.cat([z, w, z, w, z, w, z], 1)
        v = F.adaptive_avg_pool2d(u, 1).flatten(1)
        q = s.c1x(m)
        return v, q.permute(0, 2, 3, 1), F.silu(q)[:, 1:3], torch.clamp(q, -0.5, 0.3)

class _Elementwise(nn.Module):
    """Unary and binary elementwise ops, softmax, split, pad, select, bmm, scalar ops."""

    def forward(s, x, y):
        a = torch.maximum(x, y) - torch.minimum(x, y) / 2
        b = torch.exp(-x.abs()) + torch.log(y.abs() + 1) + torch.sqrt(y.abs() + 0.1) + torch.rsqrt(x.abs() + 1)
        c = torch.floor(x * 3) + torch.ceil(y * 3) + torch.sin(x) * torch.cos(y) + torch.tanh(x)
        d = F.gelu(a) + F.hardsigmoid(b) + F.hardtanh(c, -2, 2)
        e = torch.softmax(d, -1)
        parts = torch.split(e, [3, 5], dim=1)
        f = F.pad(parts[1], (1, 2), value=0.5)
        g = e.select(1, 2).unsqueeze(1)
        return f * g, torch.bmm(x.unsqueeze(0), y.t().unsqueeze(0)), -x, x / 3.0 - 1

def _zoo():
    torch.manual_seed(0)
    return _ConvZoo().eval(), (torch.randn(1, 4, 16, 16), torch.randn(2, 1, 6, 6))

def _elementwise():
    torch.manual_seed(0)
    return _Elementwise().eval(), (torch.randn(4, 8), torch.randn(4, 8))


class _Resample(nn.Module):
    """Bilinear upsampling (scale and size, align_corners both ways), amax over H, W, means
    over the last dim, PReLU (per channel on 4-D, one slope on 2-D)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)
        self.prelu, self.prelu1 = nn.PReLU(4), nn.PReLU()
        with torch.no_grad():
            self.prelu.weight.uniform_(0.1, 0.5)

    def forward(self, x):
        x = self.c(x)
        y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        z = F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True)
        return (y, z, torch.amax(x, (2, 3), keepdim=True), torch.amax(x, (2, 3)), x.mean(-1),
                x.mean(-1, keepdim=True), self.prelu(x), self.prelu1(x.flatten(1)))


def _resample():
    torch.manual_seed(0)
    return _Resample().eval(), (torch.randn(1, 4, 6, 6),)


class _Conv1d(nn.Module):
    """1-D convolutions (as 2-D over H = 1): BN folded, strided, depthwise."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Conv1d(8, 8, 5, stride=2, padding=2, groups=8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return (self.b(torch.relu(self.bn(self.a(x)))),)


def _conv1d():
    torch.manual_seed(0)
    return _Conv1d().eval(), (torch.randn(2, 4, 20),)


@pytest.mark.parametrize("factory", [_zoo, _elementwise, _resample, _conv1d],
                         ids=["conv_zoo", "elementwise", "resample", "conv1d"])
def test_op_zoo_whole_model_delegated(factory):
    pytest.importorskip("executorch")
    model, inputs = factory()
    with torch.no_grad():
        expected = list(model(*inputs))
    result = _lower(model, inputs)
    assert _kernel_calls(result.pte) == 0 and len(_payloads(result.pte)[1]) == 1
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "zoo executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "zoo ours")


def test_cached_flow_carries_named_data(tmp_path, prefect_api):
    """Through the Prefect stages (preprocess stores the weights as blobs, adjust reads them
    back) the .pte is the one lowering in memory gives, and it verifies."""
    from flows.lower_model import lower_model
    from tasks import stages
    from tasks.store import ArtifactStore

    stages.LIVE.clear()
    try:
        manifest = lower_model(f"{REPO / 'examples' / 'models.py'}:cnn", ["xnnpack"], store=str(tmp_path / "store"))
    finally:
        stages.LIVE.clear()
    assert manifest["targets"]["xnnpack"]["ok"]
    pte = ArtifactStore(str(tmp_path / "store")).get_named("cnn/xnnpack.pte")
    model, inputs = MODELS["cnn"]()
    assert pte == _lower(model, inputs).pte
    assert deserialize(pte).named_data


def test_activation_matmul_is_a_dynamic_fully_connected():
    """``mm`` of two runtime values (ExecuTorch's partitioner leaves it out) runs as a
    FullyConnected whose filter is a runtime value."""

    class M(nn.Module):
        def forward(self, x, y):
            return (torch.relu(x) @ torch.sigmoid(y),)

    model, inputs = M().eval(), (torch.randn(4, 8), torch.randn(8, 6))
    result = _lower(model, inputs)
    assert _kernel_calls(result.pte) == 0
    expected = list(model(*inputs))
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "mm executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "mm ours")


# --------------------------------------------------------------------------- recurrent nets


def _outside_ops(pte: bytes) -> Counter:
    plan = deserialize(pte).program.executionPlan[0]
    return Counter(plan.operators[ins.instrArgs.opIndex].name.decode() for c in plan.chains for ins in c.instructions
                   if ins.instrArgsType == lowering.pte.schema.InstructionArguments.KernelCall)


@pytest.mark.parametrize("name, steps, gates", [("lstm", 10, 4), ("gru", 10, 3)])
def test_recurrent_gate_splits_stay_outside(name, steps, gates):
    """Each cell step's gate split is one portable kernel call, not one XNNPACK slice per gate
    (ExecuTorch's cut; one delegate of 80-120 tiny slices ran 1.1-1.25x slower than it)."""
    from examples import models

    pytest.importorskip("executorch")
    model, inputs = getattr(models, name)()
    with torch.no_grad():
        expected = [model(*inputs)]
    result = _lower(model, inputs)
    _, payloads = _payloads(result.pte)
    splits_per_step = 1 if name == "lstm" else 2  # a GRU splits the input's gates and the state's
    layers = 2
    assert _outside_ops(result.pte)["aten::split_with_sizes_copy"] == layers * steps * splits_per_step
    kinds = sum((_node_kinds(p) for p in payloads), Counter())
    assert kinds["XNNSigmoid"] == layers * steps * (3 if name == "lstm" else 2)  # the gates stay delegated
    assert kinds["XNNStaticSlice"] <= 2 * layers + steps * layers + 4  # no slice per gate: time steps and states
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, f"{name} executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, f"{name} ours")


def test_only_gate_splits_are_left_out():
    """A split whose pieces go to views (attention's q/k/v) or to a non-gate op stays in XNNPACK."""
    from lowering.backends.xnnpack.recurrent import is_gate_split

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.fc(x).split(8, dim=-1)  # pieces to reshapes and a matmul: not gates
            a, b = self.fc(x).chunk(2, dim=-1)  # one piece to a sigmoid, one to a relu: not gates
            c, d = self.fc(x).chunk(2, dim=-1)  # both pieces to sigmoid / tanh through an add: gates
            return q.reshape(2, 2, 4) @ k.reshape(2, 4, 2), v, torch.sigmoid(a) * torch.relu(b), \
                torch.sigmoid(c + 1) * torch.tanh(d)

    ep = lowering.export(M().eval(), (torch.randn(2, 8),))
    splits = [n for n in ep.graph.nodes if n.target in (torch.ops.aten.split_with_sizes_copy.default,
                                                       torch.ops.aten.split_copy.Tensor)]
    assert [is_gate_split(n) for n in splits] == [False, False, True]
    result = _lower(M().eval(), (torch.randn(2, 8),))
    assert _outside_ops(result.pte)["aten::split_with_sizes_copy"] + _outside_ops(result.pte)["aten::split_copy"] == 1


def test_gelu_tanh_is_its_formula_inside_the_delegate():
    """A tanh-approximate GELU (Gemma's MLP) is delegated as x * sigmoid(x * (a + b x^2)), not
    left to the portable kernel (which cut Gemma's delegates and ran it 1.12x slower than ExecuTorch)."""
    pytest.importorskip("executorch")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.gelu(self.up(x), approximate="tanh") * 3.0)

    torch.manual_seed(0)
    model, inputs = M().eval(), (torch.randn(4, 16) * 3,)
    with torch.no_grad():
        expected = [model(*inputs)]
    result = _lower(model, inputs)
    _, (payload,) = _payloads(result.pte)
    assert _kernel_calls(result.pte) == 0
    kinds = _node_kinds(payload)
    assert "XNNGelu" not in kinds and kinds["XNNSigmoid"] == 1 and kinds["XNNSquare"] == 1, kinds
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "gelu tanh executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "gelu tanh ours")


def test_linear_on_a_3d_input_reads_and_writes_3d_without_reshapes():
    """``linear`` on ``[B, S, K]`` decomposes to view -> mm -> view; the FullyConnected takes the
    N-D input and writes the N-D output itself (as ExecuTorch lowers ``linear``): no StaticReshape.
    A reshape to other dims after it stays."""

    class Mlp3d(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 8, bias=False)

        def forward(self, x):
            return self.down(F.gelu(self.up(x))), self.up(x).reshape(4, 3, 32)

    torch.manual_seed(0)
    model, inputs = Mlp3d().eval(), (torch.randn(2, 6, 16),)
    result = _lower(model, inputs)
    _, payloads = _payloads(result.pte)
    graphs = [P.deserialize_payload(p)[0] for p in payloads]
    kinds = sum((_node_kinds(p) for p in payloads), Counter())
    assert kinds["XNNFullyConnected"] == 3, kinds
    assert kinds["XNNStaticReshape"] == 1, kinds  # [2, 6, 32] -> [4, 3, 32]: the second output's own
    for graph in graphs:
        dims = {v.xvalueUnion.idOut: list(v.xvalueUnion.dims) for v in graph.xvalues}
        fcs = [n.xnodeUnion for n in graph.xnodes if n.xnodeUnionType == fbx.NodeUnion.XNNFullyConnected]
        assert all(len(dims[fc.input1Id]) == 3 and len(dims[fc.outputId]) == 3 for fc in fcs), dims
    expected = [t.detach() for t in model(*inputs)]
    _assert_close(_run_executorch(result.pte, inputs)[0], expected, "executorch")
    _assert_close(load(result.pte).run("forward", list(inputs)), expected, "lowerflow")
