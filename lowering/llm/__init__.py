"""Text-generation decoders for ExecuTorch's LLM runner, with ExecuTorch's fast ops.

- :mod:`~lowering.llm.custom_ops`: ``llama::custom_sdpa`` / ``llama::update_cache``
  defined with torch.library under ExecuTorch's schemas (only when not defined yet);
- :mod:`~lowering.llm.decoder`: :func:`decoder_module` (a transformers CausalLM as
  ``forward(input_ids, cache_position) -> logits`` with its KV cache in buffers) and
  :func:`decoder_example`;
- :mod:`~lowering.llm.seq2seq`: :func:`seq2seq_decoder_module` (an encoder-decoder's
  decoder, Whisper, as the ASR runner's ``text_decoder(ids[1,1], encoder_hidden_states,
  cache_position[1])``, its self-attention KV cache in buffers).
"""

from .custom_ops import ensure_llama_ops
from .decoder import decoder_example, decoder_module
from .seq2seq import seq2seq_decoder_example, seq2seq_decoder_module

__all__ = ["decoder_example", "decoder_module", "ensure_llama_ops", "seq2seq_decoder_example",
           "seq2seq_decoder_module"]
