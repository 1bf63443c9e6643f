"""Dynamic shapes (torch.export.Dim ranges) through every stage, target and runtime.

The programs are lowered by lowerflow and run at several sizes inside the
dims' ranges by ExecuTorch's runtime (the oracle) and by lowerflow's executor,
on one loaded method, against eager.  The GPT decoder is run token by token:
a prompt prefilled in one call, then single-token calls on the same method,
its KV cache in mutable buffers.
"""

from __future__ import annotations

import copy
import gc
import json
import warnings
from pathlib import Path

import pytest
import torch

import lowering
from examples.dynamic_models import DECODER_MAX_TOKENS, DYNAMIC_MODELS, run_token_by_token
from lowering.dynamic import (
    DynamicShapeError,
    check_against_inputs,
    dynamic_shapes_from_json,
    dynamic_shapes_to_json,
    dynamic_dims,
    inputs_at_sizes,
)
from lowering.errors import ExportError, MemoryPlanError
from lowering.pte import deserialize
from lowering.pte.format import decode_string
from lowering.pte.generated import program_generated as fb
from lowering.runtime import ExecutorError, load
from lowering.targets import partitioner_for
from lowering.verify import verify
from tests._interop import ExecutorchMethod
from tests._lowering import executions_during as _executions_during

pytest.importorskip("executorch")

REPO = Path(__file__).resolve().parents[1]
DYNAMIC = REPO / "examples" / "dynamic_models.py"


def _lower(name, target="portable"):
    model, inputs, dynamic_shapes = DYNAMIC_MODELS[name]()
    partitioner = None if target == "portable" else partitioner_for(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lowering.lower(copy.deepcopy(model), inputs, dynamic_shapes=dynamic_shapes,
                                partitioner=partitioner)
    return model, inputs, dynamic_shapes, result


@pytest.fixture(scope="module")
def lowered():
    """(model, inputs, dynamic_shapes, LowerResult) per (model name, target), built once."""
    cache = {}

    def get(name, target="portable"):
        if (name, target) not in cache:
            cache[name, target] = _lower(name, target)
        return cache[name, target]

    return get


def _flat(out):
    return torch.utils._pytree.tree_leaves(out)


def _assert_same(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        if isinstance(e, torch.Tensor):
            assert a.shape == e.shape and a.dtype == e.dtype, (what, i, a.shape, e.shape)
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4, msg=f"{what} output {i}")
        else:
            assert a == e, (what, i, a, e)


def _sized(inputs, n):
    """The dynamic_ops / dynamic_mlp inputs with the dynamic first dim of input 0 at ``n``."""
    x = torch.randn(n, *inputs[0].shape[1:], generator=torch.Generator().manual_seed(n))
    return (x, *inputs[1:])


# --------------------------------------------------------------------------- the program


def test_dynamic_tensors_are_dynamic_bound_at_the_upper_bound(lowered):
    model, inputs, dynamic_shapes, result = lowered("dynamic_mlp")
    plan = deserialize(result.pte).program.executionPlan[0]
    x = plan.values[plan.inputs[0]].val
    assert x.shapeDynamism == fb.TensorShapeDynamism.DYNAMIC_BOUND
    assert list(x.sizes) == [32, 64]  # batch at its max
    out = plan.values[plan.outputs[0]].val
    assert out.shapeDynamism == fb.TensorShapeDynamism.DYNAMIC_BOUND and list(out.sizes) == [32, 10]
    constants = [v.val for v in plan.values if v.valType == fb.KernelTypes.Tensor and v.val.allocationInfo is None
                 and v.val.dataBufferIdx]
    assert constants and all(c.shapeDynamism == fb.TensorShapeDynamism.STATIC for c in constants)
    # Memory is planned at the upper bound: the same arena as the program exported at batch 32.
    static = lowering.lower(copy.deepcopy(model), (torch.randn(32, 64),))
    assert result.memory_plan.arena_bytes == static.memory_plan.arena_bytes
    assert result.memory_plan.allocations["x"].size == 32 * 64 * 4


def test_symbolic_ints_are_runtime_prim_ops(lowered):
    _, _, _, result = lowered("dynamic_ops")
    plan = deserialize(result.pte).program.executionPlan[0]
    operators = {(decode_string(op.name), decode_string(op.overload)) for op in plan.operators}
    # x.shape[0] -> aten::sym_size.int; n + 1 -> executorch_prim::add.Scalar; the SymInt
    # multiplying a tensor -> aten::scalar_tensor.out (the kernel's schema wants a Tensor).
    assert {("aten::sym_size", "int"), ("executorch_prim::add", "Scalar"), ("aten::scalar_tensor", "out")} <= operators
    from executorch.runtime import Runtime

    registered = set(Runtime.get().operator_registry.operator_names)
    assert {f"{n}.{o}" if o else n for n, o in operators} <= registered


def test_an_unbounded_dim_is_a_clear_error_naming_the_input():
    model, inputs, _ = DYNAMIC_MODELS["dynamic_mlp"]()
    with pytest.raises(ExportError, match=r"input 'x' dim 0 .*no upper bound; give its torch.export.Dim a max"):
        lowering.export(model, inputs, dynamic_shapes={"x": {0: torch.export.Dim("batch")}})


def test_memory_plan_of_an_unbounded_program_names_the_value():
    """A program exported elsewhere (not through lowering.export) with an unbounded dim."""
    from lowering.export import to_edge
    from lowering.memory_plan import memory_plan

    model, inputs, _ = DYNAMIC_MODELS["dynamic_mlp"]()
    exported = torch.export.export(model, inputs, dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    with pytest.raises(ExportError, match="no upper bound"):
        to_edge(exported)
    edge = exported.run_decompositions()
    with pytest.raises(MemoryPlanError, match=r"value 'x' dim 0 .*no upper bound.*a max"):
        memory_plan(edge)


def test_dynamic_dims_name_the_inputs_and_ranges(lowered):
    _, _, _, result = lowered("gpt_decoder")
    dims = dynamic_dims(result.exported_program)
    assert [(d.input_name, d.dim, d.max) for d in dims] == [("tokens", 0, 16), ("input_pos", 0, 16)]
    assert dims[0].symbol == dims[1].symbol  # one Dim named "seq" for both
    assert dims[0].min in (1, 2)  # torch keeps min=1 in range_constraints (hints start at 2)


# --------------------------------------------------------------------------- running at several sizes


@pytest.mark.parametrize("name", ["dynamic_mlp", "dynamic_ops"])
@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_executorch_runs_every_size_in_the_range_on_one_method(lowered, name, target):
    model, inputs, _, result = lowered(name, target)
    high = 32 if name == "dynamic_mlp" else 24
    sizes = [high, 1, 7, inputs[0].shape[0], 2, high]  # largest first, then down and up again
    executorch, ours = ExecutorchMethod(result.pte), load(result.pte).method("forward")
    for n in sizes:
        sized = _sized(inputs, n)
        with torch.no_grad():
            expected = _flat(model(*sized))
        _assert_same(list(executorch.execute(list(sized))), expected, f"executorch {name} {target} n={n}")
        _assert_same(ours.execute(list(sized)), expected, f"lowerflow {name} {target} n={n}")


def test_reference_backend_runs_dynamic_partitions_in_our_executor(lowered):
    model, inputs, _, result = lowered("dynamic_ops", "reference")
    delegates = [n for n in result.exported_program.graph.nodes if "call_delegate" in str(n.target)]
    assert delegates  # the dynamic addmm/relu/view partition and the static branch
    method = load(result.pte).method("forward")
    for n in (24, 1, 5, 13):
        sized = _sized(inputs, n)
        with torch.no_grad():
            expected = _flat(model(*sized))
        _assert_same(method.execute(list(sized)), expected, f"reference n={n}")


def test_xnnpack_delegates_dynamic_elementwise_and_fc_and_refuses_the_rest_in_its_partitioner(lowered):
    from lowering.backends.xnnpack.partitioner import XnnpackPartitioner
    from lowering.backends.xnnpack.preprocess import Context

    model, inputs, dynamic_shapes = DYNAMIC_MODELS["dynamic_ops"]()
    program = lowering.export(model, inputs, dynamic_shapes=dynamic_shapes)
    partitioner = XnnpackPartitioner()
    partitioner._ctx = Context(program)
    reasons = {n.name: partitioner.unsupported_reason(n) for n in program.graph.nodes if n.op == "call_function"}
    # x @ W + b and relu at a dynamic batch: XNNPACK reshapes them at run time.
    assert reasons["addmm"] is None and reasons["relu"] is None
    # A view to one symbolic size: its size is -1 in the edge form, XNNPACK's reshape infers it (0).
    assert reasons["view"] is None and program.graph.find_nodes(
        op="call_function", target=torch.ops.aten.view_copy.default)[0].args[1] == [-1, 2, 4]
    assert reasons["addmm_1"] is None  # the static branch
    _, _, _, result = lowered("dynamic_ops", "xnnpack")
    plan = deserialize(result.pte).program.executionPlan[0]
    assert len(plan.delegates) == 2
    operators = {decode_string(op.name) for op in plan.operators}
    assert "aten::view_copy" not in operators and "aten::addmm" not in operators


def test_xnnpack_refuses_softmax_over_a_symbolic_dim():
    from lowering.backends.xnnpack.partitioner import XnnpackPartitioner
    from lowering.backends.xnnpack.preprocess import Context

    class Softmaxes(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=0), torch.softmax(x, dim=1)

    program = lowering.export(Softmaxes(), (torch.randn(4, 8),),
                              dynamic_shapes={"x": {0: torch.export.Dim("n", min=1, max=16)}})
    partitioner = XnnpackPartitioner()
    partitioner._ctx = Context(program)
    softmaxes = [n for n in program.graph.nodes if n.target is torch.ops.aten._softmax.default]
    assert [partitioner.unsupported_reason(n) for n in softmaxes] == [
        "dynamic shape: softmax over a symbolic dim", None]


def test_a_size_above_the_max_is_refused_by_our_executor(lowered):
    _, inputs, _, result = lowered("dynamic_mlp")
    method = load(result.pte).method("forward")
    with pytest.raises(ExecutorError, match="exceeds the upper bound"):
        method.execute([torch.randn(33, 64)])


def test_same_bytes_in_another_process(lowered):
    import subprocess
    import sys

    _, _, _, result = lowered("gpt_decoder")
    code = (
        "import hashlib, sys, warnings; warnings.simplefilter('ignore');"
        "import lowering; from examples.dynamic_models import gpt_decoder;"
        "m, i, d = gpt_decoder(); sys.stdout.write(hashlib.sha256(lowering.lower(m, i, dynamic_shapes=d).pte).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == __import__("hashlib").sha256(result.pte).hexdigest()


# --------------------------------------------------------------------------- the decoder


PROMPT = torch.tensor([3, 14, 15, 9, 2, 6, 5], dtype=torch.long)


@pytest.mark.parametrize("target", ["portable", "xnnpack", "reference"])
def test_gpt_decoder_token_by_token_matches_eager(lowered, target):
    """Prefill 7 tokens, then 8 single-token steps on one loaded method: the KV cache
    (mutable buffers) carries over in the runtime as in eager."""
    model, _, _, result = lowered("gpt_decoder", target)
    eager = copy.deepcopy(model)
    with torch.no_grad():
        expected = run_token_by_token(eager, PROMPT, 8)
    assert [tuple(e.shape) for e in expected] == [(7, 64)] + [(1, 64)] * 8
    runners = {"lowerflow": load(result.pte).method("forward")}
    if target != "reference":  # ExecuTorch's runtime has no ReferenceBackend
        runners["executorch"] = ExecutorchMethod(result.pte)
    for runtime, method in runners.items():
        call = (lambda m: lambda t, p: list(m.execute([t, p]))[0])(method)
        actual = run_token_by_token(call, PROMPT, 8)
        for step, (a, e) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=f"{runtime} {target} step {step}")
    # The greedy continuation is the same token sequence.
    tokens = [int(e[-1].argmax()) for e in expected]
    assert tokens == [int(a[-1].argmax()) for a in actual]


def test_gpt_decoder_prefill_at_the_longest_prompt(lowered):
    model, _, _, result = lowered("gpt_decoder")
    prompt = torch.arange(DECODER_MAX_TOKENS) % 64
    eager = copy.deepcopy(model)
    with torch.no_grad():
        expected = run_token_by_token(eager, prompt, 2)
    method = ExecutorchMethod(result.pte)
    actual = run_token_by_token(lambda t, p: list(method.execute([t, p]))[0], prompt, 2)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- verify


def test_verify_runs_the_smallest_and_largest_sizes(lowered):
    model, inputs, dynamic_shapes, result = lowered("gpt_decoder")
    report = verify(result.pte, model, inputs, dynamic_shapes=dynamic_shapes)
    assert report.ok, report.to_dict()
    runs = {(c.runtime, c.inputs) for c in report.checks}
    assert runs == {(r, s) for r in ("lowerflow", "executorch") for s in ("example", "seq=1", "seq=16")}


def test_verify_catches_a_program_wrong_only_at_another_size(lowered):
    """A program exported statically at batch 4 passes at the example but not at 1 or 32."""
    model, inputs, dynamic_shapes, _ = lowered("dynamic_mlp")
    static = lowering.lower(copy.deepcopy(model), inputs).pte
    report = verify(static, model, inputs, dynamic_shapes=dynamic_shapes)
    by_size = {(c.runtime, c.inputs): c.ok for c in report.checks}
    assert by_size[("lowerflow", "example")] and by_size[("executorch", "example")]
    assert not by_size[("lowerflow", "batch=1")] and not by_size[("executorch", "batch=32")]
    assert not report.ok


def test_inputs_at_sizes_repeat_the_example_values():
    model, inputs, dynamic_shapes = DYNAMIC_MODELS["gpt_decoder"]()
    sets = dict(inputs_at_sizes(model, inputs, dynamic_shapes))
    assert list(sets) == ["example", "seq=1", "seq=16"]
    tokens, positions = sets["seq=16"]
    assert tokens.shape == positions.shape == (16,)
    assert torch.equal(tokens[:5], inputs[0]) and torch.equal(tokens[5:10], inputs[0])


# --------------------------------------------------------------------------- the JSON form


def test_json_form_round_trips_and_shares_dims_by_name():
    doc = {"tokens": {"0": {"name": "seq", "min": 1, "max": 16}}, "input_pos": {0: {"name": "seq", "max": 16}}}
    shapes = dynamic_shapes_from_json(doc)
    assert shapes["tokens"][0] is shapes["input_pos"][0]
    assert dynamic_shapes_to_json(shapes) == {
        "tokens": {"0": {"name": "seq", "min": 1, "max": 16}},
        "input_pos": {"0": {"name": "seq", "min": 1, "max": 16}},
    }
    by_position = dynamic_shapes_from_json([{"1": {"name": "n", "min": 2, "max": 8}}, None])
    assert by_position[0][1].max == 8 and by_position[1] is None
    _, _, factory_shapes = DYNAMIC_MODELS["gpt_decoder"]()
    assert dynamic_shapes_to_json(factory_shapes)["tokens"] == {"0": {"name": "seq", "min": 1, "max": 16}}


@pytest.mark.parametrize("doc, fragment", [
    ({"x": {"0": {"name": "b", "min": 1}}}, "max required"),
    ({"x": {"0": {"name": "b", "min": 9, "max": 4}}}, "min 9 > max 4"),
    ({"x": {"first": {"name": "b", "max": 4}}}, "dim index 'first' is not an integer"),
    ({"x": {"0": {"name": "b", "max": 4}}, "y": {"0": {"name": "b", "max": 8}}}, "given twice with different ranges"),
    ({"x": {"0": {"name": "not a name", "max": 4}}}, "is not an identifier"),
    ({"x": {"0": {"name": "b", "max": "many"}}}, "max 'many' is not a non-negative integer"),
    ("batch", "expected a mapping by argument name or a list by position"),
])
def test_bad_json_forms_name_the_entry(doc, fragment):
    with pytest.raises(DynamicShapeError, match="dynamic_shapes") as info:
        dynamic_shapes_from_json(doc)
    assert fragment in str(info.value)


def test_a_dim_without_max_has_no_json_form():
    with pytest.raises(DynamicShapeError, match=r"Dim 'batch' has no max"):
        dynamic_shapes_to_json({"x": {0: torch.export.Dim("batch")}})


def test_spec_is_checked_against_forward_and_the_example_inputs():
    model, inputs, _ = DYNAMIC_MODELS["dynamic_mlp"]()
    with pytest.raises(DynamicShapeError, match=r"'y' is not an argument of forward \(arguments: x\)"):
        check_against_inputs(dynamic_shapes_from_json({"y": {"0": {"name": "b", "max": 8}}}), model, inputs)
    with pytest.raises(DynamicShapeError, match=r"input 'x' dim 0 is 4 in the example inputs, outside Dim 'b'"):
        check_against_inputs(dynamic_shapes_from_json({"x": {"0": {"name": "b", "min": 1, "max": 3}}}), model, inputs)
    with pytest.raises(DynamicShapeError, match=r"input 'x' has 2 dims, no dim 5"):
        check_against_inputs(dynamic_shapes_from_json({"x": {"5": {"name": "b", "max": 8}}}), model, inputs)


# --------------------------------------------------------------------------- flows, cache keys, manifest, CLI




def _pte_bytes(manifest, target):
    import fsspec

    with fsspec.open(manifest["targets"][target]["pte"]["uri"], "rb") as f:
        return f.read()


def _input_bound(pte: bytes) -> list[int]:
    plan = deserialize(pte).program.executionPlan[0]
    return list(plan.values[plan.inputs[0]].val.sizes)


def test_flow_lowers_a_dynamic_factory_and_a_new_max_re_exports_and_re_plans(fresh_stages, tmp_path):
    from flows.lower_model import lower_model

    store, spec = str(tmp_path / "store"), f"{DYNAMIC}:dynamic_mlp"
    first, ran = _executions_during(lower_model, spec, ["portable", "reference"], store=store)
    assert ran["export"] == 1 and ran["memory_plan"] == 2 and ran["verify"] == 2
    for target in ("portable", "reference"):
        checks = first["targets"][target]["verify"]["checks"]
        assert {c["inputs"] for c in checks} == {"example", "batch=1", "batch=32"}, checks
        assert all(c["ok"] for c in checks if c["skipped"] is None)
    portable = _pte_bytes(first, "portable")
    assert _input_bound(portable) == [32, 64]
    from flows.reports import verify_table

    table = verify_table(first["targets"]["portable"]["verify"])
    assert "| lowerflow @ batch=32 | ok |" in table and "| executorch @ batch=1 | ok |" in table

    again, ran = _executions_during(lower_model, spec, ["portable"], store=store)
    assert sum(ran.values()) == 0 and _pte_bytes(again, "portable") == portable

    # Only the Dim's max changes: a new fingerprint, so export, plan and emit run again.
    smaller = {"x": {"0": {"name": "batch", "min": 1, "max": 16}}}
    third, ran = _executions_during(lower_model, spec, ["portable"], store=store, dynamic_shapes=smaller)
    assert ran["export"] == 1 and ran["memory_plan"] == 1 and ran["emit"] == 1, ran
    assert "inputs" in third["changed"]
    assert third["fingerprint"]["digest"] != first["fingerprint"]["digest"]
    assert _input_bound(_pte_bytes(third, "portable")) == [16, 64]
    assert {c["inputs"] for c in third["targets"]["portable"]["verify"]["checks"]} == {"example", "batch=1", "batch=16"}

    # Back to the factory's own spec: every stage is a cache hit, the old bytes.
    back, ran = _executions_during(lower_model, spec, ["portable"], store=store)
    assert sum(ran.values()) == 0 and _pte_bytes(back, "portable") == portable


def test_fingerprint_covers_each_dims_name_min_and_max():
    from tasks.model_spec import ModelSpec, load_model

    spec = ModelSpec.parse(f"{DYNAMIC}:dynamic_mlp")
    base = {"x": {"0": {"name": "batch", "min": 1, "max": 32}}}
    digests = {}
    for label, doc in [("factory", None), ("same", base),
                       ("max", {"x": {"0": {"name": "batch", "min": 1, "max": 31}}}),
                       ("min", {"x": {"0": {"name": "batch", "min": 2, "max": 32}}}),
                       ("name", {"x": {"0": {"name": "rows", "min": 1, "max": 32}}})]:
        loaded = load_model(spec, {"version": None, **({"dynamic_shapes": doc} if doc else {})})
        digests[label] = loaded.fingerprint.parts["inputs"]
    assert digests["factory"] == digests["same"]  # the factory's Dims and the same JSON spec
    assert len({digests[k] for k in ("same", "max", "min", "name")}) == 4
    static = load_model(ModelSpec.parse("examples/models.py:mlp"), {"version": None})
    assert static.dynamic_shapes is None


def test_a_factory_spec_error_names_the_model():
    from tasks.model_spec import ModelSpec, ModelSpecError, load_model

    spec = ModelSpec.parse(f"{DYNAMIC}:dynamic_mlp")
    with pytest.raises(ModelSpecError, match=r"dynamic_mlp'.*'y' is not an argument of forward"):
        load_model(spec, {"dynamic_shapes": {"y": {"0": {"name": "b", "max": 8}}}})
    with pytest.raises(ModelSpecError, match=r"dynamic_mlp'.*input 'x' dim 0 is 4 .*outside Dim 'b'"):
        load_model(spec, {"dynamic_shapes": {"x": {"0": {"name": "b", "min": 5, "max": 8}}}})
    by_position = load_model(spec, {"dynamic_shapes": [{"0": {"name": "b", "min": 1, "max": 8}}]})
    assert by_position.dynamic_shapes[0][0].max == 8


def test_a_spec_must_give_each_dims_range():
    with pytest.raises(DynamicShapeError, match=r"dynamic_shapes\['x'\]\[0\]: expected a torch.export.Dim"):
        dynamic_shapes_to_json({"x": {0: torch.export.Dim.AUTO}})


def test_fleet_manifest_gives_dynamic_shapes_and_bad_ones_are_refused_before_any_work(fresh_stages, tmp_path):
    from flows.lower_fleet import lower_fleet
    from flows.manifest import ManifestError, load_manifest

    store = tmp_path / "store"
    manifest = {
        "store": str(store),
        "models": [{"name": "ops", "model": f"{DYNAMIC}:dynamic_ops", "targets": ["portable"],
                    "dynamic_shapes": {"x": {0: {"name": "n", "min": 1, "max": 9}}}}],
    }
    entry = load_manifest(manifest).models[0]
    assert entry.dynamic_shapes == {"x": {"0": {"name": "n", "min": 1, "max": 9}}}
    summary = lower_fleet(manifest)
    result = summary["models"]["ops"]["targets"]["portable"]
    assert result["ok"]
    assert {c["inputs"] for c in result["verify"]["checks"]} == {"example", "n=1", "n=9"}
    for bad, fragment in [
        ({"x": {0: {"name": "n", "min": 1}}}, "max required"),
        ({"x": {0: {"name": "n", "max": 9}}, "w": {0: {"name": "n", "max": 3}}}, "different ranges"),
        ([{"a": {"name": "n", "max": 3}}], "dim index 'a' is not an integer"),
    ]:
        manifest["models"][0]["dynamic_shapes"] = bad
        manifest["store"] = str(tmp_path / "never")
        with pytest.raises(ManifestError, match=r"models\[0\] \('ops'\): 'dynamic_shapes'") as info:
            lower_fleet(manifest)
        assert fragment in str(info.value)
        assert not (tmp_path / "never").exists()


def test_cli_lower_with_dynamic_shapes_then_a_new_max_is_not_a_cache_hit(tmp_path, prefect_api):
    from tests.test_cli import assert_one_line_error, lowerflow

    store, home = tmp_path / "store", tmp_path / "prefect-home"
    spec = "examples/dynamic_models.py:dynamic_mlp"
    outputs = {}
    for max_ in (8, 16):
        out = tmp_path / f"mlp{max_}.pte"
        shapes = json.dumps({"x": {"0": {"name": "batch", "min": 1, "max": max_}}})
        result = lowerflow("lower", spec, "--dynamic-shapes", shapes, "-o", str(out), "--store", str(store), home=home,
                           api=prefect_api)
        assert result.returncode == 0, result.stderr
        stages = {line.split()[1]: line.split()[2] for line in result.stdout.splitlines()
                  if line.startswith("portable ")}
        assert stages["export"] != "cached" and stages["memory_plan"] != "cached", result.stdout
        outputs[max_] = out.read_bytes()
    assert _input_bound(outputs[8]) == [8, 64] and _input_bound(outputs[16]) == [16, 64]
    method = ExecutorchMethod(outputs[16])
    model, _, _ = DYNAMIC_MODELS["dynamic_mlp"]()
    x = torch.randn(16, 64)
    with torch.no_grad():
        torch.testing.assert_close(list(method.execute([x]))[0], model(x))
    assert_one_line_error(
        lowerflow("lower", spec, "--dynamic-shapes", '{"x": {"0": {"name": "batch"}}}', "--store", str(store)),
        2, "--dynamic-shapes", "max required")
    assert_one_line_error(lowerflow("lower", spec, "--dynamic-shapes", "{x: 1", "--store", str(store)),
                          2, "--dynamic-shapes: not JSON")


@pytest.mark.parametrize("name, target", [("gpt_decoder", "portable"), ("dynamic_ops", "reference"),
                                          ("dynamic_ops", "xnnpack")])
def test_a_stored_dynamic_program_plans_and_emits_the_same_bytes(lowered, name, target):
    """What a stage reads back from the store (another process, a cache hit) keeps the
    symbols' ranges: the same plan and the same .pte as the live program."""
    from lowering.emit import emit_program
    from lowering.memory_plan import memory_plan
    from lowering.serialize import deserialize_any, serialize_any

    _, _, _, result = lowered(name, target)
    serialized = serialize_any(result.exported_program, keep_stack_traces=False)
    restored = deserialize_any(serialized.manifest, serialized.blobs.__getitem__)
    plan = memory_plan(restored)
    assert plan.to_dict() == result.memory_plan.to_dict()
    assert emit_program(restored, plan) == result.pte


def test_flow_lowers_the_gpt_decoder_for_portable_and_xnnpack(fresh_stages, lowered, tmp_path):
    """The decoder by its spec through the flow; verify runs it at 1 and 16 tokens, the
    published .pte is the library's, byte for byte, and runs token by token in ExecuTorch's
    runtime (from bytes only the loaded method holds)."""
    from flows.lower_model import lower_model

    manifest = lower_model(f"{DYNAMIC}:gpt_decoder", ["portable", "xnnpack"], store=str(tmp_path / "store"))
    model, _, _ = DYNAMIC_MODELS["gpt_decoder"]()
    with torch.no_grad():
        expected = run_token_by_token(model, PROMPT, 4)
    for target in ("portable", "xnnpack"):
        result = manifest["targets"][target]
        assert result["ok"], result.get("error")
        checks = result["verify"]["checks"]
        assert {(c["runtime"], c["inputs"]) for c in checks if c["ok"]} == {
            (r, s) for r in ("lowerflow", "executorch") for s in ("example", "seq=1", "seq=16")}
        assert _pte_bytes(manifest, target) == lowered("gpt_decoder", target)[3].pte, target
        method = ExecutorchMethod(_pte_bytes(manifest, target))
        actual = run_token_by_token(lambda t, p: list(method.execute([t, p]))[0], PROMPT, 4)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    assert manifest["targets"]["xnnpack"]["delegation"]["delegated_nodes"] > 0


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_an_executorch_method_outlives_the_bytes_it_was_loaded_from(lowered, target):
    """ExecuTorch reads constants, the KV cache's initial zeros and XNNPACK's payload in
    place from the bytes a program was loaded from, and its Method does not hold its
    Program (the bytes' only owner): a method loaded from bytes nobody else holds gave
    NaN logits or crashed.  ExecutorchMethod keeps them; the freed memory is reused here."""
    model, _, _, result = lowered("gpt_decoder", target)
    method = ExecutorchMethod(bytearray(result.pte))  # the runtime's bytes(...) copy is the only one
    gc.collect()
    _reused = [b"\xff" * len(result.pte) for _ in range(8)]  # NaN floats where freed bytes were
    with torch.no_grad():
        expected = run_token_by_token(copy.deepcopy(model), PROMPT, 2)
    actual = run_token_by_token(lambda t, p: method.execute([t, p])[0], PROMPT, 2)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", ["reference", "xnnpack"])
def test_a_stored_dynamic_partition_preprocesses_to_the_same_payload(lowered, target):
    """A partition program read back from the store (the preprocess stage in another
    process) keeps its symbols' ranges, so its payload is planned at the same bounds."""
    from lowering.lowered_module import find_backend
    from lowering.serialize import deserialize_any, serialize_any

    _, _, _, result = lowered("gpt_decoder", target)
    modules = [m for _, m in result.exported_program.graph_module.named_children()]
    dynamic = [m for m in modules if m.original_module.range_constraints]
    assert dynamic
    for module in dynamic:
        serialized = serialize_any(module.original_module, keep_stack_traces=False)
        restored = deserialize_any(serialized.manifest, serialized.blobs.__getitem__)
        backend = find_backend(module.backend_id)
        assert backend.preprocess(restored, list(module.compile_specs)).processed_bytes == module.processed_bytes


# --- transformers architectures (random weights) ------------------------------------------


def _hf_dynamic(name):
    """A transformers model of examples.hf_models with its dynamic shapes: GPT-2's sequence
    length (JSON form); BERT's batch and sequence length, ids and mask alike (Dims)."""
    pytest.importorskip("transformers")
    from examples import hf_models

    model, inputs = getattr(hf_models, name)()
    if name == "gpt2":
        spec = {"input_ids": {"1": {"name": "seq", "min": 2, "max": 32}}}
        sizes = [(torch.randint(0, 128, (1, n)),) for n in (2, 9, 32)]
    else:  # BERT's wrapper takes *args, a structure the JSON form does not describe: Dims
        batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=2, max=32)
        spec = (({0: batch, 1: seq}, {0: batch, 1: seq}),)
        sizes = [(torch.randint(0, 128, (b, n)), torch.ones(b, n, dtype=torch.long)) for b, n in ((1, 2), (3, 17), (4, 32))]
    return model, inputs, spec, sizes


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_models_run_at_every_size_on_executorch(name, target):
    """HF GPT-2 (sequence length) and BERT (batch and sequence length) with random weights,
    lowered once, run on ExecuTorch's runtime at the smallest, a middle and the largest size."""
    from lowering.dynamic import dynamic_shapes_from_json

    model, inputs, spec, sizes = _hf_dynamic(name)
    dynamic_shapes = dynamic_shapes_from_json(spec) if isinstance(spec, dict) else spec
    result = lowering.lower(model, inputs, partitioner=partitioner_for(target), dynamic_shapes=dynamic_shapes)
    method = ExecutorchMethod(result.pte)
    with torch.no_grad():
        for args in sizes:
            expected = model(*args)
            expected = list(expected) if isinstance(expected, tuple) else [expected]
            actual = method.execute(list(args))
            assert len(actual) == len(expected)
            for a, e in zip(actual, expected):
                assert a.shape == e.shape
                torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_flow_lowers_gpt2_with_a_dynamic_sequence_length(fresh_stages, tmp_path):
    """The same through the flow, the spec given as the ``dynamic_shapes`` parameter (as a
    manifest entry gives it): verify passes at seq 2 and 32, and the .pte is the library's."""
    import hashlib

    from flows.lower_model import lower_model
    from lowering.dynamic import dynamic_shapes_from_json

    model, inputs, spec, _ = _hf_dynamic("gpt2")
    manifest = lower_model("examples/hf_models.py:gpt2", ["xnnpack"], store=str(tmp_path / "store"),
                           dynamic_shapes=spec)
    entry = manifest["targets"]["xnnpack"]
    assert entry["ok"], entry.get("error")
    assert {c["inputs"] for c in entry["verify"]["checks"] if c["ok"]} >= {"seq=2", "seq=32"}
    library = lowering.lower(model, inputs, partitioner=partitioner_for("xnnpack"),
                             dynamic_shapes=dynamic_shapes_from_json(spec))
    assert entry["pte"]["sha256"] == hashlib.sha256(library.pte).hexdigest()
