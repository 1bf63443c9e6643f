"""Pickle-free, deterministic serialization of exported programs (lowering.serialize)."""

from __future__ import annotations

import copy
import functools
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from examples.models import MODELS
from lowering.export import export
from lowering.serialize import (
    PROGRAM_FORMAT,
    SerializationError,
    Serialized,
    blob_digest,
    canonical_json,
    deserialize_program,
    embed,
    manifest_blobs,
    read_manifest,
    serialize_delegated_program,
    serialize_program,
    tensor_from_blob,
    tensor_to_blob,
)

REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def edge_program(name: str):
    """The edge program with weights as exported (not folded), so layouts name them."""
    model, inputs = MODELS[name]()
    return export(model, inputs, fold_constants=False), inputs


def _outputs(ep, inputs):
    """Outputs of a copy of ``ep`` (running a program mutates its buffers)."""
    return pytree.tree_leaves(copy.deepcopy(ep).module()(*inputs))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_roundtrip_gives_the_same_program(name):
    ep, inputs = edge_program(name)
    s = serialize_program(ep)
    loaded = deserialize_program(s.manifest, s.get_blob)
    for a, b in zip(_outputs(ep, inputs), _outputs(loaded, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert loaded.graph_signature == ep.graph_signature
    for table, loaded_table in ((ep.state_dict, loaded.state_dict), (ep.constants, loaded.constants)):
        assert set(loaded_table) == set(table)
        for key, value in table.items():
            assert type(loaded_table[key]) is type(value), key
            assert torch.equal(loaded_table[key], value), key
    # Stable under a round trip: a cache hit reproduces the digests of a recompute.
    assert serialize_program(loaded) == s


@pytest.mark.parametrize("name", sorted(MODELS))
def test_graph_json_is_what_torch_serializes(name):
    """lowerflow skips torch's discarded canonical-form self-check; the JSON must not change."""
    from torch._export.serde import serialize as serde

    from lowering.serialize import _serialized_graph

    ep, _ = edge_program(name)
    torch_json = serde.serialize(
        ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
    ).exported_program
    assert _serialized_graph(ep) == torch_json


def _dynamic_and_delegated_programs():
    """Programs whose serialized form has what the test models' lack: symbolic sizes and
    ranges (bounded and unbounded ranges, unions of ints and symbols), lowered modules, cond branches."""
    from examples.models import CONTROL_FLOW_MODELS
    from examples.dynamic_models import dynamic_mlp, gpt_decoder
    from lowering.backends.reference import ReferencePartitioner
    from lowering.to_backend import to_backend

    programs = {}
    for name, factory in (("dynamic_mlp", dynamic_mlp), ("gpt_decoder", gpt_decoder)):
        model, inputs, shapes = factory()
        programs[name] = export(model, inputs, dynamic_shapes=shapes)
    unbounded = torch.export.Dim("n")  # no max
    programs["unbounded"] = torch.export.export(
        torch.nn.Linear(4, 2), (torch.randn(3, 4),), dynamic_shapes=({0: unbounded},))
    programs["delegated_mlp"] = to_backend(copy.deepcopy(edge_program("mlp")[0]), ReferencePartitioner())
    serialize_delegated_program(programs["delegated_mlp"])  # names its lowered modules for torch's serde
    name = sorted(CONTROL_FLOW_MODELS)[0]
    model, inputs = CONTROL_FLOW_MODELS[name]()[:2]
    programs[f"cf_{name}"] = export(model, inputs)
    return programs


def test_json_values_equal_torchs_json_on_every_kind_of_program():
    """lowerflow converts torch's schema dataclasses to JSON values in one walk
    (json_values); they must equal what torch's JSON text parses to."""
    from torch._export.serde import serialize as serde

    from lowering.serialize import _serialized_dataclass, json_values

    programs = {name: edge_program(name)[0] for name in MODELS} | _dynamic_and_delegated_programs()
    for name, ep in programs.items():
        serialized = _serialized_dataclass(ep)
        assert json_values(serialized) == json.loads(serde._to_json_bytes(serialized)), name
    ranges = json_values(_serialized_dataclass(programs["gpt_decoder"]))["range_constraints"]
    assert {"min_val": 1, "max_val": 16} in ranges.values()


def test_dataclass_of_equals_torchs_on_every_kind_of_program():
    """lowerflow reads torch's schema dataclasses back with each class's type hints computed
    once (dataclass_of); it must build what torch's _dict_to_dataclass builds."""
    from torch._export.serde import serialize as serde

    from lowering.serialize import _serialized_dataclass, dataclass_of, json_values

    programs = {name: edge_program(name)[0] for name in MODELS} | _dynamic_and_delegated_programs()
    for name, ep in programs.items():
        data = json_values(_serialized_dataclass(ep))
        ours, torchs = dataclass_of(serde.ExportedProgram, data), serde._dict_to_dataclass(serde.ExportedProgram, data)
        assert ours == torchs, name
        assert json_values(ours) == data, name


def test_json_values_follow_json_for_keys_enums_bytes_and_floats():
    import enum

    from lowering.serialize import json_values

    class Color(enum.Enum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    value = {1: (Color.RED, Level.HIGH), False: b"\x00\xff", None: [float("inf"), float("-inf"), 1.5],
             2.5: float("nan"), "s": {"t": ()}}
    assert json_values(value) == {"1": ["red", 3], "false": "AP8=", "null": ["Infinity", "-Infinity", 1.5],
                                  "2.5": "NaN", "s": {"t": []}}
    with pytest.raises(TypeError):
        json_values({"x": object()})
    with pytest.raises(TypeError):
        json_values({(1, 2): 3})


def test_manifest_layout():
    ep, _ = edge_program("lifted_constant")
    s = serialize_program(ep)
    manifest = read_manifest(s.manifest, expected_format=PROGRAM_FORMAT)
    assert set(manifest) == {"format", "version", "graph", "state_dict", "constants", "example_inputs", "blobs"}
    assert manifest["constants"]["scale"] == {
        "blob": blob_digest(ep.constants["scale"].numpy().tobytes()),
        "dtype": "float32",
        "shape": [16],
        "stride": [1],
        "parameter": False,
        "requires_grad": False,
    }
    assert manifest["state_dict"]["fc.weight"]["parameter"] is True
    assert manifest_blobs(s.manifest) == sorted(s.blobs)
    assert all(blob_digest(data) == digest for digest, data in s.blobs.items())
    json.loads(s.blobs[manifest["graph"]])  # the graph is torch's JSON serde


def test_identical_weights_are_identical_blobs_across_programs():
    ep, _ = edge_program("mlp")
    with_traces = serialize_program(ep)
    without = serialize_program(ep, keep_stack_traces=False)
    assert with_traces.manifest != without.manifest
    assert len(set(with_traces.blobs) ^ set(without.blobs)) == 2  # only the graph blobs differ
    assert b"stack_trace" not in without.blobs[json.loads(without.manifest)["graph"]]


def test_bytes_are_identical_in_another_process():
    script = textwrap.dedent(
        """
        import json, warnings
        warnings.filterwarnings("ignore")
        from examples.models import MODELS
        from lowering.export import export
        from lowering.serialize import blob_digest, serialize_program
        names = %r
        out = {n: blob_digest(serialize_program(export(*MODELS[n](), fold_constants=False)).manifest) for n in names}
        print(json.dumps(out))
        """
    )
    names = ["mlp", "cnn", "transformer", "buffer_mutation", "lifted_constant", "multi_output"]
    script = script % (names,)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    ours = {n: blob_digest(serialize_program(edge_program(n)[0]).manifest) for n in names}
    assert theirs == ours


def test_loading_never_unpickles(monkeypatch):
    serialized = {n: serialize_program(edge_program(n)[0]) for n in MODELS}

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling during deserialize_program")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    for name, s in serialized.items():
        deserialize_program(s.manifest, s.get_blob)


def test_a_tampered_blob_is_rejected_naming_the_entry():
    ep, _ = edge_program("mlp")
    s = serialize_program(ep)
    digest = json.loads(s.manifest)["state_dict"]["fc2.bias"]["blob"]
    blobs = dict(s.blobs)
    blobs[digest] = b"\0" * len(blobs[digest])
    with pytest.raises(SerializationError, match="state_dict entry 'fc2.bias'"):
        deserialize_program(s.manifest, Serialized(s.manifest, blobs).get_blob)
    with pytest.raises(SerializationError, match="not in this serialized program"):
        deserialize_program(s.manifest, Serialized(s.manifest, {}).get_blob)


def test_bad_manifests_are_rejected():
    with pytest.raises(SerializationError, match="not valid JSON"):
        read_manifest(b"\x80not json")
    with pytest.raises(SerializationError, match="'format'"):
        read_manifest(b"[1, 2]")
    with pytest.raises(SerializationError, match="expected 'lowerflow.exported_program'"):
        deserialize_program(b'{"format": "lowerflow.delegated_program"}', lambda d: b"")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.tensor(3.5, dtype=torch.float64),
        torch.empty(0, 5),
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.arange(4, dtype=torch.int8),
        torch.tensor([-9, 0, 7], dtype=torch.int8),
        torch.tensor([[-8, 7, 0], [-1, 3, 5]], dtype=torch.int8).t(),
        torch.linspace(-1, 1, 10).to(torch.bfloat16),
        torch.linspace(-1, 1, 10).to(torch.float16),
        torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)).to(memory_format=torch.channels_last),
        torch.arange(12.0).reshape(3, 4).t(),
    ],
    ids=["f32", "scalar_f64", "empty", "bool", "i64", "i8", "i8_wide", "i4_transposed_odd", "bf16", "f16",
         "channels_last", "transposed"],
)
def test_tensor_blobs_keep_dtype_shape_values_and_dense_strides(tensor):
    meta, data = tensor_to_blob(tensor)
    four_bits = tensor.dtype == torch.int8 and tensor.numel() > 1 and -8 <= int(tensor.min()) and int(tensor.max()) <= 7
    assert meta.get("encoding") == ("int4" if four_bits else None)  # two values a byte (an 8da4w weight)
    size = (tensor.numel() + 1) // 2 if four_bits else tensor.numel() * tensor.element_size()
    assert meta["blob"] == blob_digest(data) and len(data) == size
    back = tensor_from_blob(meta, data)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.stride() == tensor.stride()
    assert torch.equal(back, tensor)


def test_a_program_of_4_bit_weights_stores_them_packed_and_reads_them_back_bit_for_bit():
    """8da4w's int8 weights in [-8, 7] are stored two a byte, in a manifest of version 2 (a
    reader of version 1 refuses it); a program without such a tensor is written as before."""
    ep, inputs = edge_program("mlp")
    plain = read_manifest(serialize_program(ep).manifest)
    assert plain["version"] == 1 and not any("encoding" in m for m in plain["state_dict"].values())
    quantized = copy.deepcopy(ep)
    name = next(n for n, t in quantized.state_dict.items() if t.dim() == 2)
    weight = quantized.state_dict[name]
    values = torch.randint(-8, 8, weight.shape, generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    quantized.state_dict[name] = torch.nn.Parameter(values, requires_grad=False)
    s = serialize_program(quantized)
    manifest = read_manifest(s.manifest)
    assert manifest["version"] == 2 and manifest["state_dict"][name]["encoding"] == "int4"
    assert len(s.blobs[manifest["state_dict"][name]["blob"]]) == values.numel() // 2
    back = deserialize_program(s.manifest, s.get_blob).state_dict[name]
    assert back.dtype == torch.int8 and torch.equal(back, values)
    with pytest.raises(SerializationError, match="encoded 'int4'"):  # unpacked bytes under a packed tensor's meta
        tensor_from_blob(manifest["state_dict"][name], values.numpy().tobytes())


def test_tensor_blob_details():
    expanded = torch.arange(3.0).expand(4, 3)  # overlapping strides: stored contiguous
    meta, data = tensor_to_blob(expanded)
    assert meta["stride"] == [3, 1] and torch.equal(tensor_from_blob(meta, data), expanded)
    param = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    back = tensor_from_blob(*tensor_to_blob(param))
    assert isinstance(back, torch.nn.Parameter) and not back.requires_grad
    with pytest.raises(SerializationError, match="'w': expected a tensor"):
        tensor_to_blob("not a tensor", name="'w'")
    with pytest.raises(SerializationError, match="unsupported tensor"):
        tensor_to_blob(torch.eye(2).to_sparse())
    with pytest.raises(SerializationError, match="do not hold"):
        tensor_from_blob(meta, data[:-4])


def test_embed_builds_formats_that_hold_programs():
    """How a delegated-program format composes programs and payloads (see embed())."""
    top, _ = edge_program("mlp")
    original, inputs = edge_program("lifted_constant")
    blobs: dict[str, bytes] = {}
    top_digest = embed(blobs, serialize_program(top))
    original_digest = embed(blobs, serialize_program(original))
    payload = b"backend bytes"
    blobs[blob_digest(payload)] = payload
    manifest = canonical_json(
        {
            "format": "lowerflow.delegated_program",
            "version": 1,
            "program": top_digest,
            "delegates": [{"backend_id": "reference", "processed": blob_digest(payload), "original_program": original_digest}],
            "blobs": sorted(blobs),
        }
    )
    assert set(manifest_blobs(manifest)) == set(blobs)
    loaded = deserialize_program(blobs[original_digest], blobs.__getitem__)
    torch.testing.assert_close(_outputs(loaded, inputs), _outputs(original, inputs), rtol=0, atol=0)


def test_a_program_holding_lowered_modules_is_refused_clearly():
    from lowering import to_backend
    from lowering.backends.reference import ReferencePartitioner

    delegated = to_backend(copy.deepcopy(edge_program("mlp")[0]), ReferencePartitioner())
    with pytest.raises(SerializationError, match="calls a lowered module"):
        serialize_program(delegated)


def test_shared_with_top_level_survives_the_store():
    """A partition's copy of a tied weight keeps ``shared_with_top_level`` through the store
    (torch's graph JSON keeps no placeholder metadata): read back, XNNPACK preprocess still
    stores the tied LM head once.  Programs without it write no ``placeholder_meta``."""
    from lowering.delegation import SHARED_WITH_TOP_LEVEL

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, ids):
            return torch.nn.functional.embedding(ids, self.w) @ self.w.t()

    program = export(Tied(), (torch.tensor([1, 2]),))
    plain = serialize_program(program, keep_stack_traces=False)
    assert "placeholder_meta" not in json.loads(plain.manifest)
    weight = next(iter(program.graph.find_nodes(op="placeholder")))
    weight.meta[SHARED_WITH_TOP_LEVEL] = True
    flagged = serialize_program(program, keep_stack_traces=False)
    assert json.loads(flagged.manifest)["placeholder_meta"] == {weight.name: {SHARED_WITH_TOP_LEVEL: True}}
    back = deserialize_program(flagged.manifest, flagged.get_blob)
    marked = [n.name for n in back.graph.find_nodes(op="placeholder") if n.meta.get(SHARED_WITH_TOP_LEVEL)]
    assert marked == [weight.name]
    assert serialize_program(back, keep_stack_traces=False).manifest == flagged.manifest


def test_the_cli_and_flow_modules_leave_torchs_serde_to_the_first_program_read(tmp_path):
    """A cached rerun reads manifests only (manifest_blobs): importing the CLI, the flow and
    this module imports no ``torch._export.serde`` (which imports ``torch._dynamo``, ~1.8
    CPU-s); serializing a program imports it then."""
    code = textwrap.dedent("""
        import sys
        import flows.cli, flows.lower_model
        from lowering.serialize import manifest_blobs, serialize_program
        assert manifest_blobs(b'{"format": "x", "blobs": ["ab"]}') == ["ab"]
        print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._export.serde"))))
        import torch
        from examples.models import MODELS
        from lowering.export import export
        model, inputs = MODELS["mlp"]()
        serialize_program(export(model, inputs))
        print("torch._export.serde.serialize" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.splitlines()
    assert out == ["[]", "True"]
