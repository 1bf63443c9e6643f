"""Real-world architectures from ``transformers`` configs, with random weights.

Nothing is downloaded: every model is built from a small config and seeded
weights, so a factory gives the same module (and the same ``.pte`` bytes) in
any process.  Each factory returns ``(nn.Module, example_inputs)`` like the
ones in :mod:`examples.models`, so a fleet or the CLI names them by spec, e.g.
``examples.hf_models:mobilenet_v2``.

* :func:`mobilenet_v2` — a conv net whose reference lowering has many partitions
  (62: every depthwise/pointwise block is cut by the ops the backend does not take).
* :func:`resnet` — a small ResNet (conv + batch norm + residual adds + pooling).
* :func:`bert` — a small BERT encoder (embeddings, attention with a mask, GELU MLP).
* :func:`gpt2` — a small GPT-2 decoder with its LM head (causal attention, tied
  embedding), ``use_cache=False`` so the output is a plain tensor.
* :func:`gemma` — a small Gemma decoder (RMS norm, rotary positions, grouped-query
  attention, gated GELU MLP), no KV cache.

``transformers`` is a test extra; importing this module without it fails with
an ImportError that says so.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "examples.hf_models needs the 'transformers' package (pip install -e '.[test]')"
    ) from exc


def _seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


class _TensorOutput(nn.Module):
    """Wraps a ``transformers`` model so ``forward`` returns one tensor (or a tuple of tensors)
    instead of a ``ModelOutput``: the programs stay independent of transformers' output classes."""

    def __init__(self, model: nn.Module, fields: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.fields = fields

    def forward(self, *args):
        out = self.model(*args, return_dict=True)
        values = tuple(getattr(out, f) for f in self.fields)
        return values[0] if len(values) == 1 else values


def mobilenet_v2():
    """MobileNetV2 at 64x64, depth multiplier 0.35 (the issue's model): 62 reference partitions."""
    _seeded()
    config = transformers.MobileNetV2Config(image_size=64, depth_multiplier=0.35)
    model = transformers.MobileNetV2Model(config).eval()
    _randomize_batch_norm(model)
    return _TensorOutput(model, ("pooler_output",)).eval(), (torch.randn(1, 3, 64, 64),)


def resnet():
    """A two-stage ResNet (basic blocks) on 32x32 images."""
    _seeded()
    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"
    )
    model = transformers.ResNetModel(config).eval()
    _randomize_batch_norm(model)
    return _TensorOutput(model, ("pooler_output",)).eval(), (torch.randn(1, 3, 32, 32),)


def bert():
    """A two-layer BERT encoder (hidden 64, 4 heads) on 2 x 12 tokens with a padding mask."""
    _seeded()
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, attn_implementation="eager",
    )
    model = transformers.BertModel(config, add_pooling_layer=True).eval()
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return _TensorOutput(model, ("last_hidden_state", "pooler_output")).eval(), (ids, mask)


def gpt2():
    """A two-layer GPT-2 with its LM head (hidden 64, 4 heads, vocabulary 128), no KV cache."""
    _seeded()
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    return _GPT2Logits(model).eval(), (torch.randint(0, 128, (1, 16)),)


def gemma():
    """A two-layer Gemma decoder (hidden 64, 4 heads, 1 KV head, vocabulary 128), no KV cache."""
    _seeded()
    config = transformers.GemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=32,
        use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = transformers.GemmaForCausalLM(config).eval()
    return _GPT2Logits(model).eval(), (torch.randint(0, 128, (1, 16)),)


class _GPT2Logits(nn.Module):
    """GPT-2's logits for ``input_ids`` (no cache, no past)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


def _randomize_batch_norm(model: nn.Module) -> None:
    """Non-trivial running statistics, so batch norm is not an identity."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)


#: name -> factory.
MODELS = {
    "mobilenet_v2": mobilenet_v2,
    "resnet": resnet,
    "bert": bert,
    "gpt2": gpt2,
    "gemma": gemma,
}
