"""lowering.lower: one call from a model (or exported program) to a runnable .pte."""

from __future__ import annotations

import pytest
import torch

from examples.models import MODELS
from lowering import OpSupportPartitioner
from lowering.backends.reference import BACKEND_ID, ReferenceRuntime
from lowering.errors import LoweringError
from lowering.export import export
from lowering.lower import STAGES, LowerResult, is_edge_form, lower
from lowering.runtime import load, register_backend_runtime, unregister_backend_runtime

from ._interop import assert_all_close, eager_outputs, model_and_inputs, run_in_executorch


@pytest.fixture(scope="module")
def results():
    """name -> LowerResult of every test model, lowered once."""
    out = {}
    for name in MODELS:
        model, inputs = model_and_inputs(name)
        out[name] = lower(model, inputs)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_pte_runs_in_executorch_and_matches_eager(results, name):
    pytest.importorskip("executorch.runtime")
    _, inputs = model_and_inputs(name)
    [outputs] = run_in_executorch(results[name].pte, inputs)
    assert_all_close(outputs, eager_outputs(name))


def test_result_reports_plan_and_stage_timings(results):
    for name, result in results.items():
        assert isinstance(result, LowerResult)
        assert result.pte[4:8] == b"ET12", name
        assert list(result.timings) == list(STAGES)
        assert all(seconds >= 0 for seconds in result.timings.values())
        assert result.timings["to_backend"] == 0.0
        assert result.arena_bytes == result.memory_plan.arena_sizes[1]
        assert result.lower_bound == result.memory_plan.lower_bound <= result.arena_bytes


def test_same_model_gives_identical_bytes(results):
    model, inputs = MODELS["cnn"]()
    assert lower(model, inputs).pte == results["cnn"].pte


def test_edge_program_is_used_as_is():
    model, inputs = model_and_inputs("transformer")
    program = export(model, inputs)
    result = lower(program)
    assert result.exported_program is program
    assert_all_close(load(result.pte).run("forward", list(inputs)), eager_outputs("transformer"))


def test_raw_exported_program_is_brought_to_edge_form():
    model, inputs = MODELS["cnn"]()
    raw = torch.export.export(model, inputs, strict=False)
    assert not is_edge_form(raw)
    result = lower(raw)
    assert is_edge_form(result.exported_program)
    assert_all_close(load(result.pte).run("forward", list(inputs)), eager_outputs("cnn"))


@pytest.fixture
def reference_runtime():
    register_backend_runtime(BACKEND_ID, ReferenceRuntime())
    yield
    unregister_backend_runtime(BACKEND_ID)


@pytest.mark.parametrize("name", ["mlp", "cnn", "multi_output"])
def test_partitioner_delegates_and_the_program_still_runs(reference_runtime, name):
    model, inputs = MODELS[name]()
    supported = [torch.ops.aten.addmm.default, torch.ops.aten.relu.default, torch.ops.aten.add.Tensor]
    result = lower(model, inputs, partitioner=OpSupportPartitioner(BACKEND_ID, supported))
    delegate_calls = [
        n for n in result.exported_program.graph.nodes if "executorch_call_delegate" in str(n.target)
    ]
    assert delegate_calls and result.timings["to_backend"] > 0
    for call in delegate_calls:
        assert call.name not in result.memory_plan.out_variants
        assert f"{call.name}.0" in result.memory_plan.allocations
    assert_all_close(load(result.pte).run("forward", list(inputs)), eager_outputs(name))


def test_bad_arguments_are_errors():
    model, inputs = MODELS["mlp"]()
    with pytest.raises(LoweringError, match="needs example_inputs"):
        lower(model)
    with pytest.raises(LoweringError, match="only for a module"):
        lower(export(model, inputs), inputs)
    with pytest.raises(LoweringError, match="expected a torch.nn.Module or an ExportedProgram"):
        lower("mlp.pt2", inputs)
