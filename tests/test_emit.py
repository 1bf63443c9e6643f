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
from lowering import BackendDetails, PreprocessResult
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
    from executorch.exir._serialize._program import deserialize_pte_binary

    initial = deserialize_pte_binary(pte).mutable_data
    assert [bytes(b.storage) for b in initial] == [b"", (torch.arange(4, dtype=torch.float32) + 10).numpy().tobytes()]
    eager = _NonZeroState()
    expected = _two_eager_calls(eager, (x,))
    assert_all_close(run_in_executorch(pte, (x,), calls=2)[1], expected[1])
    program = load(pte)
    program.run("forward", [x])
    assert_all_close(program.run("forward", [x]), expected[1])


class _EqualStates(torch.nn.Module):
    """Three mutated buffers, two of them with equal (non-zero) initial values, each updated its own way."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.full((4,), 3.0))
        self.register_buffer("b", torch.full((4,), 3.0))
        self.register_buffer("c", torch.arange(4, dtype=torch.float32))

    def forward(self, x):
        self.a.mul_(x)
        self.b.add_(x)
        self.c.sub_(x)
        return self.a + self.b * 2 + self.c * 3


def test_equal_initial_values_are_stored_once_and_each_buffer_keeps_its_own_state():
    """Initial values are copied into each buffer's planned memory at load: buffers with equal
    initial bytes (a decoder's zero KV caches) share one mutable-data blob, as in ExecuTorch's
    emitter, and still evolve apart on both runtimes."""
    x = torch.tensor([2.0, 3.0, 0.5, -1.0])
    ep = export(_EqualStates(), (x,))
    pte = emit_program(ep, memory_plan(ep))
    from executorch.exir._serialize._program import deserialize_pte_binary

    initial = deserialize_pte_binary(pte).mutable_data
    assert [bytes(b.storage) for b in initial] == [
        b"", torch.full((4,), 3.0).numpy().tobytes(), torch.arange(4, dtype=torch.float32).numpy().tobytes()]
    expected = _two_eager_calls(_EqualStates(), (x,))
    got = run_in_executorch(pte, (x,), calls=2)
    assert_all_close(got[0], expected[0])
    assert_all_close(got[1], expected[1])
    program = load(pte)
    assert_all_close(program.run("forward", [x]), expected[0])
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


def test_chain_inputs_and_outputs_are_empty_as_executorch_writes_them(programs):
    # The runtime reads a chain's instructions only; two one-element vectors cost 8 B of flatbuffer.
    from executorch.exir._serialize._program import deserialize_pte_binary

    ours = deserialize_pte_binary(programs["mlp"][2]).program.execution_plan[0].chains[0]
    theirs = deserialize_pte_binary(executorch_pte("mlp")).program.execution_plan[0].chains[0]
    assert (ours.inputs, ours.outputs) == (theirs.inputs, theirs.outputs) == ([], [])


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


def test_an_unplanned_dynamic_value_is_a_clear_error():
    """Dynamic shapes are emitted (tests/test_dynamic_shapes.py); a plan that misses a value names it."""
    model, inputs = MODELS["mlp"]()
    batch = torch.export.Dim("batch", min=2, max=16)
    ep = export(model, inputs, dynamic_shapes=({0: batch},))
    empty_plan = MemoryPlan(out_variants={}, allocations={}, arena_sizes=(0, 0), lower_bound=0, algorithm="none")
    with pytest.raises(EmitError, match=r"node 'x'.*the memory plan has no allocation for value 'x'"):
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


# ---------------------------------------------------------------- delegates


@pytest.fixture
def reference_runtime():
    """The reference backend's runtime, registered for the duration of one test."""
    from lowering.backends.reference import BACKEND_ID, ReferenceRuntime
    from lowering.runtime import register_backend_runtime, unregister_backend_runtime

    register_backend_runtime(BACKEND_ID, ReferenceRuntime())
    yield BACKEND_ID
    unregister_backend_runtime(BACKEND_ID)


@pytest.fixture(scope="module")
def delegated():
    """name -> delegated edge program (reference backend partitions) for a few models."""
    from lowering.backends.reference import ReferencePartitioner
    from lowering.to_backend import to_backend

    built = {}
    for name in ("cnn", "transformer", "buffer_mutation"):
        model, inputs = model_and_inputs(name)
        built[name] = to_backend(export(model, inputs), ReferencePartitioner())
    return built


def _lowered_modules(ep):
    return [getattr(ep.graph_module, n.target) for n in ep.graph.nodes if n.op == "get_attr"]


@pytest.mark.parametrize("name", ["cnn", "transformer", "buffer_mutation"])
def test_delegated_program_runs_in_our_executor(delegated, reference_runtime, name):
    ep = delegated[name]
    assert _lowered_modules(ep), "the partitioner delegated nothing"
    pte = emit_program(ep, memory_plan(ep))
    model, inputs = MODELS[name]()
    program = load(pte)
    for expected in _two_eager_calls(model, inputs):
        assert_all_close(program.run("forward", list(inputs)), expected)


def test_delegates_are_read_back_by_executorch(delegated):
    from executorch.exir._serialize._program import deserialize_pte_binary

    ep = delegated["cnn"]
    program = deserialize_pte_binary(emit_program(ep, memory_plan(ep))).program
    [method] = program.execution_plan
    lowered = _lowered_modules(ep)
    assert [d.id for d in method.delegates] == [m.backend_id for m in lowered]
    for delegate, module in zip(method.delegates, lowered):
        assert bytes(program.backend_delegate_data[delegate.processed.index].data) == module.processed_bytes
        assert [(s.key, bytes(s.value)) for s in delegate.compile_specs] == [
            (s.key, s.value) for s in module.compile_specs
        ]
    calls = [i.instr_args for i in method.chains[0].instructions if type(i.instr_args).__name__ == "DelegateCall"]
    assert sorted(c.delegate_index for c in calls) == list(range(len(lowered)))
    # args = inputs then outputs: the last call's last arg is a value the method outputs
    # or a later instruction reads.
    assert all(len(c.args) >= 2 for c in calls)


def test_delegated_program_loads_in_executorch_program_loader(delegated):
    """ExecuTorch's runtime parses and verifies the program; only running a method needs
    the backend, which the stock runtime does not have."""
    runtime = pytest.importorskip("executorch.runtime")

    for name, ep in delegated.items():
        program = runtime.Runtime.get().load_program(emit_program(ep, memory_plan(ep)))
        assert program.method_names == {"forward"}
        assert not runtime.Runtime.get().backend_registry.is_available("ReferenceBackend")
        with pytest.raises(Exception):
            program.load_method("forward")


def test_identical_delegate_payloads_are_stored_once(delegated):
    import copy

    ep = copy.deepcopy(delegated["cnn"])
    first, second, *_ = _lowered_modules(ep)
    second._processed_bytes = first.processed_bytes
    pte_bytes = emit_program(ep, memory_plan(ep))
    data = deserialize(pte_bytes)
    assert len(data.delegate_data) == len(_lowered_modules(ep)) - 1
    delegates = data.program.executionPlan[0].delegates
    assert delegates[0].processed.index == delegates[1].processed.index
    header_program = schema.ProgramT.InitFromPackedBuf(pte_bytes, 0)
    assert len(header_program.segments) == 1 + len(data.delegate_data)  # constants + distinct payloads


def test_reference_runtime_is_found_by_entry_point(delegated):
    """No registration by hand: the executor finds ReferenceBackend's runtime by entry point."""
    from lowering.runtime import backend_runtime, unregister_backend_runtime

    unregister_backend_runtime("ReferenceBackend")
    ep = delegated["cnn"]
    program = load(emit_program(ep, memory_plan(ep)))
    model, inputs = model_and_inputs("cnn")
    (out,) = program.run("forward", list(inputs))
    torch.testing.assert_close(out, model(*inputs), atol=1e-5, rtol=1e-4)
    assert type(backend_runtime("ReferenceBackend")).__name__ == "ReferenceRuntime"


class NoRuntimeBackend(BackendDetails):
    """A backend with an ahead-of-time half only: programs using it cannot run here."""

    @staticmethod
    def preprocess(edge_program, compile_specs):
        return PreprocessResult(b"opaque")


def test_unregistered_backend_is_a_clear_error():
    from lowering import OpSupportPartitioner, to_backend
    from lowering.runtime import ExecutorError

    model, inputs = model_and_inputs("mlp")
    partitioner = OpSupportPartitioner("NoRuntimeBackend", {torch.ops.aten.relu.default})
    ep = to_backend(export(model, inputs), partitioner)
    program = load(emit_program(ep, memory_plan(ep)))
    with pytest.raises(ExecutorError, match="no backend runtime registered for backend id 'NoRuntimeBackend'"):
        program.run("forward", list(inputs))


# ------------------------------------------------------------ argument kinds


class _KitchenSink(torch.nn.Module):
    """Exercises every kind of kernel argument the emitter writes."""

    def forward(self, x, idx, n):
        a = torch.nn.functional.gelu(x, approximate="tanh")  # String
        b = torch.div(x, 3.0, rounding_mode="floor")  # String + number in a Tensor position
        c = torch.cat([a, b], dim=1)  # TensorList
        d = torch.clamp(c, min=-0.5)  # None for an optional Scalar
        e = d[idx]  # OptionalTensorList (index.Tensor)
        f = e.mean(dim=[0], keepdim=True)  # IntList, Bool
        g = torch.where(f > 0, f, 0.25)  # Double
        h = torch.full((2, 3), 1.5) + g[:, :3]  # dtype as Int
        i = torch.nn.functional.layer_norm(c, (8,), eps=1e-3)  # None optional tensors, 3 outputs
        j = (n * 3 + 1).to(torch.float32)  # int32 arithmetic, dtype conversion
        return h, i, j, torch.split(c, [3, 5], dim=1)  # TensorList out argument


@pytest.fixture(scope="module")
def kitchen_sink():
    inputs = (torch.randn(4, 4), torch.tensor([2, 0, 3]), torch.tensor([1, 2, 3], dtype=torch.int32))
    ep = export(_KitchenSink(), inputs)
    with torch.no_grad():
        expected = torch.utils._pytree.tree_leaves(_KitchenSink()(*inputs))
    return emit_program(ep, memory_plan(ep)), inputs, expected


def test_every_argument_kind_runs_in_executorch(kitchen_sink):
    pte, inputs, expected = kitchen_sink
    assert_all_close(run_in_executorch(pte, inputs)[0], expected)


def test_every_argument_kind_runs_in_our_executor(kitchen_sink):
    pte, inputs, expected = kitchen_sink
    assert_all_close(load(pte).run("forward", list(inputs)), expected)


def test_every_argument_kind_is_emitted(kitchen_sink):
    pte, _, _ = kitchen_sink
    kinds = {value.valType for value in deserialize(pte).program.executionPlan[0].values}
    K = schema.KernelTypes
    assert {K.Null, K.Int, K.Bool, K.Double, K.Tensor, K.String, K.IntList, K.TensorList, K.OptionalTensorList} <= kinds
