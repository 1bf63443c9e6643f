"""The ``text-generation`` task: a decoder-only LM as ExecuTorch's LLM runner expects it.

One method ``forward(input_ids[1,S], cache_position[S]) -> logits[1,S,V]`` with a
static KV cache in mutable buffers, and one dynamic dim shared by both inputs,
``Dim("seq_length_dim", max=max_seq_len-1)``::

    LlamaForCausalLM ─► lowering.llm.decoder_module ─► forward(input_ids, cache_position)
    prefill  forward([[t0..t4]], [0..4])   decode  forward([[t5]], [5])

``attn="custom"`` (the default): ``llama::update_cache`` + ``llama::custom_sdpa`` on
``[1, L, H, D]`` caches (ExecuTorch's fast ops); ``attn="standard"``: transformers'
static cache and aten SDPA (see :mod:`lowering.llm.decoder`).
"""

from __future__ import annotations

from typing import Any

import torch

from .loading import HFError

#: attn option values: ExecuTorch's custom ops, or aten SDPA over transformers' static cache.
ATTN = ("custom", "standard")


def default_attn() -> str:
    return "custom"


def decoder(source: str, model: Any, *, max_seq_len: int, attn: str,
            last_token_logits: bool = False) -> tuple[torch.nn.Module, tuple, Any]:
    """``(module, example_inputs, dynamic_shapes)`` of the runner's ``forward``; with
    ``last_token_logits`` it returns ``[1, V]``, the last position's row (the runner
    reads only that one; the full output is planned at ``[1, max_seq_len-1, V]``)."""
    from ..llm import decoder_example, decoder_module

    if attn not in ATTN:
        raise HFError(f"hf:{source}: attn {attn!r} is not one of {list(ATTN)}")
    try:
        module = decoder_module(model, max_seq_len=max_seq_len, attn=attn, last_token_logits=last_token_logits)
    except ValueError as exc:  # e.g. a bad max_seq_len
        raise HFError(f"hf:{source}: {str(exc).removeprefix('decoder_module: ')}") from exc
    inputs, dynamic_shapes = decoder_example(max_seq_len)
    return module.eval(), tuple(inputs), dynamic_shapes
