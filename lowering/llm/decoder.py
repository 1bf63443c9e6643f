"""A transformers CausalLM as the module ExecuTorch's LLM runner calls.

``decoder_module(hf_model, max_seq_len=L)`` returns a module with

    forward(input_ids: i64[1, S], cache_position: i64[S]) -> logits f32[1, S, V]  ([1, 1, V]: last token only)

whose KV caches are ``nn.Module`` buffers (mutable state of the program), one
``key_cache_i`` / ``value_cache_i`` per layer.  transformers' modeling code runs
unchanged; only its cache and (``attn="custom"``) its attention function differ:

- ``attn="custom"`` (default, fast): caches ``[1, L, H_kv, D]``; each layer's new
  keys/values are written with ``llama::update_cache`` in place at
  ``start_pos = cache_position[0].item()`` and attention is ``llama::custom_sdpa``
  over the whole cache (causal up to ``start_pos + S``, GQA inside), registered as
  transformers attention implementation ``"lowerflow_custom_sdpa"``; no mask is
  built.  Per layer and token the graph holds::

      %k_t = permute_copy(%k, [0, 2, 1, 3])                      # [1, S, H_kv, D]
      %afv2 = auto_functionalized_v2(llama.update_cache, value=%k_t, start_pos=%s, _all_bases=[%b_key_cache_0])
      %o = llama.custom_sdpa(%q_t, %afv2[1], %afv2_1[1], %s, None, 0.0, True, scale)

  which lowers to ``llama::update_cache.out`` writing ``key_cache_0`` in place.
- ``attn="standard"``: transformers' ``StaticCache`` (``[1, H_kv, L, D]``,
  ``index_copy_``) and the model's own attention (aten SDPA), as transformers'
  ``TorchExportableModuleWithStaticCache`` does, with the layers' tensors rebound
  to the module's buffers on every call (LLM-EXPORT.md 5.1: no tensor is lifted
  twice, so non-strict export and decomposition work).

Sliding-window layers (Mistral, Qwen2, Gemma 2/3: a window shorter than
``max_seq_len``) keep whole-length caches and pass ``custom_sdpa`` the window as an
``attn_mask`` (:func:`sliding_window_mask`), as transformers' own static cache does:
memory is that of full layers, results those of the window.  Layers with attention logit
soft-capping (Gemma 2: ``tanh(scores / cap) * cap`` before the mask, which
``custom_sdpa`` cannot apply) still write their caches with ``update_cache`` but
attend in aten ops over the whole cache, rows after each query's position masked
(:func:`softcapped_cache_attention`); those caches keep their stored zeros.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .custom_ops import ensure_llama_ops

ATTN_IMPLEMENTATION = "lowerflow_custom_sdpa"
ATTN_CHOICES = ("custom", "standard")


def decoder_module(hf_model: torch.nn.Module, *, max_seq_len: int, attn: str = "custom",
                   last_token_logits: bool = False) -> torch.nn.Module:
    """``hf_model`` (a transformers ``*ForCausalLM``) as ``forward(input_ids, cache_position) -> logits``."""
    if attn not in ATTN_CHOICES:
        raise ValueError(f"decoder_module: attn must be one of {ATTN_CHOICES}, got {attn!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"decoder_module: max_seq_len must be an int >= 2, got {max_seq_len!r}")
    return Decoder(hf_model, max_seq_len=max_seq_len, custom=attn == "custom", last_token_logits=last_token_logits)


def decoder_example(max_seq_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
    """Example inputs (a 3-token prompt) and dynamic shapes: one ``Dim("seq_length_dim",
    max=max_seq_len-1)`` shared by ``input_ids`` dim 1 and ``cache_position`` dim 0."""
    seq = torch.export.Dim("seq_length_dim", max=max_seq_len - 1)
    example = (torch.zeros(1, 3, dtype=torch.long), torch.arange(3, dtype=torch.long))
    return example, {"input_ids": {1: seq}, "cache_position": {0: seq}}


class Step:
    """Python state of one call: the start position (an int, or an unbacked SymInt when traced)."""

    start_pos: Any = 0
    #: The call's cache positions [S] (a tensor while running).
    positions: Any = None
    #: The call's sliding-window masks, by window (made by the first layer that needs one).
    masks: dict | None = None

    def window_mask(self, window: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """:func:`sliding_window_mask` of this call, made once for all layers of ``window``."""
        if self.masks is None:
            self.masks = {}
        if window not in self.masks:
            self.masks[window] = sliding_window_mask(self.positions, length, window, dtype)
        return self.masks[window]


class Decoder(torch.nn.Module):
    """See the module docstring; built by :func:`decoder_module`."""

    def __init__(self, hf_model: torch.nn.Module, *, max_seq_len: int, custom: bool, last_token_logits: bool):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
        from transformers.configuration_utils import get_head_shapes

        self.model = hf_model
        self.max_seq_len = max_seq_len
        self.custom = custom
        self.last_token_logits = last_token_logits
        config = hf_model.config.get_text_config()
        self._config = config
        num_heads, head_dim = get_head_shapes(config)
        self._step = Step()
        n_layers = config.num_hidden_layers
        heads = num_heads if isinstance(num_heads, list) else [num_heads] * n_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * n_layers
        dtype = next(hf_model.parameters()).dtype
        if custom:
            ensure_llama_ops()
            _register_attention()
            layers = [custom_layer_class()(max_seq_len, self._step) for _ in range(n_layers)]
            self.cache = StaticCache(max_cache_len=max_seq_len, config=config)
            self.cache.layers = layers
            for i, layer in enumerate(layers):
                shape = (1, max_seq_len, heads[i], dims[i])
                self.register_buffer(f"key_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
                self.register_buffer(f"value_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            # the attention function reads the start position on its module (set on every call:
            # two decoders may wrap one model)
            self._attention_modules = [m for m in hf_model.modules() if hasattr(m, "layer_idx")]
        else:
            self.cache = StaticCache(max_cache_len=max_seq_len, config=config)
            self.cache.layers = [StaticLayer(max_seq_len) for _ in range(n_layers)]
            self.cache.early_initialization(1, heads, dims, dtype, torch.device("cpu"))
            for i, layer in enumerate(self.cache.layers):
                self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
                self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
                self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):  # the module's buffers (export fakifies these)
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            if not self.custom:
                layer.cumulative_length = getattr(self, f"cumulative_length_{i}")
                layer.cumulative_length.copy_(cache_position[0])
        kwargs: dict[str, Any] = {}
        if self.custom:
            self._step.start_pos = cache_position[0].item()
            self._step.positions = cache_position
            for module in self._attention_modules:
                module.__dict__["_lowerflow_step"] = self._step
            kwargs["position_ids"] = cache_position.unsqueeze(0)
        if self.last_token_logits:
            kwargs["logits_to_keep"] = 1
        previous = self._config._attn_implementation
        if self.custom:
            self._config._attn_implementation = ATTN_IMPLEMENTATION
        try:
            out = self.model(input_ids=input_ids, attention_mask=None, cache=self.cache, use_cache=True, **kwargs)
        finally:
            self._config._attn_implementation = previous
            self._release()
        return out.logits

    def quick_calls(self, prefill: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A verify's quick check of this decoder (:func:`lowering.verify.verify_quick`): a
        prompt of ``prefill`` tokens at positions 0.., then ``steps`` single-token decode
        steps after it (fewer where ``max_seq_len`` is short); token ids spread over the
        vocabulary, the same on every call."""
        prefill = max(1, min(prefill, self.max_seq_len - 1))
        steps = max(0, min(steps, self.max_seq_len - prefill))
        vocab = int(self._config.vocab_size)
        ids = (torch.arange(prefill + steps, dtype=torch.long) * 7919 + 1) % vocab
        calls = [(ids[:prefill].unsqueeze(0), torch.arange(prefill, dtype=torch.long))]
        for at in range(prefill, prefill + steps):
            calls.append((ids[at:at + 1].unsqueeze(0), torch.tensor([at], dtype=torch.long)))
        return calls

    def _release(self) -> None:
        """The layers and the step hold no tensor between calls: after a (non-strict) export
        they would hold its fake tensors and SymInts, and the module could not be deep-copied."""
        self._step.start_pos, self._step.positions, self._step.masks = 0, None, None
        for layer in self.cache.layers:
            layer.keys = layer.values = None
            if not self.custom:
                layer.cumulative_length = None


@functools.cache
def custom_layer_class():
    """transformers' StaticLayer on ``[1, L, H, D]`` buffers written by ``llama::update_cache``
    (a class made on first use: transformers is imported only by a decoder)."""
    from transformers.cache_utils import StaticLayer

    class CustomLayer(StaticLayer):
        def __init__(self, max_cache_len: int, step: Step):
            super().__init__(max_cache_len)
            self.step = step
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """``key_states``/``value_states`` [B, H, S, D] (transformers' layout) -> the whole caches."""
            start = self.step.start_pos
            torch.ops.llama.update_cache(key_states.transpose(1, 2), self.keys, start)
            torch.ops.llama.update_cache(value_states.transpose(1, 2), self.values, start)
            return self.keys, self.values

    return CustomLayer


def custom_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: ``query`` [B, Hq, S, D]; ``key``/``value`` the whole
    ``[B, L, H_kv, D]`` caches of :class:`CustomLayer`.  Returns ([B, S, Hq, D], None)."""
    step = module.__dict__.get("_lowerflow_step")
    if step is None:
        raise RuntimeError(f"lowerflow_custom_sdpa: {type(module).__name__} was not prepared by decoder_module")
    length = key.shape[1]
    window = kwargs.get("sliding_window")
    window = window if window is not None and window < length else None  # a window the cache holds: none
    if kwargs.get("softcap") is not None:  # Gemma 2: tanh-capped scores, which custom_sdpa cannot apply
        return softcapped_cache_attention(query, key, value, step.positions, scaling, kwargs["softcap"],
                                          window), None
    mask = None if window is None else step.window_mask(window, length, query.dtype)
    out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, step.start_pos, mask, 0.0, mask is None,
                                      scaling)
    return out, None


def sliding_window_mask(positions: torch.Tensor, length: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[S, L]`` additive mask of a sliding-window layer over whole-length caches: the
    query at position ``p`` sees keys ``p - window < k <= p`` (transformers' window)::

        positions [5, 6], length 8, window 3 ─► row 5: keys 3 4 5 -> 0, others -inf
                                                row 6: keys 4 5 6 -> 0, others -inf
    """
    keys = torch.arange(length, device=positions.device)[None, :]
    rows = positions[:, None]
    hidden = (keys > rows) | (keys <= rows - window)
    return torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill(hidden, float("-inf"))


def softcapped_cache_attention(query, key, value, positions, scaling, softcap: float,
                               window: int | None = None) -> torch.Tensor:
    """Causal attention with Gemma 2's logit soft-capping in aten ops, over the whole
    ``[B, L, H_kv, D]`` caches (rows after ``positions`` masked, and with a ``window`` the
    rows it leaves behind): ``query`` [B, Hq, S, D],
    ``positions`` [S] -> [B, S, Hq, D].  The caches keep their stored zeros (read here)::

        %s = mul(matmul(%q, transpose(%k)), scale); %s = mul(tanh(div(%s, cap)), cap)
        %s = masked_fill(%s, arange(L) > positions[:, None], -inf); matmul(softmax(%s), %v)
    """
    keys, values = key.transpose(1, 2), value.transpose(1, 2)     # [B, H_kv, L, D]
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(query, keys.transpose(2, 3)) * scale / softcap) * softcap
    columns = torch.arange(keys.shape[2], device=query.device)[None, :]
    hidden = columns > positions[:, None]                                                      # [S, L]
    if window is not None:
        hidden = hidden | (columns <= positions[:, None] - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous()


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, custom_sdpa_attention)
