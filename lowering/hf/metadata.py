"""The constant methods an hf: program carries (ExecuTorch's ``constant_methods``).

What ExecuTorch's LLM runner reads (``extension/llm/runner``: ``get_max_seq_len``
is required; ``get_max_context_len``, ``use_kv_cache``, ``use_sdpa_with_kv_cache``,
``enable_dynamic_shape``, ``get_eos_ids`` (plural: a list), ``get_bos_id``,
``get_vocab_size``) and what optimum-executorch writes besides (``get_dtype``,
``get_n_layers``, ``get_max_batch_size``, ...).  ``None`` values are left out, as
optimum does::

    LlamaConfig(vocab_size=256, bos_token_id=1, eos_token_id=2), max_seq_len=64
        ─► {"get_max_seq_len": 64, "get_max_context_len": 64, "get_vocab_size": 256,
            "get_bos_id": 1, "get_eos_ids": [2], "use_kv_cache": True, ...}
"""

from __future__ import annotations

from typing import Any

import torch

#: ExecuTorch's ``get_dtype`` codes (optimum: 5 for float16, else 6; bfloat16 is 6 too).
DTYPE_CODES = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 6}


def token_ids(*values: Any) -> list[int]:
    """The first of ``values`` that is set, as a list of ints (an id or a list of ids)."""
    for value in values:
        if value is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        return [int(v) for v in items if v is not None]
    return []


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None and v != []}


def text_generation(model: Any, *, max_seq_len: int, attn: str, dtype: torch.dtype) -> dict[str, Any]:
    """The constant methods of a decoder-only LM's program."""
    config = model.config.get_text_config()
    return _drop_none({
        **_decoder(model, config, max_seq_len=max_seq_len, n_layers=getattr(config, "num_hidden_layers", None),
                   dtype=dtype, attn=attn),
        "enable_dynamic_shape": True,
    })


def _decoder(model: Any, config: Any, *, max_seq_len: int, n_layers: int | None, dtype: torch.dtype,
             attn: str) -> dict[str, Any]:
    """What the runners read of any KV-cache decoder: lengths, vocabulary, tokens, layers, dtype."""
    generation = getattr(model, "generation_config", None)
    bos = token_ids(getattr(generation, "bos_token_id", None), getattr(config, "bos_token_id", None))
    eos = token_ids(getattr(generation, "eos_token_id", None), getattr(config, "eos_token_id", None))
    return {
        "get_max_seq_len": int(max_seq_len),
        "get_max_context_len": int(max_seq_len),
        "get_max_batch_size": 1,
        "get_vocab_size": int(config.vocab_size),
        "get_bos_id": bos[0] if bos else None,
        "get_eos_ids": eos,
        "get_n_layers": n_layers,
        "get_dtype": DTYPE_CODES.get(dtype, 6),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": attn == "custom",
    }


def encoder(model: Any, *, max_seq_len: int | None) -> dict[str, Any]:
    """The constant methods of an encoder's program (text: its longest input)."""
    return _drop_none({"get_max_seq_len": int(max_seq_len) if max_seq_len else None})


def speech_seq2seq(model: Any, *, max_seq_len: int, frames: int, attn: str = "custom",
                   dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The constant methods of an encoder-decoder speech model's program (optimum's seq2seq
    set: the decoder's KV cache length, ``decoder_start_token_id``, ``max_hidden_seq_length``)."""
    config = model.config
    generation = getattr(model, "generation_config", None)
    start = token_ids(getattr(generation, "decoder_start_token_id", None),
                      getattr(config, "decoder_start_token_id", None))
    return _drop_none({
        **_decoder(model, config, max_seq_len=max_seq_len, n_layers=getattr(config, "decoder_layers", None),
                   dtype=dtype, attn=attn),
        "decoder_start_token_id": start[0] if start else None,
        "max_hidden_seq_length": int(frames),
        "enable_dynamic_shape": False,
    })
