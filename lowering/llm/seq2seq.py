"""A transformers encoder-decoder's decoder (Whisper) as ExecuTorch's ASR runner calls it.

``seq2seq_decoder_module(hf_model, max_seq_len=L, encoder_length=T)`` returns a module with

    forward(decoder_input_ids: i64[1, 1], encoder_hidden_states: f32[1, T, H], cache_position: i64[1])
        -> logits f32[1, 1, V]

one token per call (the runner's ``text_decoder``: ``extension/asr/runner``), the
decoder's self-attention keys/values in ``[1, L, H, D]`` buffers ``key_cache_i`` /
``value_cache_i`` (mutable state of the program).  transformers' modeling code runs
unchanged; only its cache and its attention function differ (registered as
``"lowerflow_custom_sdpa_seq2seq"`` for the call)::

    before (no cache): text_decoder(ids[1, S], hidden) reran the whole prefix and every
                       layer's k_proj/v_proj over all T encoder frames, per token
    after, per decoder layer and token:
      %k_t = permute_copy(%k, [0, 2, 1, 3])                                    # [1, 1, H, D]
      %afv2 = auto_functionalized_v2(llama.update_cache, value=%k_t, start_pos=%s, _all_bases=[%b_key_cache_0])
      %o = llama.custom_sdpa(%q_t, %afv2[1], %afv2_1[1], %s, None, 0.0, True, 1.0)   # causal over 0..s
      %c = llama.custom_sdpa(%cq_t, %b_cross_key_0, %b_cross_value_0, T-1, None, 0.0, False, 1.0)  # all T
    and the encoder method (:meth:`Seq2SeqDecoder.encoder_module`), once per utterance:
      %hidden = <encoder>(%input_features)
      copy_(%b_cross_key_0, view(linear(%hidden, encoder_attn.k_proj), [1, T, H, D]))  ... per layer

with ``%s = cache_position[0].item()``.  The cross buffers are state the two methods
share (``lower(..., share_mutable_buffers=True)``): ``text_decoder`` attends to the
frames of the last ``encoder`` call, as the runner calls them (its
``encoder_hidden_states`` input is then unused).  Without ``encoder_length`` (and with
``attn="standard"``: transformers' ``StaticLayer`` cache, aten SDPA), cross-attention
keys/values are computed from ``encoder_hidden_states`` on every call, as
optimum-executorch's ``DynamicCache`` does.
"""

from __future__ import annotations

import functools

import torch

from .custom_ops import ensure_llama_ops
from .decoder import ATTN_CHOICES, Step, custom_layer_class, custom_sdpa_attention

ATTN_IMPLEMENTATION = "lowerflow_custom_sdpa_seq2seq"


def seq2seq_decoder_module(hf_model: torch.nn.Module, *, max_seq_len: int, attn: str = "custom",
                           encoder_length: int | None = None) -> "Seq2SeqDecoder":
    """``hf_model`` (a transformers ``WhisperForConditionalGeneration``-style encoder-decoder)
    as ``forward(decoder_input_ids[1,1], encoder_hidden_states, cache_position[1]) -> logits``.
    With ``encoder_length`` (the encoder's output length T) the cross-attention keys/values
    are cached: see :meth:`Seq2SeqDecoder.encoder_module`."""
    if attn not in ATTN_CHOICES:
        raise ValueError(f"seq2seq_decoder_module: attn must be one of {ATTN_CHOICES}, got {attn!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"seq2seq_decoder_module: max_seq_len must be an int >= 2, got {max_seq_len!r}")
    return Seq2SeqDecoder(hf_model, max_seq_len=max_seq_len, custom=attn == "custom", encoder_length=encoder_length)


def seq2seq_decoder_example(hidden: torch.Tensor, start_token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example inputs of one decode step (static shapes, as the runner calls it)."""
    return torch.tensor([[start_token]], dtype=torch.long), hidden, torch.tensor([0], dtype=torch.long)


class Seq2SeqDecoder(torch.nn.Module):
    """See the module docstring; built by :func:`seq2seq_decoder_module`."""

    def __init__(self, hf_model: torch.nn.Module, *, max_seq_len: int, custom: bool = True,
                 encoder_length: int | None = None):
        super().__init__()
        config = hf_model.config
        layers = getattr(hf_model.get_decoder(), "layers", None)
        attentions = [getattr(layer, "self_attn", None) for layer in layers or []]
        if not attentions or any(a is None or not hasattr(a, "head_dim") for a in attentions):
            raise ValueError(f"seq2seq_decoder_module: {type(hf_model).__name__} has no decoder layers with "
                             f"a self_attn (num_heads, head_dim) as Whisper's")
        positions = getattr(config, "max_target_positions", None)
        if positions is not None and max_seq_len > int(positions):
            raise ValueError(f"seq2seq_decoder_module: max_seq_len {max_seq_len} exceeds the decoder's "
                             f"{positions} positions (max_target_positions)")
        self.model = hf_model
        self.max_seq_len = max_seq_len
        self.custom = custom
        self._config = config
        self._step = Step()
        self._self_attention = attentions
        dtype = next(hf_model.parameters()).dtype
        heads, dims = [int(a.num_heads) for a in attentions], [int(a.head_dim) for a in attentions]
        if encoder_length and not custom:
            raise ValueError("seq2seq_decoder_module: the cross-attention cache (encoder_length) needs attn 'custom'")
        self._cross_attention = [layer.encoder_attn for layer in layers] if encoder_length else []
        self.cross = CrossState(self._cross_attention, encoder_length, dtype) if encoder_length else None
        if custom:
            ensure_llama_ops()
            _register_attention()
            self._layers = [custom_layer_class()(max_seq_len, self._step) for _ in attentions]
            for i in range(len(attentions)):
                shape = (1, max_seq_len, heads[i], dims[i])
                self.register_buffer(f"key_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
                self.register_buffer(f"value_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
        else:  # transformers' StaticLayer (index_copy_ into [1, H, L, D]), as lowering.llm.decoder's standard
            from transformers.cache_utils import Cache, StaticLayer

            self._layers = [StaticLayer(max_seq_len) for _ in attentions]
            Cache(layers=self._layers).early_initialization(1, heads, dims, dtype, torch.device("cpu"))
            for i, layer in enumerate(self._layers):
                self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
                self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
                self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                cache_position: torch.Tensor) -> torch.Tensor:
        from transformers.cache_utils import Cache, EncoderDecoderCache

        for i, layer in enumerate(self._layers):  # the module's buffers (export fakifies these)
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            if not self.custom:
                layer.cumulative_length = getattr(self, f"cumulative_length_{i}")
                layer.cumulative_length.copy_(cache_position[0])
        if self.custom:
            self._step.start_pos = cache_position[0].item()
            for module in self._self_attention:  # the cross-attentions carry no step
                module.__dict__["_lowerflow_step"] = self._step
            for module in self._cross_attention:
                module.__dict__["_lowerflow_cross"] = True
        cross = [_cross_layer_class()() for _ in self._layers]
        for i, layer in enumerate(cross if self.cross is not None else ()):  # the encoder method's keys/values
            layer.keys, layer.values, layer.is_initialized = self.cross.keys(i), self.cross.values(i), True
        cache = EncoderDecoderCache(Cache(layers=self._layers), Cache(layers=cross))
        previous = self._config._attn_implementation
        if self.custom:
            self._config._attn_implementation = ATTN_IMPLEMENTATION
        try:
            out = self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=decoder_input_ids,
                             decoder_position_ids=cache_position.unsqueeze(0), cache=cache, use_cache=True,
                             return_dict=True)
        finally:
            self._config._attn_implementation = previous
            self._release()
        return out.logits

    def _release(self) -> None:
        """No tensor or SymInt stays on the layers between calls (see lowering.llm.decoder)."""
        self._step.start_pos = 0
        for module in self._cross_attention:
            module.__dict__.pop("_lowerflow_cross", None)
        for layer in self._layers:
            layer.keys = layer.values = None
            if not self.custom:
                layer.cumulative_length = None


    def encoder_module(self, encoder: torch.nn.Module) -> torch.nn.Module:
        """``encoder`` (``features -> encoder_hidden_states``) that also writes the cross-attention
        keys/values this decoder reads (needs ``encoder_length``; the two methods share their
        mutable buffers: ``lower(..., share_mutable_buffers=True)``)."""
        if self.cross is None:
            raise ValueError("seq2seq_decoder_module: no cross-attention cache (encoder_length not given)")
        return CrossWriter(encoder, self.cross)


class CrossState(torch.nn.Module):
    """The cross-attention keys/values of every decoder layer, ``[1, T, H, D]`` buffers
    ``key_i`` / ``value_i`` (``llama::custom_sdpa``'s layout), and how to compute them from
    the encoder's output (the layers' own ``k_proj`` / ``v_proj``, as Whisper's attention)."""

    def __init__(self, attentions: list, length: int, dtype: torch.dtype):
        super().__init__()
        self.attentions = torch.nn.ModuleList(attentions)  # the decoder's own (shared parameters)
        for i, attention in enumerate(attentions):
            shape = (1, int(length), int(attention.num_heads), int(attention.head_dim))
            self.register_buffer(f"key_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            self.register_buffer(f"value_{i}", torch.zeros(shape, dtype=dtype), persistent=False)

    def keys(self, i: int) -> torch.Tensor:
        return getattr(self, f"key_{i}")

    def values(self, i: int) -> torch.Tensor:
        return getattr(self, f"value_{i}")

    def write(self, hidden: torch.Tensor) -> None:
        for i, attention in enumerate(self.attentions):
            shape = (hidden.shape[0], -1, attention.num_heads, attention.head_dim)
            self.keys(i).copy_(attention.k_proj(hidden).view(shape))
            self.values(i).copy_(attention.v_proj(hidden).view(shape))


class CrossWriter(torch.nn.Module):
    """``forward(features) -> encoder_hidden_states``, writing the decoder's cross keys/values."""

    def __init__(self, encoder: torch.nn.Module, cross: CrossState):
        super().__init__()
        self.encoder = encoder
        self.cross = cross

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(*inputs)
        self.cross.write(hidden)
        return hidden


@functools.cache
def _cross_layer_class():
    """A cross-attention cache layer that keeps nothing: each call's keys/values are its own."""
    from transformers.cache_utils import DynamicLayer

    class PassThroughLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states

    return PassThroughLayer


def seq2seq_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Self-attention (a module carrying the step): ``llama::custom_sdpa`` over the cache.
    Cached cross-attention (``key``/``value`` the [B, T, H, D] buffers of :class:`CrossState`):
    ``llama::custom_sdpa`` over all T frames, not causal (``start_pos + S = T``); the
    buffers' only users are then llama ops, which no delegate takes, so no backend copies
    the state another method writes into its own weights.  Recomputed cross-attention:
    ``softmax(q @ k^T * scale [+ mask]) @ v`` (``key``/``value`` [B, H, T, D]).
    ``query`` [B, H, S, D]; returns [B, S, H, D], None."""
    if "_lowerflow_step" in module.__dict__:
        return custom_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if "_lowerflow_cross" in module.__dict__:
        start = key.shape[1] - query.shape[2]
        out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, start, None, 0.0, False, scaling)
        return out, None
    scores = query @ key.transpose(-1, -2)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if scaling != 1.0:  # Whisper scales the query itself and passes 1.0
        scores = scores * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    out = torch.softmax(scores, dim=-1) @ value
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, seq2seq_attention)
