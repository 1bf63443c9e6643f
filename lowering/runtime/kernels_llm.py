"""ExecuTorch's LLM custom-ops kernels (``llama::*.out``) for the executor.

The stock runtime runs them from ``libcustom_ops_aot_lib.so``; lowerflow here,
with the math of :mod:`lowering.llm.custom_ops` (never calling ``torch.ops.llama``,
so it works whether lowerflow's or ExecuTorch's definitions are loaded):

    custom_sdpa.out(q, k_cache, v_cache, start_pos, attn_mask, dropout_p, is_causal, scale, out)
        out <- causal attention of q over cache rows 0..start_pos+S-1 (GQA)
    update_cache.out(value, cache, start_pos, out)
        cache[:, start_pos:start_pos+S] <- value, in place; ``out`` (a dummy) untouched

Each entry is ``(number of schema arguments, call, positions written)``.
"""

from __future__ import annotations

from typing import Callable

from ..llm.custom_ops import custom_sdpa_math, update_cache_math


def custom_sdpa_out(values: list) -> None:
    q, k_cache, v_cache, start_pos, attn_mask, _dropout, is_causal, scale, out = values
    result = custom_sdpa_math(q, k_cache, v_cache, start_pos, attn_mask, bool(is_causal), scale)
    if tuple(out.shape) != tuple(result.shape):
        out.resize_(result.shape)  # a dynamic (DYNAMIC_BOUND) output: the executor emptied it
    out.copy_(result)


def update_cache_out(values: list) -> None:
    value, cache, start_pos, _out = values
    update_cache_math(value, cache, start_pos)


#: qualified name -> (number of schema arguments, call, positions of the written arguments).
LLM_KERNEL_SPECS: dict[str, tuple[int, Callable[[list], None], tuple[int, ...]]] = {
    "llama::custom_sdpa.out": (9, custom_sdpa_out, (8,)),
    "llama::update_cache.out": (4, update_cache_out, (1, 3)),
}
