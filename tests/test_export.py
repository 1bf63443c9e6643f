"""Stage 1 (lowering.export): the fast path gives what run_decompositions() gives.

The fast path rewrites only the nodes that need it (local decomposition,
functionalized buffer mutations); the slow path is a full retrace.  For every
test model both must give the same ops, signature, meta values, numbers and
the same .pte bytes.  Programs the fast path does not handle fall back, and
stay correct.  Also: unused parameters are removed, and folding view-copies
of weights into constants (an option) keeps the .pte runnable by ExecuTorch.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from examples.models import MODELS
from lowering.errors import ExportError
from lowering.export import PATH_META, export, fold_constant_views, to_edge
from lowering.lower import is_edge_form, lower

from ._interop import assert_all_close, eager_outputs, flatten

stage1 = importlib.import_module("lowering.export")
REPO = Path(__file__).resolve().parents[1]


def _path(program) -> str:
    return program.graph_module.meta[PATH_META]


def _ops(program) -> collections.Counter:
    return collections.Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


def _metas(program) -> list:
    """(op, shape, stride, dtype) of every call's tensor value, sorted."""
    out = []
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor):
            out.append((str(node.target), tuple(val.shape), tuple(val.stride()), str(val.dtype)))
    return sorted(out)


def _signature(program) -> tuple:
    sig = program.graph_signature
    return (
        [(s.kind, s.target) for s in sig.input_specs],
        [(s.kind, s.target) for s in sig.output_specs],
    )


def _run_twice(program, inputs) -> list[torch.Tensor]:
    """Outputs of two calls (the second sees buffer updates of the first)."""
    module = program.module()
    with torch.no_grad():
        return flatten(module(*inputs)) + flatten(module(*inputs))


@pytest.fixture(scope="module")
def both_paths():
    """name -> (fast edge program, slow edge program, inputs), each from a fresh model."""
    out = {}
    for name, factory in MODELS.items():
        model, inputs = factory()
        # Folding is compared separately; here the two decomposition paths.
        fast = export(model, inputs, fast=True, fold_constants=False)
        model, inputs = factory()
        slow = export(model, inputs, fast=False, fold_constants=False)
        out[name] = (fast, slow, inputs)
    return out


# --- the fast path on every test model ------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_covers_the_test_model(both_paths, name):
    fast, slow, _ = both_paths[name]
    assert _path(fast) == "fast"
    assert _path(slow).startswith("slow")
    assert is_edge_form(fast)


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_gives_the_ops_signature_and_meta_of_run_decompositions(both_paths, name):
    fast, slow, _ = both_paths[name]
    assert _ops(fast) == _ops(slow)
    assert _signature(fast) == _signature(slow)
    assert _metas(fast) == _metas(slow)
    assert set(fast.state_dict) == set(slow.state_dict)
    assert set(fast.constants) == set(slow.constants)


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_is_numerically_identical(both_paths, name):
    fast, slow, inputs = both_paths[name]
    got, want = _run_twice(fast, inputs), _run_twice(slow, inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_all_close(got[: len(got) // 2], eager_outputs(name))


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_gives_the_same_pte_bytes(both_paths, name):
    fast, slow, _ = both_paths[name]
    assert lower(fast).pte == lower(slow).pte


def test_every_node_has_a_fake_value(both_paths):
    from torch._subclasses.fake_tensor import FakeTensor

    for name, (fast, _, _) in both_paths.items():
        for node in fast.graph.nodes:
            if node.op == "output":
                continue
            vals = flatten(node.meta.get("val"))
            assert vals and all(isinstance(v, FakeTensor) for v in vals), (name, node.name)


def test_buffer_mutation_is_a_buffer_mutation_output(both_paths):
    fast, _, _ = both_paths["buffer_mutation"]
    kinds = [(s.kind, s.target) for s in fast.graph_signature.output_specs]
    assert kinds == [(OutputKind.BUFFER_MUTATION, "acc"), (OutputKind.USER_OUTPUT, None)]
    assert not any(n.target._schema.is_mutable for n in fast.graph.nodes if n.op == "call_function")


def test_to_edge_leaves_its_input_alone():
    model, inputs = MODELS["buffer_mutation"]()
    raw = torch.export.export(model, inputs, strict=False)
    before = str(raw.graph), str(raw.graph_signature)
    edge = to_edge(raw)
    assert _path(edge) == "fast"
    assert (str(raw.graph), str(raw.graph_signature)) == before
    assert any(n.target == torch.ops.aten.add_.Tensor for n in raw.graph.nodes)


# --- more shapes of programs the fast path must get right -----------------------------------


class _Fn(torch.nn.Module):
    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            setattr(self, name, module)

    def forward(self, *args):
        return self.fn(self, *args)


class _TwoBuffers(torch.nn.Module):
    """Two updates of one buffer, and a buffer overwritten by copy_ (never read before)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(16))
        self.register_buffer("c", torch.ones(16))

    def forward(self, x):
        self.b.add_(x.sum(0))
        y = x * self.b
        self.b.mul_(0.5)
        self.c.copy_(y[0])
        return y + self.b + self.c


_X2, _X4 = torch.randn(4, 16), torch.randn(2, 3, 8, 8)
F = torch.nn.functional
_ZOO = {
    "dtype-casts": (_Fn(lambda s, x: (x.half().float() * 2, x.int() + 1, x.double().sum())), (_X2,)),
    "preserved-upsample": (_Fn(lambda s, x: F.interpolate(x, scale_factor=2, mode="bilinear")), (_X4,)),
    "slicing-views": (
        _Fn(lambda s, x: torch.cat([x[:, 1:], x[:, :1]], 1).reshape(-1)[::2].unsqueeze(0).repeat(2, 1)),
        (_X2,),
    ),
    "transpose-contiguous": (_Fn(lambda s, x: x.t().contiguous().view(-1) + x.transpose(0, 1).flatten()), (_X2,)),
    "norms-activations": (_Fn(lambda s, x: F.hardswish(s.gn(x)) + F.gelu(x), gn=torch.nn.GroupNorm(3, 3)), (_X4,)),
    "inplace-chain": (_Fn(lambda s, x: s.fc(x).relu_().mul_(2).add_(1).sigmoid(), fc=torch.nn.Linear(16, 16)), (_X2,)),
    "two-buffers": (_TwoBuffers(), (_X2,)),
    "gru-input-named-input": (torch.nn.GRU(8, 8, batch_first=True).eval(), (torch.randn(2, 4, 8),)),
    "tensor-constant-detach": (_Fn(lambda s, x: x * torch.tensor(3.0) + x.detach() + x.clone().detach_()), (_X2,)),
    "multihead-attention": (torch.nn.MultiheadAttention(16, 2, batch_first=True).eval(), (torch.randn(2, 5, 16),) * 3),
}


@pytest.mark.parametrize("case", list(_ZOO))
def test_fast_path_matches_run_decompositions_on_more_programs(case):
    torch.manual_seed(0)
    model, inputs = _ZOO[case]
    fast = export(copy.deepcopy(model), inputs)
    slow = export(copy.deepcopy(model), inputs, fast=False)
    assert _path(fast) == "fast"
    assert _ops(fast) == _ops(slow)
    assert _signature(fast) == _signature(slow)
    assert _metas(fast) == _metas(slow)
    for a, b in zip(_run_twice(fast, inputs), _run_twice(slow, inputs)):
        assert torch.equal(a, b)
    assert lower(fast).pte == lower(slow).pte


# --- fallback to run_decompositions ---------------------------------------------------------


class _InputMutation(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class _ViewMutation(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 3))

    def forward(self, x):
        self.buf[0].add_(x.sum(0))
        return x + self.buf[0]


class _Cond(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


class _InPlaceRelu(torch.nn.Module):
    """An in-place op on an intermediate (nn.ReLU(inplace=True)): the fast path handles it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.fc(x)
        self.act(y)
        return y + 1


class _TrainingBatchNorm(torch.nn.Module):
    """BatchNorm in training mode: running statistics are mutated buffers."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(5)

    def forward(self, x):
        return self.bn(x) * 2


@pytest.mark.parametrize(
    "model, inputs, path",
    [
        (_InputMutation(), (torch.randn(2, 3),), "slow: "),
        (_ViewMutation(), (torch.randn(2, 3),), "slow: "),
        (_Cond(), (torch.randn(3),), "slow: "),
        (_InPlaceRelu(), (torch.randn(2, 6),), "fast"),
        (_TrainingBatchNorm().train(), (torch.randn(4, 5),), ""),
    ],
    ids=["user-input-mutation", "mutation-through-view", "cond", "inplace-relu", "training-batchnorm"],
)
def test_fast_path_falls_back_when_it_must_and_stays_correct(model, inputs, path):
    # Each program gets its own copy: programs share buffers with their model.
    slow = export(copy.deepcopy(model), tuple(t.clone() for t in inputs), fast=False)
    program = export(copy.deepcopy(model), tuple(t.clone() for t in inputs))
    assert _path(program).startswith(path)
    assert is_edge_form(program) or _path(program).startswith("slow")
    assert _ops(program) == _ops(slow)
    assert _signature(program) == _signature(slow)
    got = _run_twice(program, tuple(t.clone() for t in inputs))
    want = _run_twice(slow, tuple(t.clone() for t in inputs))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _symbolic_metas(program) -> list:
    """:func:`_metas` with sizes as text (symbols of two exports are not comparable)."""
    return [(op, tuple(map(str, shape)), tuple(map(str, stride)), dtype)
            for op, shape, stride, dtype in _metas(program)]


def test_dynamic_shapes_take_the_fast_path():
    model, inputs = MODELS["mlp"]()
    batch = torch.export.Dim("batch", min=2, max=16)
    program = export(copy.deepcopy(model), inputs, dynamic_shapes=({0: batch},))
    slow = export(copy.deepcopy(model), inputs, dynamic_shapes=({0: batch},), fast=False)
    assert _path(program) == "fast"
    assert _ops(program) == _ops(slow)
    assert _signature(program) == _signature(slow)
    assert _symbolic_metas(program) == _symbolic_metas(slow)
    assert program.range_constraints and "s" in str(program.graph_module.code)  # still symbolic
    torch.testing.assert_close(program.module()(torch.ones(5, 64)), model(torch.ones(5, 64)))
    assert lower(program).pte == lower(slow).pte


class _DynamicCacheView(torch.nn.Module):
    """A buffer written in place at dynamic positions, then read through a view."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(16, 4))

    def forward(self, x, pos):
        written = self.cache.index_copy_(0, pos, x)
        return written.transpose(0, 1).sum(1) + x.sum(0)


def test_dynamic_shapes_and_a_view_of_a_written_buffer_fall_back():
    # With symbolic shapes, run_decompositions moves such a view to where it is read;
    # the fast path would keep it in place (same numbers, another node order).
    seq = torch.export.Dim("seq", min=1, max=15)
    inputs = (torch.randn(3, 4), torch.tensor([0, 1, 2]))
    shapes = ({0: seq}, {0: seq})
    program = export(_DynamicCacheView(), inputs, dynamic_shapes=shapes)
    slow = export(_DynamicCacheView(), inputs, dynamic_shapes=shapes, fast=False)
    assert _path(program).startswith("slow: symbolic shapes and a view of 'index_copy_'")
    assert lower(program).pte == lower(slow).pte


def test_text_generation_decoder_takes_the_fast_path_with_the_same_bytes():
    """An hf decoder with ExecuTorch's custom ops (symbolic sequence length, KV caches
    written by ``llama::update_cache``, made ``auto_functionalized_v2`` as functionalization
    does): the same program as run_decompositions gives, without retracing it."""
    transformers = pytest.importorskip("transformers")
    from lowering.backends.xnnpack import XnnpackPartitioner
    from lowering.llm import decoder_example, decoder_module

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    example, shapes = decoder_example(24)
    programs = {fast: export(decoder_module(hf, max_seq_len=24, attn="custom"), example, dynamic_shapes=shapes,
                             fast=fast) for fast in (True, False)}
    fast, slow = programs[True], programs[False]
    assert _path(fast) == "fast"
    assert _ops(fast) == _ops(slow)
    assert _ops(fast)["auto_functionalized_v2"] == 4  # 2 layers x (keys, values)
    assert _signature(fast) == _signature(slow)
    assert _symbolic_metas(fast) == _symbolic_metas(slow)
    assert [str(n.target) for n in fast.graph.nodes] == [str(n.target) for n in slow.graph.nodes]
    for partitioner in (None, XnnpackPartitioner()):
        assert lower(fast, partitioner=partitioner).pte == lower(slow, partitioner=partitioner).pte


def test_fast_path_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(stage1, "FAST_PATH", False)
    model, inputs = MODELS["mlp"]()
    assert _path(export(model, inputs)) == "slow: fast path disabled"


def test_bad_input_names_the_model():
    with pytest.raises(ExportError, match="model 'MLP': example_inputs must be a tuple"):
        export(MODELS["mlp"]()[0], torch.randn(4, 64))
    with pytest.raises(ExportError, match="model 'mine': expected a torch.nn.Module"):
        export("not a model", (torch.randn(1),), name="mine")
    with pytest.raises(ExportError, match=r"model 'MLP': the model fails on its example inputs \(\(4, 3\) float32\) "
                                          r"in eager mode too: RuntimeError: mat1 and mat2 shapes"):
        export(MODELS["mlp"]()[0], (torch.randn(4, 3),))

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(ExportError, match="model 'Branchy': the model branches on tensor values.*torch.cond"):
        export(Branchy(), (torch.ones(3),))


# --- unused parameters ----------------------------------------------------------------------


def test_unused_buffers_and_parameters_are_removed(both_paths):
    fast, slow, _ = both_paths["cnn"]
    for program in (fast, slow):
        targets = {s.target for s in program.graph_signature.input_specs}
        assert "bn1.num_batches_tracked" not in targets
        assert "bn1.num_batches_tracked" not in program.state_dict
        assert {"bn1.running_mean", "bn1.running_var"} <= targets

    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(3, 3)
            self.unused = torch.nn.Linear(3, 3)
            self.register_buffer("idle", torch.ones(2))
            self.const = torch.ones(3)

        def forward(self, x):
            return self.used(x) + self.const

    program = export(Unused(), (torch.randn(2, 3),), fold_constants=False)
    assert set(program.state_dict) == {"used.weight", "used.bias"}
    assert set(program.constants) == {"const"}
    assert [s.kind for s in program.graph_signature.input_specs] == [
        InputKind.PARAMETER,
        InputKind.PARAMETER,
        InputKind.CONSTANT_TENSOR,
        InputKind.USER_INPUT,
    ]


# --- folding view-copies of weights into constants ------------------------------------------


@pytest.fixture(scope="module")
def folded():
    """name -> (folded edge program, LowerResult, unfolded LowerResult)."""
    out = {}
    for name, factory in MODELS.items():
        model, inputs = factory()
        program = export(model, inputs, fold_constants=True)
        model, inputs = factory()
        out[name] = (program, lower(program), lower(export(model, inputs, fold_constants=False)))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_folded_pte_runs_in_executorch_and_matches_eager(folded, name):
    pytest.importorskip("executorch.runtime")
    from ._interop import run_in_executorch

    _, inputs = MODELS[name]()
    program, result, _ = folded[name]
    [outputs] = run_in_executorch(result.pte, inputs)
    assert_all_close(outputs, eager_outputs(name))
    assert _path(program) == "fast" and is_edge_form(program)


def test_folding_removes_weight_transposes_from_the_arena(folded):
    for name, (program, result, unfolded) in folded.items():
        assert result.arena_bytes <= unfolded.arena_bytes, name
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
        kind = {n: s.kind for n, s in zip(placeholders, program.graph_signature.input_specs)}
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.permute_copy.default:
                assert kind.get(node.args[0]) not in (InputKind.PARAMETER, InputKind.CONSTANT_TENSOR), (name, node)
    program, result, unfolded = folded["mlp"]
    assert unfolded.arena_bytes == 270_336 and result.arena_bytes == 8_192
    assert set(program.state_dict) == {"fc1.bias", "fc2.bias", "fc3.bias"}
    for fc in ("fc1", "fc2", "fc3"):
        weight = MODELS["mlp"]()[0].get_submodule(fc).weight.detach()
        folded_weight = program.constants[f"{fc}.weight#t"]  # named after the weight (folding.folded_name)
        assert torch.equal(folded_weight, weight.t()) and folded_weight.is_contiguous()


def test_same_view_of_the_same_weight_is_folded_once(folded):
    program, _, _ = folded["lstm"]
    # Two layers, each an input and a hidden weight, plus the final linear.
    assert len(program.constants) == 5
    assert not program.state_dict.keys() & {f"lstm.weight_{k}_l{i}" for k in ("ih", "hh") for i in (0, 1)}


def test_folding_skips_outputs_and_growing_views():
    class ReturnsWeightT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))
            self.b = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return self.w.t(), x + self.b.expand(2, 4)

    program = export(ReturnsWeightT(), (torch.randn(2, 4),), fold_constants=False)
    assert fold_constant_views(program) == 0


_FOLD_SCRIPT = textwrap.dedent(
    """
    import hashlib
    from examples.models import MODELS
    from lowering.export import export
    from lowering.lower import lower
    for name in ("mlp", "buffer_mutation", "lstm"):
        model, inputs = MODELS[name]()
        print(name, hashlib.sha256(lower(export(model, inputs, fold_constants=True)).pte).hexdigest())
    """
)


def test_folded_pte_is_byte_identical_across_processes(folded):
    runs = [
        subprocess.run([sys.executable, "-c", _FOLD_SCRIPT], cwd=REPO, capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    in_process = {name: hashlib.sha256(folded[name][1].pte).hexdigest() for name in ("mlp", "buffer_mutation", "lstm")}
    assert dict(line.split() for line in runs[0].splitlines()) == in_process


def test_a_permute_undone_by_the_next_one_goes():
    """``transpose(1, 2)`` then ``transpose(1, 2)`` again is the value itself (ExecuTorch's LLM
    export removes such pairs too); a pair whose result is an output stays."""

    class Pairs(torch.nn.Module):
        def forward(self, x):
            t = x.transpose(1, 2)
            back = t.transpose(1, 2)  # undoes t: the pair goes
            other = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)  # undoes too, but is an output
            return back * 2, other, t.permute(0, 2, 1, 3).contiguous() + 1

    x = torch.randn(1, 4, 3, 8)
    program = to_edge(torch.export.export(Pairs(), (x,)))
    permutes = [n for n in program.graph.nodes if n.target is torch.ops.aten.permute_copy.default]
    # left: t's (read by the third output's pair, which is undone: its add reads x) -> gone too;
    # the output pair's two permutes stay
    assert len(permutes) == 2, program.graph
    mul = next(n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert mul.args[0].op == "placeholder"
    assert_all_close(flatten(program.module()(x)), flatten(Pairs()(x)))
