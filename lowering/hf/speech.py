"""The ``automatic-speech-recognition`` task: an encoder-decoder (Whisper) as two
methods of one program::

    encoder(input_features[1, mel_bins, frames]) -> encoder_hidden_states[1, F, H]
    text_decoder(decoder_input_ids[1, T], encoder_hidden_states[1, F, H]) -> logits[1, T, V]

The encoder's input is static (Whisper's is fixed at ``2 * max_source_positions``
frames); the decoder takes the tokens decoded so far, any length up to
``max_seq_len`` (no KV cache: each step runs the whole prefix).
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


class SpeechDecoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=decoder_input_ids,
                         use_cache=False, return_dict=True)
        return out.logits


def frames(source: str, config: Any) -> int:
    """The encoder's input length (frames), from the config."""
    positions = getattr(config, "max_source_positions", None)
    if positions is None:
        raise HFError(f"hf:{source}: automatic-speech-recognition supports Whisper-style configs "
                      f"(max_source_positions); {type(config).__name__} has none")
    return 2 * int(positions)


def speech_methods(source: str, model: Any, max_seq_len: int) -> dict[str, tuple[torch.nn.Module, tuple, Any]]:
    """``{"encoder": ..., "text_decoder": ...}``, each ``(module, example_inputs, dynamic_shapes)``."""
    config = model.config
    length = frames(source, config)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, int(config.num_mel_bins), length, generator=generator, dtype=model.dtype)
    encoder = SpeechEncoder(model).eval()
    with torch.no_grad():
        hidden = encoder(features)
    start = getattr(config, "decoder_start_token_id", None) or 0
    tokens = torch.tensor([[start, 3, 4]], dtype=torch.long).remainder(int(config.vocab_size))
    seq = torch.export.Dim("decoder_seq_length", max=max_seq_len)
    return {
        "encoder": (encoder, (features,), None),
        "text_decoder": (SpeechDecoder(model).eval(), (tokens, hidden), {"decoder_input_ids": {1: seq},
                                                                          "encoder_hidden_states": None}),
    }
