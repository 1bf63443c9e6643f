"""The ``text-generation`` task: a decoder-only LM as ExecuTorch's LLM runner expects it.

One method ``forward(input_ids[1,S], cache_position[S]) -> logits[1,S,V]`` with a
static KV cache in mutable buffers, and one dynamic dim shared by both inputs,
``Dim("seq_length_dim", max=max_seq_len-1)``::

    LlamaForCausalLM ─► decoder module (KV cache: buffers [1, H_kv, max_seq_len, D])
    prefill  forward([[t0..t4]], [0..4])   decode  forward([[t5]], [5])

The module comes from :func:`lowering.llm.decoder_module` when that package is
present (``attn="custom"``: ``llama::update_cache`` + ``llama::custom_sdpa``);
otherwise from transformers' own ``TorchExportableModuleWithStaticCache``
(aten SDPA, ``index_copy_`` cache), whose cache tensors are also held by plain
``StaticLayer`` objects: :mod:`lowering.export.aliases` merges their second
lifting into the buffers, so it exports non-strict.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .loading import HFError

#: attn option values: aten SDPA over transformers' static cache, or ExecuTorch's custom ops.
ATTN = ("standard", "custom")


def _llm() -> Any:
    """``lowering.llm`` (the fast decoder module), or None where it is not available."""
    try:
        from .. import llm
    except ImportError:
        return None
    return llm if hasattr(llm, "decoder_module") and hasattr(llm, "decoder_example") else None


def default_attn() -> str:
    """``custom`` when the custom-op decoder is available, else ``standard``."""
    return "custom" if _llm() is not None else "standard"


def decoder(source: str, model: Any, *, max_seq_len: int, attn: str) -> tuple[torch.nn.Module, tuple, Any]:
    """``(module, example_inputs, dynamic_shapes)`` of the runner's ``forward``."""
    if attn not in ATTN:
        raise HFError(f"hf:{source}: attn {attn!r} is not one of {list(ATTN)}")
    llm = _llm()
    if llm is not None:
        module = llm.decoder_module(model, max_seq_len=max_seq_len, attn=attn)
        inputs, dynamic_shapes = llm.decoder_example(max_seq_len)
        return module, tuple(inputs), dynamic_shapes
    if attn == "custom":
        raise HFError(f"hf:{source}: attn 'custom' needs lowering.llm (the custom-op decoder), which this "
                      "lowerflow does not have; use attn 'standard'")
    return StaticCacheDecoder(model, max_seq_len), *example(max_seq_len)


def example(max_seq_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """A 3-token prompt (S > 1 avoids torch.export's 0/1 specialization) and the shared Dim."""
    seq = torch.export.Dim("seq_length_dim", max=max_seq_len - 1)
    inputs = (torch.tensor([[2, 3, 4]], dtype=torch.long), torch.arange(3, dtype=torch.long))
    return inputs, {"input_ids": {1: seq}, "cache_position": {0: seq}}


class StaticCacheDecoder(torch.nn.Module):
    """transformers' ``TorchExportableModuleWithStaticCache`` with the runner's positional
    signature ``forward(input_ids, cache_position)``."""

    def __init__(self, model: Any, max_seq_len: int) -> None:
        super().__init__()
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        generation = copy.deepcopy(model.generation_config)
        generation.use_cache = True
        generation.cache_implementation = "static"
        model.generation_config = generation
        self.decoder = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_seq_len)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=input_ids, cache_position=cache_position)
