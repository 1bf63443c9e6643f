"""Real-size LLM checkpoints with random weights (seed 0) from published configs.

Each is a transformers ``save_pretrained`` directory (safetensors, fp32) written under a
temporary name beside its final place and renamed into it when complete, so a reader
never sees half a checkpoint.  Shared by bench/bench_llm_scale.py and anyone who needs
an LLM of real size without the network.

    python bench/llm_checkpoints.py DIR [smollm2 qwen llama1b]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

#: name -> (directory name, config class name, published config fields).
CHECKPOINTS: dict[str, tuple[str, str, dict]] = {
    "smollm2": ("smollm2-135m", "LlamaConfig", dict(  # HuggingFaceTB/SmolLM2-135M
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, hidden_act="silu", max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        attention_bias=False, mlp_bias=False, initializer_range=0.041666666666666664,
    )),
    "qwen": ("qwen2.5-0.5b", "Qwen2Config", dict(  # Qwen/Qwen2.5-0.5B
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151643, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        initializer_range=0.02,
    )),
    "llama1b": ("llama-3.2-1b", "LlamaConfig", dict(  # meta-llama/Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001, attention_bias=False,
        mlp_bias=False, initializer_range=0.02,
    )),
}


def checkpoint(cache: Path, name: str) -> Path:
    """The directory of checkpoint ``name`` under ``cache``, built first if absent."""
    dirname, config_class, fields = CHECKPOINTS[name]
    final = cache / dirname
    if (final / "config.json").is_file():
        return final
    import torch
    import transformers

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.", dir=cache))
    try:
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**fields)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(final)
        except OSError:  # another process placed it first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    for arg in sys.argv[2:] or list(CHECKPOINTS):
        print(checkpoint(Path(sys.argv[1]), arg))
