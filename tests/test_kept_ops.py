"""A partitioner's ``ops_to_not_decompose`` (ExecuTorch's form): stage 1 leaves those ops
whole for it, stage 2 decomposes the kept nodes no partition took (lowering.export.kept)."""

from __future__ import annotations

import pytest
import torch

import lowering
from examples.models import mlp
from lowering.backends.reference import ReferencePartitioner
from lowering.export import KEPT
from lowering.lower import is_edge_form
from lowering.runtime import load

aten = torch.ops.aten


def ops_of(program):
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def keep_linear(check=None):
    return lambda program: ([aten.linear.default, aten.add_.Tensor], check)  # add_ mutates: never kept


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "run_decompositions"])
def test_kept_linear_stays_whole_and_marked(fast):
    model, inputs = mlp()
    program = lowering.export(model, inputs, keep=keep_linear(), fast=fast)
    linears = [n for n in program.graph.nodes if n.target is aten.linear.default]
    assert len(linears) == 3 and all(n.meta.get(KEPT) for n in linears)
    assert aten.addmm.default not in ops_of(program)
    assert is_edge_form(program)  # kept nodes are the edge form a partitioner asked for
    plain = lowering.export(model, inputs, fast=fast)
    assert aten.linear.default not in ops_of(plain) and ops_of(plain).count(aten.addmm.default) == 3


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "run_decompositions"])
def test_the_check_keeps_only_the_nodes_it_accepts(fast):
    model, inputs = mlp()
    program = lowering.export(model, inputs, keep=keep_linear(lambda node: node.name != "linear_1"), fast=fast)
    ops = ops_of(program)
    assert ops.count(aten.linear.default) == 2 and ops.count(aten.addmm.default) == 1


class KeepsLinearTakesRelu(ReferencePartitioner):
    """Asks for linear whole but takes only relu: its linears are decomposed again in stage 2."""

    def ops_to_not_decompose(self, exported_program):
        return [aten.linear.default], None


def test_kept_nodes_no_partition_took_are_decomposed_and_the_program_runs():
    model, inputs = mlp()
    result = lowering.lower(model, inputs, partitioner=KeepsLinearTakesRelu([aten.relu.default]))
    program = result.exported_program
    assert aten.linear.default not in ops_of(program) and ops_of(program).count(aten.addmm.default) == 3
    assert not any(n.meta.get(KEPT) for n in program.graph.nodes)
    torch.testing.assert_close(load(result.pte).run("forward", inputs)[0], model(*inputs))


def test_without_ops_to_not_decompose_nothing_changes():
    model, inputs = mlp()
    default = lowering.lower(model, inputs, partitioner=ReferencePartitioner([aten.relu.default]))
    assert default.pte == lowering.lower(lowering.export(model, inputs),
                                         partitioner=ReferencePartitioner([aten.relu.default])).pte
