"""The ``automatic-speech-recognition`` task: an encoder-decoder (Whisper) as two
methods of one program, as ExecuTorch's ASR runner (``extension/asr/runner``) and
optimum-executorch's ``Seq2SeqLMExportableModule`` make it::

    encoder(input_features[1, mel_bins, frames]) -> encoder_hidden_states[1, F, H]
    text_decoder(decoder_input_ids[1, 1], encoder_hidden_states[1, F, H], cache_position[1]) -> logits[1, 1, V]

The encoder's input is static (Whisper's is fixed at ``2 * max_source_positions``
frames).  The decoder takes one token per call: its self-attention keys/values live
in a static cache of ``max_seq_len`` positions in mutable buffers, written in place
with ``llama::update_cache`` and read by ``llama::custom_sdpa`` (``attn="custom"``, the
default).  With ``custom`` the encoder method also computes every decoder layer's
cross-attention keys/values once into buffers ``text_decoder`` reads (the methods
share their mutable buffers: ``HFProgram.share_mutable_buffers``); with ``"standard"``
(transformers' static cache, aten SDPA, no llama ops) they are recomputed from
``encoder_hidden_states`` on every call (:mod:`lowering.llm.seq2seq`).  The runner's loop::

    hidden = encoder(features)
    for pos in 0, 1, ...:  logits = text_decoder([[token]], hidden, [pos]);  token = argmax(logits)
"""

from __future__ import annotations

from typing import Any

import torch

from .loading import HFError


class SpeechEncoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features=input_features, return_dict=True).last_hidden_state


def frames(source: str, config: Any) -> int:
    """The encoder's input length (frames), from the config."""
    positions = getattr(config, "max_source_positions", None)
    if positions is None:
        raise HFError(f"hf:{source}: automatic-speech-recognition supports Whisper-style configs "
                      f"(max_source_positions); {type(config).__name__} has none")
    return 2 * int(positions)


def speech_methods(source: str, model: Any, max_seq_len: int,
                   attn: str = "custom") -> dict[str, tuple[torch.nn.Module, tuple, Any]]:
    """``{"encoder": ..., "text_decoder": ...}``, each ``(module, example_inputs, dynamic_shapes)``."""
    from ..llm import seq2seq_decoder_example, seq2seq_decoder_module

    config = model.config
    length = frames(source, config)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, int(config.num_mel_bins), length, generator=generator, dtype=model.dtype)
    encoder = SpeechEncoder(model).eval()
    with torch.no_grad():
        hidden = encoder(features)
    try:
        decoder = seq2seq_decoder_module(model, max_seq_len=max_seq_len, attn=attn,
                                         encoder_length=hidden.shape[1] if attn == "custom" else None)
    except ValueError as exc:  # e.g. max_seq_len beyond the decoder's positions
        raise HFError(f"hf:{source}: {str(exc).removeprefix('seq2seq_decoder_module: ')}") from exc
    start = getattr(config, "decoder_start_token_id", None) or 0
    return {
        "encoder": (decoder.encoder_module(encoder).eval() if attn == "custom" else encoder, (features,), None),
        "text_decoder": (decoder.eval(), seq2seq_decoder_example(hidden, start), None),
    }
