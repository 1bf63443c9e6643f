"""lowering.pte: the .pte container, checked against ExecuTorch's own files and tools."""

from __future__ import annotations

import pytest
import torch

from lowering.pte import PteData, PteFormatError, deserialize, read_extended_header, schema, serialize
from lowering.pte.format import CONSTANT_TENSOR_ALIGNMENT, SEGMENT_ALIGNMENT, segment_order

from ._interop import assert_all_close, eager_outputs, executorch_pte, model_and_inputs, run_in_executorch

pytest.importorskip("executorch")

ROUND_TRIP_MODELS = ["mlp", "cnn", "buffer_mutation", "multi_output", "integer_inputs", "lifted_constant"]


@pytest.mark.parametrize("name", ROUND_TRIP_MODELS)
def test_reserialized_executorch_program_runs_in_executorch(name):
    original = executorch_pte(name)
    ours = serialize(deserialize(original))
    _, inputs = model_and_inputs(name)
    [outputs] = run_in_executorch(ours, inputs)
    assert_all_close(outputs, eager_outputs(name))


@pytest.mark.parametrize("name", ["mlp", "cnn", "multi_output"])
def test_executorch_deserializer_reads_ours_back_equal(name):
    from executorch.exir._serialize._program import deserialize_pte_binary

    original = executorch_pte(name)
    ours = serialize(deserialize(original))
    theirs_program = deserialize_pte_binary(original).program
    ours_program = deserialize_pte_binary(ours).program
    assert ours_program.execution_plan == theirs_program.execution_plan
    assert ours_program.constant_buffer == theirs_program.constant_buffer
    assert len(ours) == len(original)


def test_serialize_is_deterministic_and_a_fixed_point():
    once = serialize(deserialize(executorch_pte("mlp")))
    assert serialize(deserialize(once)) == once
    assert serialize(deserialize(executorch_pte("mlp"))) == once


def test_extended_header_and_segment_alignment():
    pte_bytes = serialize(deserialize(executorch_pte("cnn")))
    assert pte_bytes[4:8] == b"ET12"
    assert pte_bytes[8:12] == b"eh00"
    header = read_extended_header(pte_bytes)
    assert header.segment_base_offset % SEGMENT_ALIGNMENT == 0
    assert header.segment_base_offset >= header.program_size
    assert header.segment_base_offset + header.segment_data_size == len(pte_bytes)
    program = schema.ProgramT.InitFromPackedBuf(pte_bytes[: header.program_size], 0)
    assert all(segment.offset % SEGMENT_ALIGNMENT == 0 for segment in program.segments)
    offsets = [int(o) for o in program.constantSegment.offsets]
    assert len(offsets) > 2 and all(o % CONSTANT_TENSOR_ALIGNMENT == 0 for o in offsets)


def test_constants_survive_round_trip_exactly():
    original = deserialize(executorch_pte("lifted_constant"))
    again = deserialize(serialize(original))
    # Each constant keeps its bytes (and the same padding to the next 16-byte boundary).
    assert again.constants == original.constants
    assert len(original.constants) > 3 and any(len(c) >= 64 for c in original.constants)


def _delegate(backend_id: str, payload_index: int) -> schema.BackendDelegateT:
    delegate = schema.BackendDelegateT()
    delegate.id = backend_id
    delegate.processed = schema.BackendDelegateDataReferenceT()
    delegate.processed.location = schema.DataLocation.SEGMENT
    delegate.processed.index = payload_index
    spec = schema.CompileSpecT()
    spec.key = "level"
    spec.value = list(b"\x02")
    delegate.compileSpecs = [spec]
    return delegate


def _program_with_delegates(*payload_indices: int) -> schema.ProgramT:
    plan = schema.ExecutionPlanT()
    plan.name = "forward"
    plan.delegates = [_delegate(f"Backend{i}", index) for i, index in enumerate(payload_indices)]
    program = schema.ProgramT()
    program.executionPlan = [plan]
    return program


def test_identical_delegate_payloads_share_one_segment():
    payload_a = bytes(range(200))
    payload_b = b"other payload"
    pte = PteData(
        program=_program_with_delegates(0, 1, 2),
        delegate_data=[payload_a, payload_b, bytes(payload_a)],
    )
    pte_bytes = serialize(pte)
    header = read_extended_header(pte_bytes)
    program = schema.ProgramT.InitFromPackedBuf(pte_bytes[: header.program_size], 0)
    indices = [d.processed.index for d in program.executionPlan[0].delegates]
    assert indices[0] == indices[2] != indices[1]
    # constant segment (empty placeholder) + two distinct payloads
    assert len(program.segments) == 3
    for segment in program.segments:
        assert segment.offset % SEGMENT_ALIGNMENT == 0
    back = deserialize(pte_bytes)
    assert back.delegate_data == [payload_a, payload_b]
    assert [d.processed.index for d in back.program.executionPlan[0].delegates] == [0, 1, 0]


def test_executorch_deserializer_reads_our_delegate_payloads():
    from executorch.exir._serialize._program import deserialize_pte_binary

    payload = bytes(range(256)) * 3
    pte_bytes = serialize(PteData(program=_program_with_delegates(0, 0), delegate_data=[payload]))
    program = deserialize_pte_binary(pte_bytes).program
    delegates = program.execution_plan[0].delegates
    assert [d.id for d in delegates] == ["Backend0", "Backend1"]
    assert delegates[0].compile_specs[0].key == "level"
    assert bytes(delegates[0].compile_specs[0].value) == b"\x02"
    for delegate in delegates:
        assert bytes(program.backend_delegate_data[delegate.processed.index].data) == payload


def test_segment_order_puts_the_most_padding_last_and_keeps_index_order_otherwise():
    # paddings to 128: 0, 56, 115, 0, 115 -> the highest index of the largest padding goes last
    assert segment_order([0, 200, 13, 256, 141]) == [0, 1, 2, 3, 4]
    assert segment_order([0, 200, 13, 256]) == [0, 1, 3, 2]
    assert segment_order([128, 256, 384]) == [0, 1, 2]
    assert segment_order([]) == []


def _segments(pte_bytes: bytes) -> list[schema.DataSegmentT]:
    header = read_extended_header(pte_bytes)
    return schema.ProgramT.InitFromPackedBuf(pte_bytes[: header.program_size], 0).segments


def test_segment_with_most_padding_is_written_last_and_unpadded():
    payloads = [bytes(range(200)), b"x" * 13, bytes(256)]
    pte_bytes = serialize(PteData(program=_program_with_delegates(0, 1, 2), delegate_data=payloads))
    segments = _segments(pte_bytes)
    header = read_extended_header(pte_bytes)
    # index 0 is the empty constant segment; the 13-byte payload (115 B of padding) goes last
    assert [(s.offset, s.size) for s in segments] == [(0, 0), (0, 200), (512, 13), (256, 256)]
    assert header.segment_data_size == 512 + 13
    assert len(pte_bytes) == header.segment_base_offset + 512 + 13
    assert deserialize(pte_bytes).delegate_data == payloads
    assert serialize(deserialize(pte_bytes)) == pte_bytes


class _Biased(torch.nn.Module):
    """Weights of 640 B and biases of 40 B and 64 B: named data segments with unequal padding."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 10), torch.nn.Linear(10, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_executorch_runtime_runs_a_program_whose_segments_are_out_of_index_order():
    from lowering import lower
    from lowering.targets import partitioner_for

    torch.manual_seed(0)
    model, inputs = _Biased().eval(), (torch.randn(2, 16),)
    pte_bytes = lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte
    offsets = [s.offset for s in _segments(pte_bytes)]
    assert offsets != sorted(offsets)  # the case under test: not in index order
    [outputs] = run_in_executorch(pte_bytes, inputs)
    assert_all_close(outputs, [model(*inputs).detach()])
    # deterministic: lowering again gives the same bytes
    assert lower(model, inputs, partitioner=partitioner_for("xnnpack")).pte == pte_bytes


def test_bad_identifier_is_a_clear_error():
    with pytest.raises(PteFormatError, match="ET12"):
        deserialize(b"\0\0\0\0XXXX" + b"\0" * 64)


def _program_with_constants() -> schema.ProgramT:
    plan = schema.ExecutionPlanT()
    plan.name = "forward"
    program = schema.ProgramT()
    program.executionPlan = [plan]
    return program


def test_named_data_equal_to_a_constant_is_a_window_onto_it():
    """A tied weight: the top level's constant and a delegate's named data hold equal bytes;
    the file stores them once, the named-data segment being a window inside the constant segment."""
    weight = bytes(range(256)) * 40  # 10 KiB
    other = b"\x07" * 96
    pte = PteData(
        program=_program_with_constants(),
        constants=[b"", b"\x01" * 24, weight],  # the weight sits at an offset > 0
        named_data={"tied": weight, "own": other},
    )
    pte_bytes = serialize(pte)
    assert pte_bytes.count(weight) == 1 and pte_bytes.count(other) == 1
    header = read_extended_header(pte_bytes)
    program = schema.ProgramT.InitFromPackedBuf(pte_bytes[: header.program_size], 0)
    segment_of = {e.key.decode(): e.segmentIndex for e in program.namedData}
    constant = program.segments[program.constantSegment.segmentIndex]
    window = program.segments[segment_of["tied"]]
    assert window.offset == constant.offset + int(program.constantSegment.offsets[2]) and window.size == len(weight)
    assert program.segments[segment_of["own"]].offset % SEGMENT_ALIGNMENT == 0
    back = deserialize(pte_bytes)
    assert back.named_data == {"own": other, "tied": weight}
    assert back.constants[2][: len(weight)] == weight
    # No bigger than a file holding the weight once, as named data only.
    alone = serialize(PteData(program=_program_with_constants(), constants=[b"", b"\x01" * 24],
                              named_data={"tied": weight, "own": other}))
    assert len(pte_bytes) <= len(alone) + SEGMENT_ALIGNMENT


def test_weights_are_written_from_views_and_read_back_as_views_of_the_file():
    """The emitter hands serialize views of the program's tensors (constants, named data):
    the file is the same as from bytes, and reading it copies no weight (views of the file)."""
    from lowering.tensor_blobs import tensor_memory

    tied = torch.arange(2560, dtype=torch.float32)
    own = torch.full((24,), 7.0)
    as_bytes = PteData(program=_program_with_constants(), constants=[b"", b"\x01" * 24, tied.numpy().tobytes()],
                       named_data={"tied": tied.numpy().tobytes(), "own": own.numpy().tobytes()})
    as_views = PteData(program=_program_with_constants(), constants=[b"", b"\x01" * 24, tensor_memory(tied)],
                       named_data={"tied": tensor_memory(tied), "own": tensor_memory(own)})
    pte_bytes = serialize(as_views)
    assert pte_bytes == serialize(as_bytes) and pte_bytes.count(tied.numpy().tobytes()) == 1
    back = deserialize(pte_bytes)
    for blob in (back.named_data["tied"], back.named_data["own"], back.constants[2]):
        assert isinstance(blob, memoryview) and blob.readonly and blob.obj is pte_bytes
    assert back.named_data == {"tied": tied.numpy().tobytes(), "own": own.numpy().tobytes()}
