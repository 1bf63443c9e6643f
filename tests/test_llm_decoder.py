"""lowering.llm: the text-generation decoder with ExecuTorch's llama::custom_sdpa / update_cache.

Tiny random-weight transformers models (Llama, Qwen2, GPT-2): the wrapper equals HF eager
without a cache (prefill of several lengths, then decode steps), lowered programs equal it
in lowerflow's executor and in ExecuTorch's runtime.  ExecuTorch's custom-ops library aborts
a process in which lowerflow already defined the llama ops, so ExecuTorch runs in a fresh
subprocess that loads its library first (tests/tools-free: the script is inline).
Qwen2, GPT-2, Phi3 and Gemma2 programs on ExecuTorch's runtime: tests/test_hf_families.py.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lowering  # noqa: E402
from lowering.backends.xnnpack import XnnpackPartitioner  # noqa: E402
from lowering.llm import decoder_example, decoder_module  # noqa: E402
from lowering.llm.custom_ops import custom_sdpa_math, ensure_llama_ops  # noqa: E402
from lowering.pte import deserialize  # noqa: E402
from lowering.runtime import load  # noqa: E402

MAX_SEQ_LEN = 24
VOCAB = 256
#: (input_ids slice, cache positions) per call: prefills of 5 and 3 tokens around decode steps
STEPS = [(0, 5), (5, 6), (6, 9), (9, 10), (10, 11)]


@functools.lru_cache(maxsize=None)
def hf_model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=64)
        return transformers.LlamaForCausalLM(config).eval()
    if family == "qwen2":
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=64)
        return transformers.Qwen2ForCausalLM(config).eval()
    if family == "phi3":
        config = transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1)
        return transformers.Phi3ForCausalLM(config).eval()
    if family == "gemma2":
        config = transformers.Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           vocab_size=VOCAB, max_position_embeddings=64, sliding_window=MAX_SEQ_LEN,
                                           attn_logit_softcapping=None, final_logit_softcapping=None)
        return transformers.Gemma2ForCausalLM(config).eval()
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, STEPS[-1][1]), generator=torch.Generator().manual_seed(1))


def step_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = tokens()
    return [(ids[:, a:b], torch.arange(a, b)) for a, b in STEPS]


@functools.lru_cache(maxsize=None)
def reference(family: str) -> torch.Tensor:
    """HF eager logits of the whole sequence, no cache."""
    with torch.no_grad():
        return hf_model(family)(tokens()).logits


def run_eager(module) -> torch.Tensor:
    with torch.no_grad():
        outs = [module(ids, pos) for ids, pos in step_inputs()]
    return torch.cat(outs, 1)


@functools.lru_cache(maxsize=None)
def lowered(family: str, attn: str, target: str, last: bool = False) -> bytes:
    module = decoder_module(hf_model(family), max_seq_len=MAX_SEQ_LEN, attn=attn, last_token_logits=last)
    example, dynamic_shapes = decoder_example(MAX_SEQ_LEN)
    partitioner = XnnpackPartitioner() if target == "xnnpack" else None
    return lowering.lower(module, example, dynamic_shapes=dynamic_shapes, partitioner=partitioner).pte


def run_ours(pte: bytes) -> torch.Tensor:
    program = load(pte)
    return torch.cat([program.run("forward", [ids, pos])[0] for ids, pos in step_inputs()], 1)


_EXECUTORCH_SCRIPT = textwrap.dedent("""
    import sys
    import executorch.extension.llm.custom_ops.custom_ops  # first: defines llama::* and their kernels
    import torch
    from executorch.runtime import Runtime
    pte = open(sys.argv[1], "rb").read()
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    steps = torch.load(sys.argv[2])
    torch.save([method.execute([ids, pos])[0] for ids, pos in steps], sys.argv[3])
""")


def run_executorch(pte: bytes, tmp_path) -> torch.Tensor:
    pytest.importorskip("executorch")
    pte_path, steps_path, out_path = tmp_path / "p.pte", tmp_path / "steps.pt", tmp_path / "out.pt"
    pte_path.write_bytes(pte)
    torch.save(step_inputs(), steps_path)
    done = subprocess.run([sys.executable, "-c", _EXECUTORCH_SCRIPT, str(pte_path), str(steps_path), str(out_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.cat(torch.load(out_path), 1)


# --------------------------------------------------------------------------- the ops


def test_custom_sdpa_math_is_causal_gqa_attention_over_the_cache_prefix():
    torch.manual_seed(0)
    q = torch.randn(1, 3, 4, 8)                       # positions 5, 6, 7
    cache_k, cache_v = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    got = custom_sdpa_math(q, cache_k, cache_v, 5, is_causal=True)
    k = cache_k[:, :8].transpose(1, 2).repeat_interleave(2, dim=1)
    v = cache_v[:, :8].transpose(1, 2).repeat_interleave(2, dim=1)
    mask = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    torch.testing.assert_close(got, want.transpose(1, 2))


def test_update_cache_writes_in_place_at_start_pos():
    ensure_llama_ops()
    cache = torch.zeros(1, 6, 2, 3)
    value = torch.ones(1, 2, 2, 3)
    torch.ops.llama.update_cache(value, cache, 3)
    assert cache[:, 3:5].eq(1).all() and cache[:, :3].eq(0).all() and cache[:, 5:].eq(0).all()


def test_executorch_library_loaded_first_keeps_its_definitions():
    """The contract's order: ExecuTorch's library first, then lowerflow finds the ops defined."""
    pytest.importorskip("executorch")
    script = textwrap.dedent("""
        import executorch.extension.llm.custom_ops.custom_ops
        import torch
        from lowering.llm.custom_ops import ensure_llama_ops
        before = str(torch.ops.llama.update_cache.out._schema)
        ensure_llama_ops()
        assert str(torch.ops.llama.update_cache.out._schema) == before
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# --------------------------------------------------------------------------- eager


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "phi3", "gemma2"])
@pytest.mark.parametrize("attn", ["custom", "standard"])
def test_decoder_equals_hf_without_cache(family, attn):
    module = decoder_module(hf_model(family), max_seq_len=MAX_SEQ_LEN, attn=attn)
    torch.testing.assert_close(run_eager(module), reference(family), atol=1e-5, rtol=1e-4)
    assert {f"key_cache_{i}" for i in range(2)} <= {name for name, _ in module.named_buffers()}


def test_last_token_logits_are_the_last_row():
    module = decoder_module(hf_model("llama"), max_seq_len=MAX_SEQ_LEN, last_token_logits=True)
    ids, pos = step_inputs()[0]
    with torch.no_grad():
        logits = module(ids, pos)
    assert logits.shape == (1, 1, VOCAB)
    torch.testing.assert_close(logits[0, 0], reference("llama")[0, pos[-1]], atol=1e-5, rtol=1e-4)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="attn must be one of"):
        decoder_module(hf_model("llama"), max_seq_len=MAX_SEQ_LEN, attn="flash")
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder_module(hf_model("llama"), max_seq_len=1)


# --------------------------------------------------------------------------- lowered


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_custom_program_runs_in_lowerflow_and_executorch(target, tmp_path):
    pte = lowered("llama", "custom", target)
    torch.testing.assert_close(run_ours(pte), reference("llama"), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(run_executorch(pte, tmp_path), reference("llama"), atol=1e-5, rtol=1e-4)


def test_custom_program_calls_the_stock_kernels_and_writes_caches_in_place():
    program = deserialize(lowered("llama", "custom", "xnnpack")).program
    [plan] = program.executionPlan
    operators = {(op.name.decode(), op.overload.decode()) for op in plan.operators}
    assert {("llama::update_cache", "out"), ("llama::custom_sdpa", "out"), ("aten::_local_scalar_dense", "")} <= operators
    assert ("aten::copy_", "") not in operators  # no write-back of the caches


def test_standard_program_runs_in_lowerflow_and_executorch(tmp_path):
    pte = lowered("llama", "standard", "xnnpack")
    torch.testing.assert_close(run_ours(pte), reference("llama"), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(run_executorch(pte, tmp_path), reference("llama"), atol=1e-5, rtol=1e-4)


def test_last_token_program_outputs_one_row(tmp_path):
    pte = lowered("llama", "custom", "xnnpack", last=True)
    program = load(pte)
    for (ids, pos), (a, b) in zip(step_inputs(), STEPS):
        [logits] = program.run("forward", [ids, pos])
        assert logits.shape == (1, 1, VOCAB)
        torch.testing.assert_close(logits[0, 0], reference("llama")[0, b - 1], atol=1e-5, rtol=1e-4)


def _cache_tensors(pte: bytes) -> tuple[list, list[bytes]]:
    """The planned tensors shaped like a KV cache ([1, MAX_SEQ_LEN, kv heads, head dim]) and the mutable data."""
    data = deserialize(pte)
    [plan] = data.program.executionPlan
    tensors = [v.val for v in plan.values if getattr(v.val, "allocationInfo", None) is not None
               and list(v.val.sizes) == [1, MAX_SEQ_LEN, 2, 16]]
    return tensors, data.mutable_data


def test_custom_program_stores_no_initial_cache_bytes():
    # The caches are written (update_cache) before custom_sdpa reads them: no initial value stored,
    # as ExecuTorch stores none; test_custom_program_runs_in_lowerflow_and_executorch runs such programs.
    caches, mutable_data = _cache_tensors(lowered("llama", "custom", "xnnpack"))
    assert len(caches) == 4 and all(t.dataBufferIdx == 0 for t in caches)
    assert not mutable_data
    # The standard attention reads the whole cache through a mask: its zeros stay in the program,
    # stored once for the four equal caches (each buffer gets its own copy at load).
    data = deserialize(lowered("llama", "standard", "xnnpack"))
    [plan] = data.program.executionPlan
    caches = [v.val for v in plan.values if getattr(v.val, "allocationInfo", None) is not None
              and list(v.val.sizes) == [1, 2, MAX_SEQ_LEN, 16]  # transformers' static cache layout
              and v.val.dataBufferIdx != 0]  # an initial value: the caches, not activations of that shape
    assert len(caches) == 4 and len({t.dataBufferIdx for t in caches}) == 1
    zeros = bytes(data.mutable_data[caches[0].dataBufferIdx])
    assert len(zeros) >= MAX_SEQ_LEN * 2 * 16 * 4 and not any(zeros)  # one cache's fp32 zeros


def _plan(data, name: str):
    return next(p for p in data.program.executionPlan if p.name in (name, name.encode()))


class _PeekCache(torch.nn.Module):
    """A method that reads ``key_cache_0`` before any call of it writes the cache."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("key_cache_0", cache.clone())

    def forward(self, x):
        return self.key_cache_0.sum() + x


def test_a_runner_program_of_several_methods_stores_no_initial_cache_bytes(tmp_path):
    # The LLM runner's program: forward and constant methods (as hf: text-generation lowers it).
    # Its caches live in the state arena (mem_id 2) of a program of several methods, and still
    # need no stored zeros: forward writes them before it reads them, and no other method reads them.
    module = decoder_module(hf_model("llama"), max_seq_len=MAX_SEQ_LEN)
    example, dynamic_shapes = decoder_example(MAX_SEQ_LEN)
    methods = {"forward": (module, example, dynamic_shapes), "get_max_seq_len": MAX_SEQ_LEN, "use_kv_cache": True}
    result = lowering.lower_methods(methods, partitioner=XnnpackPartitioner())
    data = deserialize(result.pte)
    plan = _plan(data, "forward")
    caches = [v.val for v in plan.values if getattr(v.val, "allocationInfo", None) is not None
              and list(v.val.sizes) == [1, MAX_SEQ_LEN, 2, 16]]
    assert len(caches) == 4 and {t.allocationInfo.memoryId for t in caches} == {2}
    assert all(t.dataBufferIdx == 0 for t in caches) and not data.mutable_data
    torch.testing.assert_close(run_executorch(result.pte, tmp_path), run_eager(module), atol=1e-5, rtol=1e-4)
    # Another method reading a cache first (shared state): that cache's zeros are stored again.
    peek = _PeekCache(module.key_cache_0)
    shared = lowering.lower_methods({**methods, "peek": (peek, (torch.ones(()),), None)},
                                    partitioner=XnnpackPartitioner(), share_mutable_buffers=True)
    data = deserialize(shared.pte)
    plan = _plan(data, "forward")
    caches = [v.val for v in plan.values if getattr(v.val, "allocationInfo", None) is not None
              and list(v.val.sizes) == [1, MAX_SEQ_LEN, 2, 16] and v.val.dataBufferIdx != 0]
    assert len(caches) == 1  # key_cache_0 (as eager left it above); the three others still store nothing
    assert bytes(data.mutable_data[caches[0].dataBufferIdx]) == peek.key_cache_0.numpy().tobytes()
