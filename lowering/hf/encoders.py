"""Encoder tasks: ``feature-extraction`` and ``fill-mask`` (text), ``image-classification``.

Each is one method ``forward`` returning one tensor (the programs never hold
transformers' output classes)::

    feature-extraction    AutoModel                          forward(input_ids[1,S], attention_mask[1,S]) -> last_hidden_state
    fill-mask             AutoModelForMaskedLM               forward(input_ids[1,S], attention_mask[1,S]) -> logits[1,S,V]
    image-classification  AutoModelForImageClassification    forward(pixel_values[1,C,H,W]) -> logits[1,labels]

Text encoders take any length up to ``max_seq_len`` (``Dim("seq_length", max=max_seq_len)``);
images are static at the config's ``image_size``.
"""

from __future__ import annotations

from typing import Any

import torch


class TensorOutput(torch.nn.Module):
    """``model(**inputs)``'s field ``field`` (a ModelOutput's tensor), inputs by name."""

    def __init__(self, model: Any, names: tuple[str, ...], field: str) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.field = field

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, args)), return_dict=True)
        return getattr(out, self.field)


class TextEncoder(TensorOutput):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, attention_mask)


class ImageClassifier(TensorOutput):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values)


def text_encoder(model: Any, field: str, max_seq_len: int) -> tuple[torch.nn.Module, tuple, Any]:
    """``(module, example_inputs, dynamic_shapes)`` of a text encoder returning ``field``."""
    module = TextEncoder(model, ("input_ids", "attention_mask"), field).eval()
    length = min(8, max_seq_len)
    vocab = int(model.config.vocab_size)
    ids = (torch.arange(length, dtype=torch.long) * 7 + 3).remainder(vocab).reshape(1, length)
    mask = torch.ones(1, length, dtype=torch.long)
    seq = torch.export.Dim("seq_length", max=max_seq_len)
    return module, (ids, mask), {"input_ids": {1: seq}, "attention_mask": {1: seq}}


def image_classifier(model: Any) -> tuple[torch.nn.Module, tuple, Any]:
    """``(module, example_inputs, None)`` at the config's image size (static)."""
    config = model.config
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    channels = int(getattr(config, "num_channels", 3))
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(1, channels, int(size), int(size), generator=generator, dtype=model.dtype)
    return ImageClassifier(model, ("pixel_values",), "logits").eval(), (pixels,), None
