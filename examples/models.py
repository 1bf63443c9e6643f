"""The test models of lowerflow.

Each factory returns ``(module, example_inputs)`` with deterministic weights, so
that the same factory gives the same program (and the same ``.pte`` bytes) in
any process.  They match the models in ``shared/MEASUREMENTS.md``.
"""

from __future__ import annotations

import torch
from torch import nn


def _seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def mlp():
    _seeded()
    return MLP().eval(), (torch.randn(4, 64),)


class CNN(nn.Module):
    """conv+BN+relu, pool, conv, residual conv, pool, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        x = x + torch.relu(self.conv3(x))
        x = nn.functional.avg_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


def cnn():
    _seeded()
    model = CNN().eval()
    # Non-trivial running statistics so BatchNorm is not an identity.
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-0.5, 0.5)
        model.bn1.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(1, 3, 32, 32),)


def cnn_calibration():
    """Calibration batches of :func:`cnn` for the static ``int8`` recipe (the demo fleet's
    ``cnn-int8``): 16 images like its example input, from their own seeded generator."""
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(16)]


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.fc(y)


def lstm():
    _seeded()
    return LSTMModel().eval(), (torch.randn(2, 10, 32),)


class GRUModel(nn.Module):
    """A two-layer GRU and a linear head, like :class:`LSTMModel` (not in the demo fleet)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(32, 64, num_layers=2, batch_first=True)
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        y, _ = self.gru(x)
        return self.fc(y)


def gru():
    _seeded()
    return GRUModel().eval(), (torch.randn(2, 10, 32),)


class BufferMutation(nn.Module):
    """A linear layer and a running-sum buffer updated in place on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x):
        y = self.fc(x)
        self.acc.add_(y.sum(0))
        return y * 2 + self.acc


def buffer_mutation():
    _seeded()
    return BufferMutation().eval(), (torch.randn(4, 8),)


def transformer():
    _seeded()
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0).eval()
    return layer, (torch.randn(2, 16, 64),)


class LiftedConstant(nn.Module):
    """A plain tensor attribute (not a parameter or buffer) becomes a lifted constant."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.linspace(0.5, 1.5, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * self.scale + self.scale


def lifted_constant():
    _seeded()
    return LiftedConstant().eval(), (torch.randn(3, 16),)


class MultiOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(x)
        return h + y, torch.sigmoid(h), [h * y, h - y]


def multi_output():
    _seeded()
    return MultiOutput().eval(), (torch.randn(2, 8), torch.randn(2, 8))


class IntegerInputs(nn.Module):
    """An embedding lookup by int64 indices, plus an int32 arithmetic output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)

    def forward(self, idx, counts):
        return self.emb(idx).sum(1), counts * 2 + 1


def integer_inputs():
    _seeded()
    return IntegerInputs().eval(), (
        torch.tensor([[1, 5, 7], [2, 31, 0]], dtype=torch.long),
        torch.tensor([3, 4, 5], dtype=torch.int32),
    )


class Seq2Seq(nn.Module):
    """An encoder and a decoder sharing one token embedding (the weights of two methods)."""

    def __init__(self, vocab: int = 256, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.decoder = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)


class Encode(nn.Module):
    """Method ``encode``: tokens -> memory."""

    def __init__(self, model: Seq2Seq) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model.encoder(self.model.embed(tokens))


class Decode(nn.Module):
    """Method ``decode``: (tokens, memory) -> logits."""

    def __init__(self, model: Seq2Seq) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, memory):
        h = self.model.embed(tokens) + memory.mean(1, keepdim=True)
        return self.model.head(torch.relu(self.model.decoder(h)))


def encoder_decoder():
    """Two methods over one model: ``{"encode": ..., "decode": ...}`` (one .pte, shared embedding)."""
    _seeded()
    model = Seq2Seq().eval()
    source = torch.tensor([[3, 17, 42, 255, 0, 9]], dtype=torch.long)
    target = torch.tensor([[1, 5, 7]], dtype=torch.long)
    memory = torch.randn(1, 6, 32)
    return {
        "encode": (Encode(model).eval(), (source,)),
        "decode": (Decode(model).eval(), (target, memory)),
    }


class KVCacheDecoder(nn.Module):
    """One attention layer over a KV cache held in buffers (the state ``prefill``
    writes and ``decode`` reads and extends)."""

    def __init__(self, vocab: int = 64, dim: int = 32, max_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("k_cache", torch.zeros(1, max_len, dim))
        self.register_buffer("v_cache", torch.zeros(1, max_len, dim))
        self.register_buffer("positions", torch.arange(max_len), persistent=False)
        self.scale = dim ** -0.5

    def step(self, tokens, input_pos):
        """tokens [1, T] at positions input_pos [T]: write their K/V, attend causally."""
        x = self.embed(tokens)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        self.k_cache[:, input_pos] = k
        self.v_cache[:, input_pos] = v
        scores = torch.matmul(q, self.k_cache.transpose(1, 2)) * self.scale
        visible = self.positions.unsqueeze(0) <= input_pos.unsqueeze(1)
        scores = scores.masked_fill(torch.logical_not(visible), float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1), self.v_cache)
        return self.head(self.wo(attended) + x)


class Prefill(nn.Module):
    """Method ``prefill``: a prompt [1, T] at positions 0..T-1 -> logits [1, T, vocab]."""

    def __init__(self, model: KVCacheDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model.step(tokens, self.model.positions[: tokens.shape[1]])


class DecodeStep(nn.Module):
    """Method ``decode``: one token [1, 1] at position pos [1] -> logits [1, 1, vocab]."""

    def __init__(self, model: KVCacheDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, token, pos):
        return self.model.step(token, pos)


def kv_cache_decoder():
    """``prefill`` and ``decode`` sharing one KV cache (lower with share_mutable_buffers=True)."""
    _seeded()
    model = KVCacheDecoder().eval()
    return {
        "prefill": (Prefill(model).eval(), (torch.tensor([[3, 17, 42, 5, 9]], dtype=torch.long),)),
        "decode": (DecodeStep(model).eval(), (torch.tensor([[7]]), torch.tensor([5]))),
    }


kv_cache_decoder.share_mutable_buffers = True  # what a model spec reads (tasks.model_spec)


#: name -> factory of several methods ({method: (module, example_inputs)}).
METHOD_MODELS = {
    "encoder_decoder": encoder_decoder,
    "kv_cache_decoder": kv_cache_decoder,
}


class CondLinear(nn.Module):
    """``torch.cond`` on the data (the sign of ``x.sum()``): each branch a linear layer
    (an addmm a backend takes) and an elementwise op."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(16, 16)
        self.neg = nn.Linear(16, 16)

    def forward(self, x):
        def positive(x):
            return torch.relu(self.pos(x))

        def negative(x):
            return self.neg(x) * 2.0

        return torch.cond(x.sum() > 0, positive, negative, (x,)) + 1.0


def cond_linear():
    """Example inputs take the true branch; ``-inputs`` takes the false one."""
    _seeded()
    return CondLinear().eval(), (torch.rand(4, 16) + 0.1,)


class MapLinear(nn.Module):
    """``torch.map`` over the first dimension of ``xs``: a linear layer per slice plus ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, xs, y):
        def body(x, y):
            return torch.relu(self.fc(x)) + y

        return torch._higher_order_ops.map(body, xs, y)


def map_linear():
    _seeded()
    return MapLinear().eval(), (torch.randn(5, 4, 16), torch.randn(4, 8))


#: Models with control flow (torch.cond / torch.map), by name; not in the demo fleet.
CONTROL_FLOW_MODELS = {
    "cond_linear": cond_linear,
    "map_linear": map_linear,
}


#: name -> factory, the demo fleet and the suite the tests and benchmarks run over.
MODELS = {
    "mlp": mlp,
    "cnn": cnn,
    "lstm": lstm,
    "buffer_mutation": buffer_mutation,
    "transformer": transformer,
    "lifted_constant": lifted_constant,
    "multi_output": multi_output,
    "integer_inputs": integer_inputs,
}
