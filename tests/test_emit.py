"""lowering.emit: our .pte files, run by ExecuTorch's runtime and by ours, read by ExecuTorch's deserializer."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_structure, tree_unflatten, treespec_loads

from examples.models import MODELS
from lowering.emit import build_pte, emit_program
from lowering.errors import EmitError
from lowering.export import export
from lowering.memory_plan import MemoryPlan, memory_plan
from lowering.pte import deserialize, schema
from lowering.runtime import load

from ._interop import assert_all_close, eager_outputs, executorch_pte, model_and_inputs, run_in_executorch

pytest.importorskip("executorch")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def programs():
    """name -> (edge program, memory plan, .pte bytes) for every model, built once."""
    built = {}
    for name in MODELS:
        model, inputs = model_and_inputs(name)
        ep = export(model, inputs)
        plan = memory_plan(ep)
        built[name] = (ep, plan, emit_program(ep, plan))
    return built


@pytest.mark.parametrize("name", sorted(MODELS))
def test_runs_in_executorch_runtime(programs, name):
    _, inputs = model_and_inputs(name)
    [outputs] = run_in_executorch(programs[name][2], inputs)
    assert_all_close(outputs, eager_outputs(name))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_runs_in_our_executor(programs, name):
    _, inputs = model_and_inputs(name)
    assert_all_close(load(programs[name][2]).run("forward", list(inputs)), eager_outputs(name))


def _two_eager_calls(model, inputs):
    with torch.no_grad():
        return [[model(*inputs)], [model(*inputs)]]


def test_buffer_state_persists_across_calls_in_executorch(programs):
    model, inputs = MODELS["buffer_mutation"]()
    expected = _two_eager_calls(model, inputs)
    first, second = run_in_executorch(programs["buffer_mutation"][2], inputs, calls=2)
    assert_all_close(first, expected[0])
    assert_all_close(second, expected[1])
    assert not torch.allclose(first[0], second[0])


def test_buffer_state_persists_across_calls_in_our_executor(programs):
    model, inputs = MODELS["buffer_mutation"]()
    expected = _two_eager_calls(model, inputs)
    program = load(programs["buffer_mutation"][2])
    assert_all_close(program.run("forward", list(inputs)), expected[0])
    assert_all_close(program.run("forward", list(inputs)), expected[1])


class _NonZeroState(torch.nn.Module):
    """A mutated buffer whose initial value is not zero (a zeroed arena would give wrong numbers)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.arange(4, dtype=torch.float32) + 10)

    def forward(self, x):
        self.state.mul_(x)
        return self.state + 1


def test_mutated_buffer_starts_from_its_initial_value():
    x = torch.tensor([2.0, 3.0, 0.5, -1.0])
    ep = export(_NonZeroState(), (x,))
    pte = emit_program(ep, memory_plan(ep))
    eager = _NonZeroState()
    expected = _two_eager_calls(eager, (x,))
    assert_all_close(run_in_executorch(pte, (x,), calls=2)[1], expected[1])
    program = load(pte)
    program.run("forward", [x])
    assert_all_close(program.run("forward", [x]), expected[1])


def test_multi_output_structure_matches_eager_and_executorch(programs):
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = programs["multi_output"][2]
    ours = deserialize_pte_binary(pte).program.execution_plan[0].container_meta_type
    theirs = deserialize_pte_binary(executorch_pte("multi_output")).program.execution_plan[0].container_meta_type
    assert ours.encoded_inp_str == theirs.encoded_inp_str
    assert ours.encoded_out_str == theirs.encoded_out_str
    model, inputs = model_and_inputs("multi_output")
    with torch.no_grad():
        eager = model(*inputs)
    [flat] = run_in_executorch(pte, inputs)
    structured = tree_unflatten(flat, treespec_loads(ours.encoded_out_str))
    assert tree_structure(structured) == tree_structure(eager)
    assert isinstance(structured, tuple) and isinstance(structured[2], list)
    torch.testing.assert_close(structured[2][1], eager[2][1])


def test_executorch_deserializer_reads_operators_and_plan(programs):
    from executorch.exir._serialize._program import deserialize_pte_binary

    ep, plan, pte = programs["cnn"]
    program = deserialize_pte_binary(pte).program
    [method] = program.execution_plan
    operators = {(op.name, op.overload) for op in method.operators}
    assert {("aten::convolution", "out"), ("aten::max_pool2d_with_indices", "out"), ("aten::add", "out")} <= operators
    assert list(method.non_const_buffer_sizes) == list(plan.arena_sizes)
    assert len(method.inputs) == 1 and len(method.outputs) == 1


def test_identical_constants_are_stored_once():
    class TwinLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight)
                self.b.bias.copy_(self.a.bias)

        def forward(self, x):
            return self.a(x) - self.b(x)

    x = torch.randn(2, 16)
    ep = export(TwinLinear(), (x,))
    pte = build_pte(ep, memory_plan(ep))
    assert len(pte.constants) == 1 + 2  # reserved entry + one weight + one bias
    assert_all_close(load(emit_program(ep, memory_plan(ep))).run("forward", [x]), [torch.zeros(2, 16)], atol=1e-6)


def test_emitted_sizes_are_close_to_executorch(programs):
    for name, (_, _, pte) in programs.items():
        theirs = len(executorch_pte(name))
        assert abs(len(pte) - theirs) <= max(1024, theirs // 20), (name, len(pte), theirs)


_EMIT_SCRIPT = textwrap.dedent(
    """
    import hashlib
    from examples.models import MODELS
    from lowering.export import export
    from lowering.memory_plan import memory_plan
    from lowering.emit import emit_program
    for name in ("cnn", "buffer_mutation", "multi_output"):
        model, inputs = MODELS[name]()
        ep = export(model, inputs)
        print(name, hashlib.sha256(emit_program(ep, memory_plan(ep))).hexdigest())
    """
)


def test_byte_identical_across_processes(programs):
    runs = [
        subprocess.run([sys.executable, "-c", _EMIT_SCRIPT], cwd=REPO, capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    in_process = {name: hashlib.sha256(programs[name][2]).hexdigest() for name in ("cnn", "buffer_mutation", "multi_output")}
    assert dict(line.split() for line in runs[0].splitlines()) == in_process


def test_dynamic_shapes_are_a_clear_error():
    model, inputs = MODELS["mlp"]()
    batch = torch.export.Dim("batch", min=2, max=16)
    ep = export(model, inputs, dynamic_shapes=({0: batch},))
    empty_plan = MemoryPlan(out_variants={}, allocations={}, arena_sizes=(0, 0), lower_bound=0, algorithm="none")
    with pytest.raises(EmitError, match=r"node 'x'.*dynamic shapes are not yet supported"):
        emit_program(ep, empty_plan)


def test_missing_out_variant_names_the_node(programs):
    ep, plan, _ = programs["mlp"]
    data = plan.to_dict()
    victim = next(name for name in data["out_variants"] if name.startswith("addmm"))
    del data["out_variants"][victim]
    with pytest.raises(EmitError, match=f"node '{victim}'.*no out variant"):
        emit_program(ep, MemoryPlan.from_dict(data))


def test_missing_allocation_names_the_value(programs):
    ep, plan, _ = programs["mlp"]
    data = plan.to_dict()
    del data["allocations"]["relu"]
    with pytest.raises(EmitError, match="no allocation for value 'relu'"):
        emit_program(ep, MemoryPlan.from_dict(data))
