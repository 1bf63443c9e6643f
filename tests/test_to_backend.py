"""Stages 2–6 on real torch.export programs: partition, submodule, partition program,
preprocess + LoweredBackendModule, adjust.  Numbers are checked against eager, both
through the lowered modules' original programs and through the backend payloads alone."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from examples.models import MODELS
from lowering import (
    BackendDetails,
    BackendError,
    CompileSpec,
    DelegationSpec,
    LoweredBackendModule,
    PartitionError,
    Partitioner,
    PartitionResult,
    OpSupportPartitioner,
    PreprocessResult,
    SubmoduleError,
    executorch_call_delegate,
    export,
    to_backend,
)
from lowering.backends.reference import BACKEND_ID, ReferencePartitioner, ReferenceRuntime
from tests._lowering import TagBy, assert_close_tree, op_is, run_with_payloads

aten = torch.ops.aten


def delegate_calls(program):
    return [n for n in program.graph.nodes if n.target is executorch_call_delegate]


def lowered_modules(program):
    return [getattr(program.graph_module, n.args[0].target) for n in delegate_calls(program)]


@pytest.fixture(scope="module")
def edge_programs():
    """name -> (factory, exported edge program); exported once per module."""
    programs = {}
    for name in ("mlp", "cnn", "transformer", "lstm", "buffer_mutation", "lifted_constant", "multi_output"):
        model, inputs = MODELS[name]()
        programs[name] = export(model, inputs)
    return programs


# --- the test models, lowered with the reference partitioner ------------------------------


@pytest.mark.parametrize(
    "name", ["mlp", "cnn", "transformer", "lstm", "buffer_mutation", "lifted_constant", "multi_output"]
)
def test_model_lowers_and_matches_eager(name, edge_programs):
    model, inputs = MODELS[name]()
    program = edge_programs[name]
    before = [n.name for n in program.graph.nodes]
    lowered = to_backend(program, ReferencePartitioner())
    assert [n.name for n in program.graph.nodes] == before, "to_backend modified its input"

    calls = delegate_calls(lowered)
    assert calls, f"{name}: nothing was delegated"
    assert {n.args[0].target for n in calls} == {f"lowered_module_{i}" for i in range(len(calls))}
    for module in lowered_modules(lowered):
        assert isinstance(module, LoweredBackendModule)
        assert module.backend_id == BACKEND_ID
        module.original_module._validate()

    expected = model(*inputs)
    # Through the HOP's CPU implementation (the lowered modules' original programs)...
    assert_close_tree(lowered.module()(*inputs), MODELS[name]()[0](*inputs))
    # ...and through the payload bytes alone.
    assert_close_tree(run_with_payloads(lowered)(*inputs), expected)


def test_partition_count_equals_lowered_module_count():
    """Alternating supported (add) and unsupported (sin) ops: N partitions, N delegate calls."""

    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(5):
                x = torch.sin(x + 1.0)
            return x

    x = torch.randn(3)
    program = export(Chain(), (x,))
    partitioner = ReferencePartitioner({aten.add.Tensor})
    lowered = to_backend(program, partitioner)
    calls = delegate_calls(lowered)
    assert len(calls) == 5
    assert {n.args[0].target for n in calls} == {f"lowered_module_{i}" for i in range(5)}
    assert len([n for n in lowered.graph.nodes if n.target == aten.sin.default]) == 5
    torch.testing.assert_close(run_with_payloads(lowered)(x), Chain()(x))


def test_whole_program_lowering(edge_programs):
    model, inputs = MODELS["mlp"]()
    specs = [CompileSpec("level", b"\x02")]
    lowered = to_backend("ReferenceBackend", edge_programs["mlp"], specs)
    assert isinstance(lowered, LoweredBackendModule)
    assert lowered.backend_id == "ReferenceBackend"
    assert lowered.compile_specs == specs
    torch.testing.assert_close(lowered(*inputs), model(*inputs))
    runtime = ReferenceRuntime()
    out = runtime.execute(runtime.init(lowered.processed_bytes, specs), list(inputs))
    torch.testing.assert_close(out[0], model(*inputs))
    # The entry-point name finds the same backend and gives the same bytes.
    again = to_backend("reference", edge_programs["mlp"], specs)
    assert again.backend_id == "ReferenceBackend"
    assert again.processed_bytes == lowered.processed_bytes


def test_lowered_module_deepcopy_is_independent(edge_programs):
    lowered = to_backend("ReferenceBackend", edge_programs["mlp"], [CompileSpec("k", b"v")])
    copied = copy.deepcopy(lowered)
    assert isinstance(copied, LoweredBackendModule)
    assert copied.processed_bytes == lowered.processed_bytes
    assert copied.compile_specs == lowered.compile_specs
    assert copied.original_module is not lowered.original_module
    x = MODELS["mlp"]()[1]
    torch.testing.assert_close(copied(*x), lowered(*x))


def test_composite_with_lowered_module_reexports(edge_programs):
    model, (x,) = MODELS["mlp"]()
    lowered = to_backend("ReferenceBackend", edge_programs["mlp"])

    class Composite(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lowered = lowered
            self.head = torch.nn.Linear(10, 3)

        def forward(self, x):
            return torch.relu(self.head(self.lowered(x) * 2))

    torch.manual_seed(1)
    composite = Composite().eval()
    reexported = torch.export.export(composite, (x,))
    assert any(n.target is executorch_call_delegate for n in reexported.graph.nodes)
    torch.testing.assert_close(reexported.module()(x), composite(x))
    torch.testing.assert_close(composite(x), torch.relu(composite.head(model(x) * 2)))


# --- constants and buffers ------------------------------------------------------------------


def test_consumed_constants_leave_top_level(edge_programs):
    program = edge_programs["mlp"]
    data = {**program.state_dict, **program.constants}  # weights (transposes folded or not)
    lowered = to_backend(program, ReferencePartitioner())
    sig = lowered.graph_signature
    assert [s.kind for s in sig.input_specs] == [InputKind.USER_INPUT]
    assert lowered.state_dict == {} and lowered.constants == {}
    inner = lowered_modules(lowered)[0].original_module
    assert {**inner.state_dict, **inner.constants}.keys() == data.keys()
    assert all(s.kind != InputKind.USER_INPUT for s in inner.graph_signature.input_specs[:-1])


def test_lifted_constant_consumed(edge_programs):
    lowered = to_backend(edge_programs["lifted_constant"], ReferencePartitioner())
    assert lowered.constants == {}
    inner = lowered_modules(lowered)[0].original_module
    kinds = {s.target: s.kind for s in inner.graph_signature.input_specs if s.target}
    assert kinds["scale"] == InputKind.CONSTANT_TENSOR
    assert "scale" in inner.constants


class SharedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        a = torch.mm(x, self.w)
        return torch.mm(torch.sin(a), self.w)


def _shared_weight_tags(node):
    if node.op == "call_function" and node.target == aten.mm.default:
        return "A" if node.args[0].op == "placeholder" else "B"
    return None


def test_constant_shared_by_two_partitions_is_duplicated():
    torch.manual_seed(0)
    model, x = SharedWeight(), torch.randn(2, 4)
    lowered = to_backend(export(model, (x,)), TagBy(_shared_weight_tags))
    modules = lowered_modules(lowered)
    assert len(modules) == 2
    assert lowered.state_dict == {}
    owned = [set(m.original_module.state_dict) for m in modules]
    assert owned[0] == {"w"} and len(owned[1]) == 1 and owned[1] != {"w"}
    for m in modules:
        (tensor,) = m.original_module.state_dict.values()
        torch.testing.assert_close(tensor, model.w.detach())
    torch.testing.assert_close(run_with_payloads(lowered)(x), model(x))


def test_shared_constant_stays_top_level_by_default():
    """Without duplication a shared weight is stored once and passed to both delegates."""
    torch.manual_seed(0)
    model, x = SharedWeight(), torch.randn(2, 4)
    lowered = to_backend(export(model, (x,)), TagBy(_shared_weight_tags, duplicate=False))
    assert list(lowered.state_dict) == ["w"]
    for module in lowered_modules(lowered):
        assert module.original_module.state_dict == {}
    torch.testing.assert_close(run_with_payloads(lowered)(x), model(x))


class TiedHead(torch.nn.Module):
    """An embedding table the top level reads that is also a partition's matmul weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, ids):
        return torch.mm(torch.nn.functional.embedding(ids, self.w), self.w.t())


def _mm_tags(node):
    matmul = (aten.mm.default, aten.permute_copy.default)
    return "A" if node.op == "call_function" and node.target in matmul else None


@pytest.mark.parametrize("duplicate", [True, False])
def test_constant_shared_with_top_level(duplicate):
    """With duplication the partition owns a copy marked SHARED_WITH_TOP_LEVEL and the top level
    keeps the original for its embedding; without, the original is passed in as an input."""
    from lowering.delegation import SHARED_WITH_TOP_LEVEL

    torch.manual_seed(0)
    model, ids = TiedHead(), torch.tensor([1, 5, 7])
    program = export(model, (ids,))
    lowered = to_backend(program, TagBy(_mm_tags, duplicate=duplicate))
    assert list(lowered.state_dict) == ["w"]
    (module,) = lowered_modules(lowered)
    inner = module.original_module
    call = next(n for n in lowered.graph.nodes if n.target is executorch_call_delegate)
    weight_passed_in = any(a.op == "placeholder" and a.name == "p_w" for a in call.args[1:])
    if duplicate:
        assert list(inner.state_dict) == ["w_dup_A"] and not weight_passed_in
        marked = [n for n in inner.graph.nodes if n.op == "placeholder" and n.meta.get(SHARED_WITH_TOP_LEVEL)]
        assert [n.name for n in marked] == [inner.graph_signature.input_specs[0].arg.name]
        assert inner.graph_signature.input_specs[0].target == "w_dup_A"
        torch.testing.assert_close(inner.state_dict["w_dup_A"], model.w.detach())
    else:
        assert inner.state_dict == {} and weight_passed_in
    torch.testing.assert_close(run_with_payloads(lowered)(ids), model(ids))


def test_no_copy_constant_shared_by_two_partitions_is_an_error():
    class NoCopy(TagBy):
        def partition(self, program):
            result = super().partition(program)
            for node in program.graph.nodes:
                if node.op == "placeholder" and node.name == "p_w":
                    node.meta["no_copy"] = True
            return result

    program = export(SharedWeight(), (torch.randn(2, 4),))
    with pytest.raises(PartitionError, match=r"'p_w'.*no_copy"):
        to_backend(program, NoCopy(_shared_weight_tags))


def test_mutated_buffer_consumed_by_delegate(edge_programs):
    model, (x,) = MODELS["buffer_mutation"]()
    lowered = to_backend(edge_programs["buffer_mutation"], ReferencePartitioner())
    sig = lowered.graph_signature
    assert not [s for s in sig.input_specs if s.kind == InputKind.BUFFER]
    assert not [s for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
    assert "acc" not in lowered.state_dict
    inner = lowered_modules(lowered)[0].original_module
    assert [s.target for s in inner.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION] == ["acc"]
    # State lives in the delegate and persists across calls, as in eager.
    run = run_with_payloads(lowered)
    for _ in range(3):
        torch.testing.assert_close(run(x), model(x))


def test_buffer_mutation_not_tagged_stays_outside(edge_programs):
    model, (x,) = MODELS["buffer_mutation"]()
    partitioner = ReferencePartitioner({aten.addmm.default, aten.permute_copy.default})
    lowered = to_backend(edge_programs["buffer_mutation"], partitioner)
    sig = lowered.graph_signature
    assert [s.target for s in sig.input_specs if s.kind == InputKind.BUFFER] == ["acc"]
    assert [s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION] == ["acc"]
    inner = lowered_modules(lowered)[0].original_module
    assert not [s for s in inner.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
    run = run_with_payloads(lowered)
    for _ in range(2):
        torch.testing.assert_close(run(x), model(x))


def test_mutation_value_also_used_outside_the_delegate(edge_programs):
    """acc's new value feeds the untagged output math: it is both a mutation and an output."""
    model, (x,) = MODELS["buffer_mutation"]()
    def tags(n):
        if n.op != "call_function":
            return None
        if n.target == aten.sum.dim_IntList or (n.target == aten.add.Tensor and n.args[0].name == "b_acc"):
            return "T"
        return None

    lowered = to_backend(edge_programs["buffer_mutation"], TagBy(tags))
    inner = lowered_modules(lowered)[0].original_module
    kinds = [s.kind for s in inner.graph_signature.output_specs]
    assert kinds.count(OutputKind.BUFFER_MUTATION) == 1 and OutputKind.USER_OUTPUT in kinds
    run = run_with_payloads(lowered)
    for _ in range(2):
        torch.testing.assert_close(run(x), model(x))


# --- outputs ---------------------------------------------------------------------------------


def test_single_multiple_and_list_outputs(edge_programs):
    model, inputs = MODELS["multi_output"]()
    lowered = to_backend(edge_programs["multi_output"], ReferencePartitioner())
    (call,) = delegate_calls(lowered)
    getitems = sorted(u.args[1] for u in call.users if u.target is operator.getitem)
    assert getitems == [0, 1, 2, 3]
    out = run_with_payloads(lowered)(*inputs)
    assert isinstance(out, tuple) and isinstance(out[2], list)
    assert_close_tree(out, model(*inputs))
    # Single output: one getitem of a one-element tuple.
    (single,) = delegate_calls(to_backend(edge_programs["mlp"], ReferencePartitioner()))
    assert [u.args[1] for u in single.users] == [0]


# --- errors ------------------------------------------------------------------------------------


class GraphMutatingPartitioner(Partitioner):
    def partition(self, program):
        node = next(n for n in program.graph.nodes if n.target == aten.relu.default)
        node.target = aten.sigmoid.default
        node.meta["delegation_tag"] = "T"
        return PartitionResult(program, {"T": DelegationSpec(BACKEND_ID)})


def test_partitioner_that_changes_the_graph_is_rejected(edge_programs):
    with pytest.raises(PartitionError, match="GraphMutatingPartitioner changed the graph.*relu"):
        to_backend(edge_programs["mlp"], GraphMutatingPartitioner())


def test_tagged_output_node_is_rejected(edge_programs):
    rule = lambda n: "T" if n.op in ("output", "call_function") else None
    with pytest.raises(PartitionError, match="tagged the output node"):
        to_backend(edge_programs["mlp"], TagBy(rule))


def test_tagged_user_input_is_rejected(edge_programs):
    rule = lambda n: "T" if n.name == "x" or n.op == "call_function" else None
    with pytest.raises(PartitionError, match="tagged user input 'x'"):
        to_backend(edge_programs["mlp"], TagBy(rule))


def test_cycle_forming_tag_names_the_nodes():
    class Diamond(torch.nn.Module):
        def forward(self, x):
            a = x + 1
            b = torch.sin(a)
            return b + a

    program = export(Diamond(), (torch.randn(3),))
    with pytest.raises(SubmoduleError, match=r"cycle: add -> sin -> add_1.*\['sin'\]"):
        to_backend(program, TagBy(op_is("add")))


class ExplodingBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs):
        raise RuntimeError("out of registers")


class WrongResultBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs):
        return b"not a PreprocessResult"


def test_preprocess_error_names_backend_and_partition(edge_programs):
    partitioner = OpSupportPartitioner("ExplodingBackend", {aten.addmm.default}, tag_prefix="T")
    with pytest.raises(BackendError, match=r"'ExplodingBackend' failed to preprocess partition 'T0'.*out of registers"):
        to_backend(edge_programs["mlp"], partitioner)
    with pytest.raises(BackendError, match="WrongResultBackend.*must return PreprocessResult"):
        to_backend("WrongResultBackend", edge_programs["mlp"])


def test_unknown_backend(edge_programs):
    with pytest.raises(BackendError, match="unknown backend 'NoSuchBackend'.*ReferenceBackend"):
        to_backend(edge_programs["mlp"], TagBy(op_is("addmm"), backend_id="NoSuchBackend"))
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        to_backend("nope", edge_programs["mlp"])


def test_preprocess_receives_partition_program_and_compile_specs(edge_programs):
    seen = []

    class RecordingBackend(BackendDetails):
        @staticmethod
        def preprocess(edge_program, compile_specs):
            seen.append((edge_program, compile_specs))
            return PreprocessResult(b"recorded")

    spec = DelegationSpec("RecordingBackend", (CompileSpec("opt", b"1"),))

    class Recording(Partitioner):
        def partition(self, program):
            for n in program.graph.nodes:
                if n.op == "call_function" and n.target == aten.addmm.default and n.args[1].name == "x":
                    n.meta["delegation_tag"] = "only"
            return PartitionResult(program, {"only": spec})

    lowered = to_backend(edge_programs["mlp"], Recording())
    ((program, specs),) = seen
    assert specs == [CompileSpec("opt", b"1")]
    program._validate()
    # Constants were not tagged, so the weights stay at top level and are user inputs of the partition.
    assert {s.kind for s in program.graph_signature.input_specs} == {InputKind.USER_INPUT}
    assert lowered_modules(lowered)[0].processed_bytes == b"recorded"
    assert len(lowered.state_dict) + len(lowered.constants) == 6
    assert len(program.graph_signature.input_specs) == 3  # bias, x, (permuted) weight


def test_export_errors_name_the_model():
    from lowering import ExportError

    class Broken(torch.nn.Module):
        def forward(self, x):
            return torch.no_such_op(x)

    with pytest.raises(ExportError, match="model 'Broken'.*no_such_op"):
        export(Broken(), (torch.randn(2),))
    with pytest.raises(ExportError, match="example_inputs must be a tuple"):
        export(MODELS["mlp"]()[0], torch.randn(4, 64))
    with pytest.raises(ExportError, match="expected a torch.nn.Module"):
        export(lambda x: x, (torch.randn(1),))


def test_sequential_whose_input_is_named_like_a_builtin():
    """nn.Sequential's argument is 'input': fx renames such nodes when it copies a graph."""
    from lowering import lower
    from lowering.runtime import load
    from lowering.targets import partitioner_for

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    x = torch.randn(2, 4)
    program = export(model, (x,))
    assert program.graph_signature.input_specs[-1].arg.name == "input"
    result = lower(model, (x,), partitioner=partitioner_for("reference"))
    out = load(result.pte).method("forward").execute([x])[0]
    assert torch.allclose(out, model(x), atol=1e-6)
