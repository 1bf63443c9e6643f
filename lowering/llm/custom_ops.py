"""``llama::custom_sdpa`` and ``llama::update_cache``: ExecuTorch's LLM ops, defined here.

The stock runtime's custom-ops library (``libcustom_ops_aot_lib.so``) implements
``llama::custom_sdpa.out`` and ``llama::update_cache.out``; a program that calls
them by name runs there once that library is loaded.  lowerflow never imports
executorch, so it defines the same ops with ``torch.library`` under the same
schemas (functional + ``.out``), with a CPU kernel (the math, so eager runs and
``lowering.runtime`` can call it) and a fake kernel (export).

ExecuTorch's library aborts the process when it finds these names already
defined, so :func:`ensure_llama_ops` defines them lazily, only when
``torch.ops.llama.<op>`` does not exist yet (ExecuTorch's library loaded first
is fine: its definitions are used as they are).

Semantics (ExecuTorch's, layout ``[B, S, H, D]``):
    update_cache(value[B,S,H,D], cache[B,S_max,H,D], start_pos) -> dummy [1]
        cache[:, start_pos:start_pos+S] = value   (in place)
    custom_sdpa(q[B,S,Hq,D], k_cache[B,S_max,Hkv,D], v_cache, start_pos, mask, 0., is_causal, scale)
        causal attention of query row i (position start_pos+i) over key positions
        0..start_pos+i; Hq a multiple of Hkv (GQA); with a mask, ``attn_mask``
        [S, L] is added and start_pos only bounds L = start_pos+S.
"""

from __future__ import annotations

import math
import threading

import torch

#: Schemas of ExecuTorch 1.5.1's ``libcustom_ops_aot_lib.so`` (read from the loaded library).
SCHEMAS = {
    "custom_sdpa": "(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None, "
                   "float drpout_p=0., bool is_causal=False, float? scale=None) -> Tensor",
    "custom_sdpa.out": "(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None, "
                       "float drpout_p=0., bool is_causal=False, float? scale=None, *, Tensor(a!) out) "
                       "-> Tensor(a!)",
    "update_cache": "(Tensor value, Tensor(a!) cache, SymInt start_pos) -> Tensor",
    "update_cache.out": "(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out) -> Tensor(b!)",
}

#: functional overload -> its out variant (qualified names).
OUT_VARIANTS = {
    "llama::custom_sdpa": "llama::custom_sdpa.out",
    "llama::update_cache": "llama::update_cache.out",
}

_LOCK = threading.Lock()
_LIBS: list = []


def ensure_llama_ops() -> None:
    """Define the llama ops unless they exist (ours from an earlier call, or ExecuTorch's)."""
    with _LOCK:
        if _defined("custom_sdpa") and _defined("update_cache"):
            return
        if _defined("custom_sdpa") or _defined("update_cache"):
            raise RuntimeError("lowering.llm: torch.ops.llama defines only one of custom_sdpa / update_cache; "
                               "load ExecuTorch's custom-ops library whole or not at all")
        lib = torch.library.Library("llama", "FRAGMENT")  # noqa: TOR901 (kept alive in _LIBS)
        for name, schema in SCHEMAS.items():
            lib.define(name + schema)
        lib.impl("custom_sdpa", _custom_sdpa_cpu, "CPU")
        lib.impl("custom_sdpa.out", _custom_sdpa_out_cpu, "CPU")
        lib.impl("update_cache", _update_cache_cpu, "CPU")
        lib.impl("update_cache.out", _update_cache_out_cpu, "CPU")
        lib.impl("custom_sdpa", _custom_sdpa_meta, "Meta")
        lib.impl("update_cache", _update_cache_meta, "Meta")
        _LIBS.append(lib)


def _defined(op: str) -> bool:
    try:
        return hasattr(torch.ops.llama, op) and bool(getattr(torch.ops.llama, op).overloads())
    except (AttributeError, RuntimeError):
        return False


def custom_sdpa_math(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: int,
                     attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                     scale: float | None = None) -> torch.Tensor:
    """The reference math of ``custom_sdpa`` (see the module docstring)."""
    seq = q.shape[1]
    length = int(start_pos) + seq
    qh = q.transpose(1, 2).float()                      # [B, Hq, S, D]
    kh = k_cache[:, :length].transpose(1, 2).float()    # [B, Hkv, L, D]
    vh = v_cache[:, :length].transpose(1, 2).float()
    groups = qh.shape[1] // kh.shape[1]
    if groups > 1:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
    factor = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = qh @ kh.transpose(-1, -2) * factor          # [B, Hq, S, L]
    if attn_mask is not None:
        scores = scores + attn_mask[..., :seq, :length].float()
    elif is_causal:
        rows = torch.arange(seq).unsqueeze(1) + int(start_pos)
        cols = torch.arange(length).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh             # [B, Hq, S, D]
    return out.transpose(1, 2).contiguous().to(q.dtype)


def _custom_sdpa_cpu(q, k, v, start_pos, attn_mask=None, drpout_p=0.0, is_causal=False, scale=None):
    return custom_sdpa_math(q, k, v, start_pos, attn_mask, is_causal, scale)


def _custom_sdpa_out_cpu(q, k, v, start_pos, attn_mask=None, drpout_p=0.0, is_causal=False, scale=None, *, out):
    out.copy_(custom_sdpa_math(q, k, v, start_pos, attn_mask, is_causal, scale))
    return out


def update_cache_math(value: torch.Tensor, cache: torch.Tensor, start_pos: int) -> None:
    """``cache[:, start_pos:start_pos+S] = value`` in place."""
    start = int(start_pos)
    if start + value.shape[1] > cache.shape[1]:
        raise RuntimeError(f"llama::update_cache: start_pos {start} + {value.shape[1]} rows exceed "
                           f"the cache length {cache.shape[1]}")
    cache[:, start:start + value.shape[1]].copy_(value)


def _update_cache_cpu(value, cache, start_pos):
    update_cache_math(value, cache, start_pos)
    return torch.empty((1,), dtype=value.dtype)


def _update_cache_out_cpu(value, cache, start_pos, *, out):
    update_cache_math(value, cache, start_pos)
    return out


def _custom_sdpa_meta(q, k, v, start_pos, attn_mask=None, drpout_p=0.0, is_causal=False, scale=None):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _update_cache_meta(value, cache, start_pos):
    return torch.empty((1,), dtype=value.dtype, device=value.device)
