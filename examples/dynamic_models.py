"""Models with dynamic shapes: factories return ``(module, example_inputs, dynamic_shapes)``.

``dynamic_shapes`` is torch.export's argument (``torch.export.Dim`` objects,
each with a max), keyed by forward argument name.  Model specs name them like
any factory, e.g. ``examples.dynamic_models:gpt_decoder``.

:class:`GPTDecoder` is a small GPT-style decoder with a KV cache held in
mutable buffers: ``forward(tokens, input_pos)`` takes ``T`` tokens at positions
``input_pos`` (``T`` is dynamic), writes their keys and values into the cache
at those positions (``k_cache[input_pos] = k``: an in-place ``index_put_``)
and attends causally over the whole cache.  A prompt is prefilled in one call,
then tokens are decoded one call each, on the same loaded method.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.export import Dim


def _seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


def dynamic_mlp():
    """The demo MLP with a dynamic batch (1..32)."""
    from examples.models import mlp

    model, inputs = mlp()
    return model, inputs, {"x": {0: Dim("batch", min=1, max=32)}}


class DynamicOps(nn.Module):
    """Symbolic sizes in views and scalar arithmetic, a static branch (``w``) besides."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)

    def forward(self, x, w):
        n = x.shape[0]
        h = torch.relu(self.fc(x))
        pairs = h.view(n, 2, 4).sum(1)
        static = torch.tanh(self.gate(w)) * 2.0 + 1.0
        return pairs * (n + 1), static, h.mean(0) + static.sum(0)


def dynamic_ops():
    _seeded()
    return DynamicOps().eval(), (torch.randn(5, 8), torch.randn(3, 8)), {
        "x": {0: Dim("n", min=1, max=24)},
        "w": None,
    }


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention (KV cache in buffers) and an MLP."""

    def __init__(self, d: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.register_buffer("k_cache", torch.zeros(max_seq, heads, d // heads))
        self.register_buffer("v_cache", torch.zeros(max_seq, heads, d // heads))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)  # (H, T, hd)
        self.k_cache[input_pos] = k.view(t, self.heads, self.head_dim)
        self.v_cache[input_pos] = v.view(t, self.heads, self.head_dim)
        keys = self.k_cache.transpose(0, 1)  # (H, S, hd)
        values = self.v_cache.transpose(0, 1)
        scores = q @ keys.transpose(1, 2) / math.sqrt(self.head_dim)  # (H, T, S)
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
        attended = torch.softmax(scores, dim=-1) @ values  # (H, T, hd)
        x = x + self.proj(attended.transpose(0, 1).reshape(t, d))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class GPTDecoder(nn.Module):
    """Token + position embeddings, ``layers`` decoder layers, a final norm and the LM head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, max_seq: int = 32) -> None:
        super().__init__()
        self.max_seq = max_seq
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_seq, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, max_seq) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("positions", torch.arange(max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """``tokens`` (T,) int64 at cache positions ``input_pos`` (T,) -> logits (T, vocab)."""
        x = self.tok(tokens) + self.pos(input_pos)
        mask = self.positions.unsqueeze(0) <= input_pos.unsqueeze(1)  # (T, S): causal over the cache
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return self.head(self.ln(x))


#: Longest prompt (tokens per call) the exported decoder takes.
DECODER_MAX_TOKENS = 16


def gpt_decoder():
    """A 2-layer, d=32 decoder; ``T`` (tokens per call) is dynamic in [1, 16], the cache holds 32."""
    _seeded()
    model = GPTDecoder().eval()
    seq = Dim("seq", min=1, max=DECODER_MAX_TOKENS)
    tokens = torch.tensor([3, 14, 15, 9, 2], dtype=torch.long)
    return model, (tokens, torch.arange(5)), {"tokens": {0: seq}, "input_pos": {0: seq}}


def run_token_by_token(step, prompt: torch.Tensor, new_tokens: int) -> list[torch.Tensor]:
    """Prefill ``prompt`` then decode ``new_tokens`` greedily, one call each.

    ``step(tokens, input_pos)`` runs the model (eager, or a loaded .pte method)
    and returns the logits; the logits of every call are returned.
    """
    logits = [step(prompt, torch.arange(len(prompt)))]
    position = len(prompt)
    for _ in range(new_tokens):
        token = logits[-1][-1].argmax().reshape(1)
        logits.append(step(token, torch.tensor([position])))
        position += 1
    return logits


#: name -> factory of the dynamic-shape models.
DYNAMIC_MODELS = {
    "dynamic_mlp": dynamic_mlp,
    "dynamic_ops": dynamic_ops,
    "gpt_decoder": gpt_decoder,
}
