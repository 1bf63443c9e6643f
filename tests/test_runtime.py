"""lowering.runtime: lowerflow's executor, on ExecuTorch-produced programs and hand-built ones."""

from __future__ import annotations

import pytest
import torch

from examples.models import MODELS
from lowering.pte import PteData, deserialize, schema, serialize
from lowering.pte.scalar_types import DTYPE_TO_SCALAR_TYPE
from lowering.runtime import ExecutorError, load, register_backend_runtime, unregister_backend_runtime

from ._interop import assert_all_close, eager_outputs, executorch_pte, model_and_inputs

pytest.importorskip("executorch")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_runs_executorch_programs(name):
    _, inputs = model_and_inputs(name)
    outputs = load(executorch_pte(name)).run("forward", list(inputs))
    assert_all_close(outputs, eager_outputs(name))


def test_buffer_state_persists_across_calls_on_one_method():
    model, inputs = MODELS["buffer_mutation"]()
    with torch.no_grad():
        expected = [model(*inputs), model(*inputs)]
    program = load(executorch_pte("buffer_mutation"))
    first = program.run("forward", list(inputs))
    second = program.run("forward", list(inputs))
    assert_all_close(first, [expected[0]])
    assert_all_close(second, [expected[1]])
    assert not torch.allclose(first[0], second[0])


def test_a_fresh_load_starts_from_the_initial_state():
    _, inputs = model_and_inputs("buffer_mutation")
    pte = executorch_pte("buffer_mutation")
    load(pte).run("forward", list(inputs))
    assert_all_close(load(pte).run("forward", list(inputs)), eager_outputs("buffer_mutation"))


def _planned_tensor_values(plan):
    return [
        ev.val
        for ev in plan.values
        if ev.valType == schema.KernelTypes.Tensor and ev.val.allocationInfo is not None
    ]


def test_arenas_are_real_memory_so_a_wrong_plan_gives_wrong_numbers():
    """Move every planned tensor to offset 0: values that are live together now clobber each other."""
    pte = deserialize(executorch_pte("mlp"))
    plan = pte.program.executionPlan[0]
    for tensor in _planned_tensor_values(plan):
        tensor.allocationInfo.memoryOffsetLow = 0
    _, inputs = model_and_inputs("mlp")
    outputs = load(serialize(pte)).run("forward", list(inputs))
    assert outputs[0].shape == eager_outputs("mlp")[0].shape
    assert not torch.allclose(outputs[0], eager_outputs("mlp")[0], atol=1e-3)


def test_plan_overflowing_its_arena_is_a_clear_error():
    pte = deserialize(executorch_pte("mlp"))
    plan = pte.program.executionPlan[0]
    plan.nonConstBufferSizes = [0, 64]
    with pytest.raises(ExecutorError, match="overflows arena 1"):
        load(serialize(pte)).method("forward")


def test_wrong_input_shape_is_a_clear_error():
    program = load(executorch_pte("mlp"))
    with pytest.raises(ExecutorError, match=r"input 0 must be torch.float32\[4, 64\]"):
        program.run("forward", [torch.zeros(3, 64)])


# ---------------------------------------------------------------- delegates


def _int_value(v: int) -> schema.EValueT:
    ev = schema.EValueT()
    ev.valType = schema.KernelTypes.Int
    ev.val = schema.IntT()
    ev.val.intVal = v
    return ev


def _planned_tensor(shape, offset: int, dtype=torch.float32) -> schema.EValueT:
    tensor = schema.TensorT()
    tensor.scalarType = DTYPE_TO_SCALAR_TYPE[dtype]
    tensor.sizes = list(shape)
    tensor.dimOrder = list(range(len(shape)))
    tensor.allocationInfo = schema.AllocationDetailsT()
    tensor.allocationInfo.memoryId = 1
    tensor.allocationInfo.memoryOffsetLow = offset
    ev = schema.EValueT()
    ev.valType = schema.KernelTypes.Tensor
    ev.val = tensor
    return ev


def _delegate_program(backend_id: str, payload: bytes) -> bytes:
    """forward(x[2,3]) -> (delegate(x, 2) -> (a, b)): values x, 2, a, b; inputs [0], outputs [2, 3]."""
    plan = schema.ExecutionPlanT()
    plan.name = "forward"
    plan.values = [_planned_tensor((2, 3), 0), _int_value(2), _planned_tensor((2, 3), 32), _planned_tensor((2, 3), 64)]
    plan.inputs, plan.outputs = [0], [2, 3]
    call = schema.DelegateCallT()
    call.delegateIndex = 0
    call.args = [0, 1, 2, 3]
    instruction = schema.InstructionT()
    instruction.instrArgsType = schema.InstructionArguments.DelegateCall
    instruction.instrArgs = call
    chain = schema.ChainT()
    chain.inputs, chain.outputs, chain.instructions = [0], [2, 3], [instruction]
    plan.chains = [chain]
    plan.operators = []
    delegate = schema.BackendDelegateT()
    delegate.id = backend_id
    delegate.processed = schema.BackendDelegateDataReferenceT()
    delegate.processed.location = schema.DataLocation.SEGMENT
    delegate.processed.index = 0
    spec = schema.CompileSpecT()
    spec.key, spec.value = "offset", list(b"\x05")
    delegate.compileSpecs = [spec]
    plan.delegates = [delegate]
    plan.nonConstBufferSizes = [0, 96]
    program = schema.ProgramT()
    program.executionPlan = [plan]
    return serialize(PteData(program=program, delegate_data=[payload]))


class _ScaleAndShift:
    """Test backend: payload = scale byte; compile spec "offset"; returns (x * scale * k, x + offset)."""

    def __init__(self):
        self.inits = []

    def init(self, processed, compile_specs):
        self.inits.append((processed, [(s.key, s.value) for s in compile_specs]))
        return {"scale": processed[0], "offset": compile_specs[0].value[0]}

    def execute(self, handle, args):
        x, k = args
        return [x * handle["scale"] * k, x + handle["offset"]]


def test_delegate_call_dispatches_to_the_registered_backend_runtime():
    backend = _ScaleAndShift()
    register_backend_runtime("ScaleAndShift", backend)
    try:
        program = load(_delegate_program("ScaleAndShift", bytes([3])))
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        first = program.run("forward", [x])
        second = program.run("forward", [x + 1])
    finally:
        unregister_backend_runtime("ScaleAndShift")
    assert backend.inits == [(bytes([3]), [("offset", b"\x05")])]  # init once per loaded method
    assert_all_close(first, [x * 6, x + 5])
    assert_all_close(second, [(x + 1) * 6, x + 6])


def test_unknown_backend_id_is_a_clear_error_naming_it():
    program = load(_delegate_program("NoSuchBackend", b"\x01"))
    with pytest.raises(ExecutorError, match="'NoSuchBackend'"):
        program.run("forward", [torch.zeros(2, 3)])


def test_kernel_output_shape_differing_from_the_plan_is_a_clear_error():
    """A kernel must write its planned tensor in place, never reallocate it."""
    pte = deserialize(executorch_pte("mlp"))
    plan = pte.program.executionPlan[0]
    output = plan.values[int(plan.outputs[0])].val
    output.sizes = [4, 5]  # the addmm computes [4, 10]
    with pytest.raises(ExecutorError, match="aten::addmm.out resized its output"):
        load(serialize(pte)).run("forward", list(model_and_inputs("mlp")[1]))
