"""Issue 21: ``hf:`` text-generation beyond Llama.  Random-weight ``save_pretrained`` Qwen2
(q/k/v biases), GPT-2 (learned positions, Conv1D, fused c_attn), Phi3 (fused qkv_proj and
gate_up_proj), Gemma2 (embedding scale, attention and final logit soft-capping, here
small enough to matter, and a sliding window on every other layer), Mistral (a sliding
window on every layer) and Gemma3 (q/k norms, two sliding layers then a full one; every
window shorter than the calls' sequences) are lowered by ``hf:<dir>`` with the default custom attention for
xnnpack, through the library and (Gemma2) the flow, and run on ExecuTorch's runtime equal to
eager transformers without a cache::

    save_pretrained dir ─► load_hf(dir, "text-generation") ─► lower(xnnpack) ─► .pte
    calls:  prefill 5 ─► decode x3 ─► prefill 3 (cache rewound, other tokens) ─► decode x3
    logits of each call == AutoModelForCausalLM(dir)(all tokens so far, use_cache=False)

All families' programs run in ONE fresh interpreter (ExecuTorch's custom-ops library is
loaded before anything defines lowerflow's llama ops: the other order aborts the process),
via :func:`lowering.verify_executorch.run_programs_in_fresh_interpreter`.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("executorch.runtime")

from lowering import lower  # noqa: E402
from lowering.backends.xnnpack import XnnpackPartitioner  # noqa: E402
from lowering.hf import load_hf  # noqa: E402
from lowering.runtime import load  # noqa: E402
from lowering.verify_executorch import program_operators, run_programs_in_fresh_interpreter  # noqa: E402

MAX_SEQ_LEN = 32
VOCAB = 256
FAMILIES = ["qwen2", "gpt2", "phi3", "gemma2", "mistral", "gemma3"]
#: The sliding window of Mistral, Gemma2 and Gemma3: shorter than the sequences (8), so it matters.
WINDOW = 4
#: (sequence, start, end) per call: a prefill of 5 and 3 decode steps, then over another
#: sequence a prefill of 3 (the cache rewound) and 3 decode steps.
CALLS = [("a", 0, 5), ("a", 5, 6), ("a", 6, 7), ("a", 7, 8), ("b", 0, 3), ("b", 3, 4), ("b", 4, 5), ("b", 5, 6)]
SEQUENCES = {name: torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))
             for seed, name in enumerate("ab")}


def tiny_model(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0))
    if family == "gemma2":  # caps small enough that dropping them would change the logits
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=0.5,
            final_logit_softcapping=3.0, initializer_range=0.1))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=WINDOW))
    if family == "gemma3":  # q/k norms; two sliding layers, then a full one
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW, pad_token_id=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        tiny_model(family).eval().save_pretrained(dirs[family])
    return dirs


@functools.cache
def _eager_logits(directory: str) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return {name: model(input_ids=ids, use_cache=False).logits for name, ids in SEQUENCES.items()}


def expected(directory) -> list[torch.Tensor]:
    """Each call's logits from the checkpoint's own model over the whole sequence, no cache."""
    logits = _eager_logits(str(directory))
    return [logits[name][:, a:b] for name, a, b in CALLS]


def call_inputs() -> list[tuple[str, list[torch.Tensor]]]:
    return [("forward", [SEQUENCES[name][:, a:b], torch.arange(a, b)]) for name, a, b in CALLS]


@pytest.fixture(scope="module")
def programs(family_dirs) -> dict[str, bytes]:
    """``{family: .pte}``: ``hf:<dir>``, text-generation, default (custom) attention, xnnpack."""
    out = {}
    for family, directory in family_dirs.items():
        hf = load_hf(str(directory), "text-generation", max_seq_len=MAX_SEQ_LEN)
        assert hf.options["attn"] == "custom" and hf.constants["get_vocab_size"] == VOCAB
        out[family] = lower(hf.lower_input(), partitioner=XnnpackPartitioner()).pte
    return out


@pytest.fixture(scope="module")
def executorch_outputs(programs) -> dict[str, list[torch.Tensor]]:
    """Every family's calls on ExecuTorch's runtime, all in one fresh interpreter."""
    jobs = [(programs[f], ["forward", "get_max_seq_len", "use_sdpa_with_kv_cache"],
             call_inputs() + [("get_max_seq_len", []), ("use_sdpa_with_kv_cache", [])]) for f in FAMILIES]
    results = run_programs_in_fresh_interpreter(jobs, {"llm"})
    return {family: result if isinstance(result, Exception) else [outputs[0] for outputs in result]
            for family, result in zip(FAMILIES, results)}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_runs_prefill_and_decode_on_executorch_equal_to_eager(family, family_dirs, programs,
                                                                     executorch_outputs):
    operators = program_operators(programs[family])
    assert "llama::update_cache.out" in operators  # the KV caches written in place
    # Gemma2's soft-capped scores are attention in aten ops (custom_sdpa has no cap)
    assert ("llama::custom_sdpa.out" in operators) == (family != "gemma2")
    assert not isinstance(executorch_outputs[family], Exception), executorch_outputs[family]
    *logits, max_seq_len, sdpa_with_kv_cache = executorch_outputs[family]
    assert (max_seq_len, sdpa_with_kv_cache) == (MAX_SEQ_LEN, True)
    ours = load(programs[family])
    for call, (inputs, want, got) in enumerate(zip(call_inputs(), expected(family_dirs[family]), logits)):
        assert got.shape == want.shape == (1, CALLS[call][2] - CALLS[call][1], VOCAB), (family, call)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family} call {call}: {m}")
        torch.testing.assert_close(ours.run("forward", inputs[1])[0], want, atol=1e-4, rtol=1e-4)


def test_gemma2_soft_capping_matters(family_dirs):
    """Without either cap the tiny Gemma2 gives other logits: the equality above tests both."""
    capped = expected(family_dirs["gemma2"])[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(family_dirs["gemma2"])).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        no_attention_cap = model(input_ids=SEQUENCES["a"][:, :5], use_cache=False).logits
        model.config.final_logit_softcapping = None
        no_caps = model(input_ids=SEQUENCES["a"][:, :5], use_cache=False).logits
    assert (no_attention_cap - capped).abs().max() > 0.01
    assert (no_caps - no_attention_cap).abs().max() > 0.1


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_the_sliding_window_matters(family, family_dirs):
    """Without its window the model gives other logits once a sequence is longer than the
    window: the equality above tests the windowed mask (custom_sdpa's attn_mask, or Gemma2's
    aten attention)."""
    windowed = expected(family_dirs[family])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(family_dirs[family])).eval()
    model.config.sliding_window = MAX_SEQ_LEN
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = MAX_SEQ_LEN
    with torch.no_grad():
        full = model(input_ids=SEQUENCES["a"], use_cache=False).logits
    assert torch.allclose(full[:, :WINDOW], windowed[0][:, :WINDOW], atol=1e-5)  # within the window: equal
    assert (full[:, 5:8] - torch.cat(windowed[1:4], dim=1)).abs().max() > 0.01


def test_lowerflow_lower_hf_gemma2_writes_the_library_program(cli, prefect_api, family_dirs, programs, tmp_path):
    """The flow (``lowerflow lower hf:DIR``) verifies forward on ExecuTorch's runtime and writes
    byte for byte the library's program, which the test above ran."""
    code, out, errors = cli("lower", f"hf:{family_dirs['gemma2']}", "--task", "text-generation",
                            "--max-seq-len", MAX_SEQ_LEN, "-t", "xnnpack", "--store", tmp_path / "store",
                            "-o", tmp_path / "gemma2.pte")
    assert code == 0, (out, errors)
    assert (tmp_path / "gemma2.pte").read_bytes() == programs["gemma2"]
    report = json.loads((tmp_path / "store" / "outputs" / "gemma2" / "manifest.json").read_text())
    checks = report["targets"]["xnnpack"]["verify"]["checks"]
    assert report["targets"]["xnnpack"]["verify"]["ok"] is True, checks
    assert any(c["runtime"] == "executorch" and c["ok"] for c in checks), checks
