"""Issue 27: :func:`lowering.partition_proposal.propose_partitions` finds torch.fx's
``CapabilityBasedPartitioner`` partitions (same node sets, same order) without its quadratic
cost: on real exported programs (an MLP, a CNN, an 8da4w MLP, a tiny Llama decoder fp32 and
8da4w) with XNNPACK's and the reference backend's support, on a program where merging every
supported node would make a cycle, and on random graphs with getitems and cycles.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import nn
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from lowering import export
from lowering.backends.reference import ReferencePartitioner
from lowering.backends.xnnpack import XnnpackPartitioner
from lowering.partition import OpSupportPartitioner, partition, partition_tags_of
from lowering.partition_proposal import propose_partitions


class _Support(OperatorSupportBase):
    def __init__(self, is_supported) -> None:
        self.is_supported = is_supported

    def is_node_supported(self, submodules, node) -> bool:
        return self.is_supported(node)


def fx_partitions(graph_module, is_supported, single: bool):
    return CapabilityBasedPartitioner(graph_module, _Support(is_supported),
                                      allows_single_node_partition=single).propose_partitions()


def as_names(partitions) -> list[list[tuple[str, int | None]]]:
    return [[(node.name, order) for node, order in part.nodes.items()] for part in partitions]


class FxSearch:
    """A partitioner's partitions as torch.fx finds them: ``propose`` replaced by fx's."""

    def propose(self, graph_module, is_supported):
        return fx_partitions(graph_module, is_supported, self.allows_single_node_partition)


class FxXnnpack(FxSearch, XnnpackPartitioner):
    pass


class FxReference(FxSearch, ReferencePartitioner):
    pass


def tags_both_ways(program, ours, theirs) -> tuple[dict, dict]:
    return partition_tags_of(partition(program, ours).tagged_exported_program.graph), \
        partition_tags_of(partition(program, theirs).tagged_exported_program.graph)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


class Detour(nn.Module):
    """``a = x @ w1``, ``b = sort(a)`` (XNNPACK has no sort), ``out = b @ w2 + a``: a and the
    last linear are both supported, but one partition of them would wrap the sort: a cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a = torch.relu(self.w1(x))
        b = torch.sort(a, dim=-1).values
        return self.w2(b) + a


def program(name: str):
    from lowering.quantize import quantize

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    if name == "cnn":
        return export(CNN().eval(), (torch.randn(1, 3, 8, 8),))
    if name == "detour":
        return export(Detour().eval(), (torch.randn(2, 8),))
    exported = export(mlp, (torch.randn(2, 64),))
    return quantize(exported, "8da4w") if name == "mlp-8da4w" else exported


@pytest.mark.parametrize("name", ["mlp", "cnn", "detour", "mlp-8da4w"])
def test_xnnpack_and_reference_tags_equal_torch_fx_on_real_programs(name):
    candidate = program(name)
    for ours, theirs in ((XnnpackPartitioner(), FxXnnpack()), (ReferencePartitioner(), FxReference())):
        mine, fx = tags_both_ways(candidate, ours, theirs)
        assert mine == fx, (type(ours).__name__, mine, fx)
        if isinstance(ours, XnnpackPartitioner):
            assert mine, "nothing tagged: the comparison proves nothing"
            if name == "detour":
                assert len(set(mine.values())) >= 2, mine  # the cycle kept the linears apart


def test_a_tiny_llama_decoder_partitions_as_torch_fx_fp32_and_8da4w():
    transformers = pytest.importorskip("transformers")
    from lowering.hf import load_hf
    from lowering.quantize import quantize

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)).eval()
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        module, inputs, dynamic = load_hf(directory, "text-generation", max_seq_len=16).methods["forward"]
        program = export(module, inputs, dynamic_shapes=dynamic)
    for recipe in (None, "8da4w"):
        candidate = program if recipe is None else quantize(program, recipe)
        mine, fx = tags_both_ways(candidate, XnnpackPartitioner(), FxXnnpack())
        assert mine == fx, recipe
        assert len(set(mine.values())) >= 2, "a decoder with a KV cache has several partitions"


def random_graph(seed: int, size: int):
    """A random DAG of adds, cats, relus and splits (with getitems), each node supported or not."""
    rng = random.Random(seed)
    graph = torch.fx.Graph()
    values = [graph.placeholder(f"x{i}") for i in range(rng.randint(1, 3))]
    supported: dict[torch.fx.Node, bool] = {}
    for _ in range(size):
        args = [rng.choice(values[-6:] if rng.random() < 0.8 else values) for _ in range(rng.choice([1, 2, 3]))]
        if rng.random() < 0.1:
            split = graph.call_function(torch.ops.aten.split.Tensor, (args[0], 1))
            supported[split] = rng.random() < 0.7
            values += [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
            continue
        target = {1: torch.ops.aten.relu.default, 2: torch.ops.aten.add.Tensor, 3: torch.ops.aten.cat.default}
        node = graph.call_function(target[len(args)], (args,) if len(args) == 3 else tuple(args))
        supported[node] = rng.random() < 0.7
        values.append(node)
    graph.output(tuple(values[-3:]))

    def is_supported(node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        return supported.get(node.args[0] if node.target is operator.getitem else node, False)

    return torch.fx.GraphModule(nn.Module(), graph), is_supported


@pytest.mark.parametrize("single", [True, False])
def test_random_graphs_partition_as_torch_fx(single):
    for seed in range(60):
        graph_module, is_supported = random_graph(seed, random.Random(seed).randint(3, 60))
        expected = as_names(fx_partitions(graph_module, is_supported, single))
        assert as_names(propose_partitions(graph_module, is_supported, allows_single_node_partition=single)) \
            == expected, seed


def test_a_merge_that_would_wrap_an_unsupported_node_is_refused():
    """Before:: a ─► b ─► c, a ─► c (b unsupported)   After:: {c}, {a}: a+c would wrap b."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    b = graph.call_function(torch.ops.aten.sigmoid.default, (a,))
    c = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    graph.output((c,))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    parts = propose_partitions(gm, lambda n: n.op == "call_function" and n is not b,
                               allows_single_node_partition=True)
    assert sorted(sorted(n.name for n in p.nodes) for p in parts) == [["add_tensor"], ["relu_default"]]


def test_op_support_partitioner_searches_with_propose_partitions():
    assert OpSupportPartitioner.propose is not FxSearch.propose
    assert XnnpackPartitioner().propose.__func__ is OpSupportPartitioner.propose
