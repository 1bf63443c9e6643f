"""Issue 21, the runner contract: ExecuTorch's pip ``TextLLMRunner(pte, tokenizer.json)`` loads an
``hf:<dir>`` text-generation program lowered by lowerflow (reading its constant methods
``get_max_seq_len``, ``get_eos_ids``, ``get_bos_id``, ``use_kv_cache``, ``enable_dynamic_shape``, ...)
and generates greedily the same tokens as the checkpoint's own eager model::

    save_pretrained dir (tiny random Llama + ByteLevel BPE tokenizer.json)
        ─► load_hf(dir, "text-generation", attn=custom|standard) ─► lower(xnnpack | portable) ─► model.pte
        ─► TextLLMRunner(model.pte, tokenizer.json).generate(prompt, temperature=0)   (fresh process)
        == eager greedy loop over LlamaForCausalLM (stops at eos, as the runner does)

The tokenizer is trained on ASCII sentences only, so every token decodes to whole characters
(the runner's token callback passes each token as a Python ``str``).  Measured: the runner
prepends no bos with this tokenizer (``num_bos=1`` and a ``tokenizer_config.json`` naming ``<s>``
change nothing: 2 prompt tokens for "hello world"), so both sides start from the bare prompt ids;
the 12-token budget is cut by eos at the 8th token on both sides.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from lowering import lower  # noqa: E402
from lowering.backends.xnnpack import XnnpackPartitioner  # noqa: E402
from lowering.hf import load_hf  # noqa: E402
from lowering.verify import delegate_backend_ids  # noqa: E402

MAX_SEQ_LEN = 32
MAX_NEW_TOKENS = 12
PROMPT = "hello world"
BOS, EOS = 1, 2

#: The lowered variants the runner runs: (attn, target).
VARIANTS = [("custom", "xnnpack"), ("standard", "xnnpack"), ("custom", "portable")]

#: Run in a fresh interpreter: ExecuTorch's custom-ops library first (llama::*.out kernels;
#: loading it after lowerflow's llama op definitions aborts the process) and its quantized
#: kernels (quantized_decomposed::*.out: a program with quantized embeddings calls
#: embedding_byte / embedding_4bit), then the runner over every program given (one start-up for all); the generated pieces as JSON, one list
#: per program, or {"unavailable": why} when the runner cannot be imported.
_RUNNER = textwrap.dedent("""
    import json, sys
    try:
        import executorch.extension.llm.custom_ops.custom_ops
        import executorch.kernels.quantized
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except ImportError as exc:
        print(json.dumps({"unavailable": str(exc)}))
        sys.exit(0)
    tokenizer, prompt, max_new, ptes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    results = []
    for pte in ptes:
        pieces = []
        config = GenerationConfig(echo=False, max_new_tokens=max_new, temperature=0.0, num_bos=0)
        TextLLMRunner(pte, tokenizer).generate(prompt, config, token_callback=pieces.append)
        results.append(pieces)
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random-weight Llama save_pretrained directory with a ByteLevel BPE ``tokenizer.json``
    whose vocabulary is the model's (``<s>`` = 1 = bos, ``</s>`` = 2 = eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("runner") / "llama"
    directory.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, hello runner",
                                   "lowerflow lowers models to executorch programs"], trainer)
    assert (tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")) == (BOS, EOS)
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=BOS,
        eos_token_id=EOS))
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = BOS, EOS
    model.eval().save_pretrained(directory)
    return directory


@functools.cache
def eager_greedy(directory, prompt_ids: tuple[int, ...], max_new: int) -> list[int]:
    """Greedy decoding with the checkpoint's own model (no cache), stopping after eos."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    tokens, generated = list(prompt_ids), []
    with torch.no_grad():
        while len(generated) < max_new:
            token = int(model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax())
            tokens.append(token)
            generated.append(token)
            if token == EOS:
                break
    return generated


def run_text_llm_runner(tokenizer_json, *ptes) -> list[list[str]]:
    done = subprocess.run([sys.executable, "-c", _RUNNER, str(tokenizer_json), PROMPT, str(MAX_NEW_TOKENS),
                           *map(str, ptes)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(result, dict):
        pytest.skip(f"executorch's LLM runner is not importable: {result['unavailable']}")
    return result


@pytest.fixture(scope="module")
def runner_output(llama_dir, tmp_path_factory) -> dict[tuple[str, str], tuple[bytes, list[str]]]:
    """``{(attn, target): (.pte, the runner's pieces)}``: every variant lowered from ``hf:<dir>``,
    all run by the pip runner in one fresh interpreter."""
    root = tmp_path_factory.mktemp("runner-ptes")
    ptes = {}
    for attn, target in VARIANTS:
        hf = load_hf(str(llama_dir), "text-generation", max_seq_len=MAX_SEQ_LEN, attn=attn)
        assert hf.constants["get_eos_ids"] == [EOS] and hf.constants["get_bos_id"] == BOS
        ptes[attn, target] = lower(hf.lower_input(), partitioner=XnnpackPartitioner() if target == "xnnpack" else None).pte
    paths = []
    for (attn, target), pte in ptes.items():
        paths.append(root / f"llama-{attn}-{target}.pte")
        paths[-1].write_bytes(pte)
    pieces = run_text_llm_runner(llama_dir / "tokenizer.json", *paths)
    return {variant: (ptes[variant], out) for variant, out in zip(ptes, pieces)}


@pytest.mark.parametrize("attn, target", VARIANTS)
def test_pip_text_llm_runner_generates_the_eager_greedy_tokens(runner_output, llama_dir, attn, target):
    pte, pieces = runner_output[attn, target]
    assert bool(delegate_backend_ids(pte)) == (target == "xnnpack")  # portable: nothing delegated
    tokenizer = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    expected = eager_greedy(llama_dir, tuple(tokenizer.encode(PROMPT).ids), MAX_NEW_TOKENS)
    assert len(set(expected)) > 2  # a real sequence, not one repeated token
    assert pieces == [tokenizer.decode([token], skip_special_tokens=False) for token in expected]
