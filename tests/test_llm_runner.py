"""Issue 21, the runner contract: ExecuTorch's pip ``TextLLMRunner(pte, tokenizer.json)`` loads an
``hf:<dir>`` text-generation program lowered by lowerflow (reading its constant methods
``get_max_seq_len``, ``get_eos_ids``, ``get_bos_id``, ``use_kv_cache``, ``enable_dynamic_shape``, ...)
and generates greedily the same tokens as the checkpoint's own eager model::

    save_pretrained dir (tiny random Llama + ByteLevel BPE tokenizer.json)
        ─► load_hf(dir, "text-generation", attn=custom|standard) ─► lower(xnnpack) ─► model.pte
        ─► TextLLMRunner(model.pte, tokenizer.json).generate(prompt, temperature=0)   (fresh process)
        == eager greedy loop over LlamaForCausalLM (stops at eos, as the runner does)

The tokenizer is trained on ASCII sentences only, so every token decodes to whole characters
(the runner's token callback passes each token as a Python ``str``).  Measured: the runner
prepends no bos with this tokenizer (``num_bos=1`` and a ``tokenizer_config.json`` naming ``<s>``
change nothing: 2 prompt tokens for "hello world"), so both sides start from the bare prompt ids;
the 12-token budget is cut by eos at the 8th token on both sides.
"""

from __future__ import annotations

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

MAX_SEQ_LEN = 32
MAX_NEW_TOKENS = 12
PROMPT = "hello world"
BOS, EOS = 1, 2

#: Run in a fresh interpreter: ExecuTorch's custom-ops library first (llama::*.out kernels;
#: loading it after lowerflow's llama op definitions aborts the process), then the runner.
_RUNNER = textwrap.dedent("""
    import json, sys
    import executorch.extension.llm.custom_ops.custom_ops
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    pte, tokenizer, prompt, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    pieces = []
    config = GenerationConfig(echo=False, max_new_tokens=max_new, temperature=0.0, num_bos=0)
    TextLLMRunner(pte, tokenizer).generate(prompt, config, token_callback=pieces.append)
    print(json.dumps(pieces))
""")


@pytest.fixture(scope="module")
def runner_available():
    probe = subprocess.run([sys.executable, "-c", "import executorch.extension.llm.runner"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"executorch's LLM runner is not importable: {probe.stderr.strip().splitlines()[-1:]}")


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


def eager_greedy(directory, prompt_ids: list[int], max_new: int) -> list[int]:
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


def run_text_llm_runner(pte, tokenizer_json) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _RUNNER, str(pte), str(tokenizer_json), PROMPT, str(MAX_NEW_TOKENS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("attn", ["custom", "standard"])
def test_pip_text_llm_runner_generates_the_eager_greedy_tokens(runner_available, llama_dir, tmp_path, attn):
    hf = load_hf(str(llama_dir), "text-generation", max_seq_len=MAX_SEQ_LEN, attn=attn)
    assert hf.constants["get_eos_ids"] == [EOS] and hf.constants["get_bos_id"] == BOS
    pte = tmp_path / f"llama-{attn}.pte"
    pte.write_bytes(lower(hf.lower_input(), partitioner=XnnpackPartitioner()).pte)

    tokenizer = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    expected = eager_greedy(llama_dir, tokenizer.encode(PROMPT).ids, MAX_NEW_TOKENS)
    assert len(set(expected)) > 2  # a real sequence, not one repeated token
    pieces = run_text_llm_runner(pte, llama_dir / "tokenizer.json")
    assert pieces == [tokenizer.decode([token], skip_special_tokens=False) for token in expected]
