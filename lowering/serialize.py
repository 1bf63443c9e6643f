"""Serialization of stage outputs without pickle: a manifest plus content-addressed blobs.

An ``ExportedProgram`` becomes one small JSON *manifest* and a set of *blobs*
keyed by the sha256 of their bytes::

    manifest (canonical JSON, UTF-8)                 blobs: {sha256 hex: bytes}
    {
      "format": "lowerflow.exported_program",
      "version": 1,
      "graph": "<sha256 of the graph JSON blob>",   -> torch's JSON serde of the graph
      "state_dict": {"fc1.weight": TENSOR, ...},    -> raw tensor bytes, one blob each
      "constants": {"scale": TENSOR, ...},
      "example_inputs": {"treespec": "...", "leaves": [{"tensor": TENSOR} | {"value": 3}]} | null,
      "blobs": ["<sha256>", ...]                    every blob the manifest needs, sorted
    }
    TENSOR = {"blob": "<sha256>", "dtype": "float32", "shape": [256, 64],     (lowering.tensor_blobs)
              "stride": [64, 1], "parameter": true, "requires_grad": true}
    an int8 tensor whose values are all in [-8, 7] (8da4w's 4-bit weights) is stored
    packed, two values per byte: TENSOR + {"encoding": "int4"}, manifest version 2

Why this layout (see shared/MEASUREMENTS.md): consecutive lowering stages keep
the same weights, so a store that keys blobs by digest writes each weight once
for the whole pipeline, and only the small graph blob and manifest change from
stage to stage.  Every blob digest appears in the manifest, so the manifest's
own digest covers the whole program (a Merkle tree): equal manifest digests
mean equal programs.

Guarantees:

* Deterministic: the same program gives the same manifest and blobs in any
  process (torch's serde embeds ``id()`` of graphs in ``from_node`` metadata;
  those are written as 0).
* Loading never unpickles and never executes stored code: the graph is read by
  torch's JSON deserializer (after :func:`lowering.untrusted.check_program_bytes`: its
  symbolic sizes, which torch evaluates with ``eval``, are plain sympy), tensors are rebuilt from raw
  bytes with ``torch.frombuffer``; every blob is checked against its digest.
* Extensible: a later format (e.g. a program holding lowered modules) is another
  manifest ``format`` whose fields name further blobs (processed bytes, nested
  program manifests added with :func:`embed`, ...) and whose ``"blobs"`` list names
  them all, so stores can verify, copy and garbage-collect any manifest with
  :func:`manifest_blobs`.

Limits: tensors are stored dense; a tensor whose strides overlap or leave gaps
(e.g. an ``expand``) is stored contiguous.  Tensors that shared storage (tied
weights) load as separate tensors with equal values (stored once by digest).
Script objects (torchbind constants) are rejected.  Non-CPU tensors load on CPU.

Why one room: the program format and the delegated format are one contract
(the delegated manifest embeds program manifests written through the same
private graph JSON path, ``serialize_program(_allow_delegates=True)``, and
:func:`serialize_any` / :func:`deserialize_any` choose between the two), so a
change of the bytes written, and its version bump, shows in one file; split,
the delegated half would import the program half's private helpers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from .control_flow_graph import iter_scopes
from .delegation import SHARED_STATE, SHARED_WITH_TOP_LEVEL
from .quant_ops import register_quantized_ops
from . import tensor_blobs
from .tensor_blobs import DTYPES, SerializationError, blob_digest, tensor_from_blob, tensor_to_blob
from .untrusted import check_program_bytes

#: A tensor's memory as bytes: at home in :mod:`lowering.tensor_blobs`, still importable from here.
tensor_memory = tensor_blobs.tensor_memory

class _Serde:
    """torch's JSON serde (``torch._export.serde.serialize``), imported on first use: it
    imports ``torch._dynamo`` (~1.8 CPU-s), which a cached rerun that reads no program
    (only manifests, :func:`manifest_blobs`) never needs."""

    def __getattr__(self, name: str) -> Any:
        from torch._export.serde import serialize

        return getattr(serialize, name)


_serde = _Serde()

#: What a stored program refused for running code says.
STORE_RULE = "lowerflow reads the store without running code"

#: ``"format"`` of the manifest written by :func:`serialize_program`.
PROGRAM_FORMAT = "lowerflow.exported_program"
#: Bumped whenever the bytes written for the same program change.
PROGRAM_FORMAT_VERSION = 1
#: The version of a manifest holding a packed tensor (``"encoding": "int4"``, see
#: :func:`tensor_to_blob`): a reader that knows only version 1 refuses it, never misreads it.
PACKED_FORMAT_VERSION = 2

_GRAPH_ID = re.compile(r'"graph_id": -?\d+')

#: Placeholder metadata the lowering stages set and a later stage reads, which
#: torch's graph JSON drops (it keeps no metadata on graph inputs): written as the
#: manifest's ``"placeholder_meta"`` (only when some placeholder has one).
KEPT_PLACEHOLDER_META = (SHARED_WITH_TOP_LEVEL, SHARED_STATE)


@dataclass(frozen=True)
class Serialized:
    """A manifest and the blobs it names (``{sha256 hex: bytes}``; a tensor's blob is a
    read-only view of its memory, :func:`tensor_memory`)."""

    manifest: bytes
    blobs: dict[str, bytes]

    def get_blob(self, digest: str) -> bytes:
        """The blob with ``digest``; a ``get_blob`` for :func:`deserialize_program`."""
        try:
            return self.blobs[digest]
        except KeyError:
            raise SerializationError(f"blob {digest} is not in this serialized program") from None


# --------------------------------------------------------------------------- digests / JSON


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def read_manifest(manifest: bytes, *, expected_format: str | None = None) -> dict[str, Any]:
    """Parse a manifest, checking it is a JSON object with a ``format`` (and the expected one)."""
    try:
        obj = json.loads(manifest)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SerializationError(f"manifest is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("format"), str):
        raise SerializationError("manifest is not a JSON object with a 'format' field")
    if expected_format is not None and obj["format"] != expected_format:
        raise SerializationError(
            f"manifest has format {obj['format']!r}, expected {expected_format!r}"
        )
    return obj


def manifest_blobs(manifest: bytes) -> list[str]:
    """Digests of every blob a manifest (of any format) needs, from its ``"blobs"`` list."""
    blobs = read_manifest(manifest).get("blobs", [])
    if not isinstance(blobs, list) or not all(isinstance(b, str) for b in blobs):
        raise SerializationError("manifest field 'blobs' is not a list of digests")
    return blobs


# --------------------------------------------------------------------------- programs


def serialize_program(
    ep: ExportedProgram, *, keep_stack_traces: bool = True, _allow_delegates: bool = False
) -> Serialized:
    """``ep`` as a manifest plus blobs (graph JSON and one blob per distinct tensor).

    ``keep_stack_traces=False`` drops the source stack traces from node metadata,
    which makes the bytes independent of where the code lives on disk.
    """
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        digest = blob_digest(data)
        blobs[digest] = data
        return digest

    def tensors(table: Mapping[str, Any], what: str) -> dict[str, Any]:
        out = {}
        for name in sorted(table):
            value = table[name]
            if not isinstance(value, torch.Tensor):
                raise SerializationError(
                    f"{what} {name!r}: only tensors can be serialized, got {type(value).__name__}"
                )
            meta, data = tensor_to_blob(value, name=f"{what} {name!r}")
            add(data)
            out[name] = meta
        return out

    manifest = {
        "format": PROGRAM_FORMAT,
        "version": PROGRAM_FORMAT_VERSION,
        "graph": add(
            _graph_json(ep, keep_stack_traces=keep_stack_traces, allow_delegates=_allow_delegates)
        ),
        "state_dict": tensors(ep.state_dict, "state_dict entry"),
        "constants": tensors(ep.constants, "constant"),
        "example_inputs": _example_inputs_to_json(ep.example_inputs, add),
        "blobs": sorted(blobs),
    }
    leaves = (manifest["example_inputs"] or {}).get("leaves", [])
    tensors = [*manifest["state_dict"].values(), *manifest["constants"].values(), *(x["tensor"] for x in leaves if "tensor" in x)]
    if any("encoding" in meta for meta in tensors):
        manifest["version"] = PACKED_FORMAT_VERSION  # else as before: other programs' bytes (and keys) stay
    kept = placeholder_meta_of(ep.graph)
    if kept:  # absent otherwise: the bytes of every other program stay as they were
        manifest["placeholder_meta"] = kept
    return Serialized(canonical_json(manifest), blobs)


def with_new_tables(manifest: bytes, tables: Mapping[str, torch.Tensor], kept: Any = ()) -> Serialized | None:
    """The :func:`serialize_program` manifest of the program ``manifest`` names with every
    ``state_dict`` / ``constants`` entry taken from ``tables`` (same dtype and shape; its
    parameter flags kept), without reading its graph: the graph blob, example inputs and
    placeholder metadata stay.  ``kept``: entries that keep their stored value (a mutated
    buffer).  The blobs returned are the new tensors'.  None when an entry has no new value
    or another dtype or shape (or another manifest format).  Bytes as :func:`serialize_program`
    writes them for that program with those tables (the same graph JSON)::

        {"graph": G, "state_dict": {"w": W1}, ...}  +  {"w": w2}  ->  {"graph": G, "state_dict": {"w": W2}, ...}
    """
    obj = read_manifest(manifest)
    if obj["format"] != PROGRAM_FORMAT:
        return None
    blobs: dict[str, bytes] = {}
    for table in ("state_dict", "constants"):
        for name, meta in obj[table].items():
            new = tables.get(name)
            if new is None:
                if name in kept:
                    continue
                return None
            if str(new.dtype).removeprefix("torch.") != meta["dtype"] or list(new.shape) != meta["shape"]:
                return None
            new_meta, data = tensor_to_blob(new, name=f"{table} entry {name!r}")
            new_meta.update(parameter=meta["parameter"], requires_grad=meta["requires_grad"])
            blobs[new_meta["blob"]] = data
            obj[table][name] = new_meta
    leaves = (obj.get("example_inputs") or {}).get("leaves", [])
    metas = [*obj["state_dict"].values(), *obj["constants"].values(), *(x["tensor"] for x in leaves if "tensor" in x)]
    obj["blobs"] = sorted({obj["graph"], *(meta["blob"] for meta in metas)})
    obj["version"] = PACKED_FORMAT_VERSION if any("encoding" in meta for meta in metas) else PROGRAM_FORMAT_VERSION
    return Serialized(canonical_json(obj), blobs)


def placeholder_meta_of(graph: torch.fx.Graph) -> dict[str, dict[str, Any]]:
    """``{placeholder name: {key: value}}`` for the :data:`KEPT_PLACEHOLDER_META` keys set.

    E.g. a tied LM head's weight copy in an XNNPACK partition carries
    ``shared_with_top_level: True`` (:func:`lowering.partition.duplicate_shared_constants`),
    which tells preprocess to read the top level's bytes rather than store them twice.
    """
    kept = {}
    for node in graph.find_nodes(op="placeholder"):
        meta = {k: node.meta[k] for k in KEPT_PLACEHOLDER_META if node.meta.get(k) is not None}
        if meta:
            kept[node.name] = meta
    return kept


def apply_placeholder_meta(graph: torch.fx.Graph, kept: Mapping[str, Mapping[str, Any]]) -> None:
    """Set the metadata :func:`placeholder_meta_of` recorded on a reloaded graph."""
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    for name, meta in kept.items():
        if name not in placeholders:
            raise SerializationError(f"placeholder_meta names {name!r}, which is not an input of the graph")
        placeholders[name].meta.update(meta)


class _EveryEntry:
    """A ``skip`` that holds every name."""

    def __contains__(self, name: object) -> bool:
        return True


#: :func:`deserialize_tables`' ``skip`` of every entry: the tables' names, dtypes and shapes only.
EVERY_ENTRY = _EveryEntry()


def deserialize_tables(manifest: bytes, get_blob: Callable[[str], bytes],
                       skip: Any = frozenset()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(state_dict, constants)`` of a :func:`serialize_program` manifest, without reading
    its graph (torch's deserializer builds a fake tensor per node: most of a read's time):
    what binding new weights to a stored program needs of its source (:mod:`lowering.rebind`).
    ``skip``: entries whose bytes are not read (new weights replace them): each is a tensor on
    the ``meta`` device, of its dtype, shape and stride (a parameter stays one)."""
    obj = read_manifest(manifest, expected_format=PROGRAM_FORMAT)
    return _tables(obj, _checked_blobs(get_blob), skip)


@dataclass(frozen=True)
class CheckingReader:
    """A ``get_blob`` that checks every blob against its digest itself (the artifact store's
    reads: :meth:`tasks.store.ArtifactStore.get_program`): the blobs it returns are not
    hashed a second time here."""

    read: Callable[[str], bytes]

    def __call__(self, digest: str) -> bytes:
        return self.read(digest)


def _checked_blobs(get_blob: Callable[[str], bytes]) -> Callable[[str, str], bytes]:
    def blob(digest: str, what: str) -> bytes:
        data = get_blob(digest)
        if not isinstance(get_blob, CheckingReader) and blob_digest(data) != digest:
            raise SerializationError(f"{what}: blob {digest} does not match its digest")
        return data

    return blob


def _tables(obj: Mapping[str, Any], blob: Callable[[str, str], bytes], skip: Any = frozenset()) -> tuple[dict, dict]:
    if obj.get("version") not in (PROGRAM_FORMAT_VERSION, PACKED_FORMAT_VERSION):
        raise SerializationError(
            f"manifest version {obj.get('version')!r} is not {PROGRAM_FORMAT_VERSION} or {PACKED_FORMAT_VERSION}"
        )

    def tensors(table: Mapping[str, Any], what: str) -> dict[str, torch.Tensor]:
        return {
            name: _meta_tensor(meta) if name in skip else
            tensor_from_blob(meta, blob(meta["blob"], f"{what} {name!r}"), name=f"{what} {name!r}")
            for name, meta in table.items()
        }

    return tensors(obj["state_dict"], "state_dict entry"), tensors(obj["constants"], "constant")


def _meta_tensor(meta: Mapping[str, Any]) -> torch.Tensor:
    """The tensor ``meta`` describes, without its values (on the ``meta`` device)."""
    tensor = torch.empty_strided(meta["shape"], meta["stride"], dtype=DTYPES[meta["dtype"]], device="meta")
    return torch.nn.Parameter(tensor, requires_grad=bool(meta.get("requires_grad"))) if meta.get("parameter") \
        else tensor


def deserialize_program(manifest: bytes, get_blob: Callable[[str], bytes]) -> ExportedProgram:
    """Rebuild the program of a :func:`serialize_program` manifest.

    ``get_blob(digest) -> bytes`` fetches blobs (e.g. ``Serialized.get_blob`` or the
    artifact store); every blob is checked against its digest here.
    """
    obj = read_manifest(manifest, expected_format=PROGRAM_FORMAT)
    blob = _checked_blobs(get_blob)
    state_dict, constants = _tables(obj, blob)
    example_inputs = _example_inputs_from_json(obj.get("example_inputs"), blob)
    graph = bytes(blob(obj["graph"], "graph"))
    # torch's deserializer eval()s symbolic sizes: a graph blob someone else wrote is checked first.
    check_program_bytes(graph, f"stored program graph {obj['graph'][:12]}", rule=STORE_RULE, trust_hint=False)
    try:
        try:
            program = _deserialize_graph(graph, state_dict, constants, example_inputs)
        except Exception:
            # A backend's fused op (lowering.backend_ops) exists once its backend is
            # imported: import the registered backends, then try once more.
            from .backend_ops import load_backend_op_libraries

            if load_backend_op_libraries.cache_info().currsize:
                raise
            load_backend_op_libraries()
            program = _deserialize_graph(graph, state_dict, constants, example_inputs)
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(
            f"graph {obj['graph'][:12]}: torch cannot deserialize it: {type(exc).__name__}: {exc}"
        ) from exc
    apply_placeholder_meta(program.graph, obj.get("placeholder_meta", {}))
    drop_unused_output_getitems(program)
    return program


def _deserialize_graph(graph: bytes, state_dict, constants, example_inputs) -> ExportedProgram:
    register_quantized_ops(graph)  # a quantized program's q/dq ops must exist in torch.ops
    if b"llama." in graph:  # an LLM decoder's llama::custom_sdpa / update_cache (lowering.llm)
        from .llm.custom_ops import ensure_llama_ops

        ensure_llama_ops()
    serialized_ep = dataclass_of(_serde.ExportedProgram, json.loads(graph))
    # Dicts and tuples are used as they are: torch.load is never reached.
    return _serde.ExportedProgramDeserializer().deserialize(serialized_ep, state_dict, constants, example_inputs)


def dataclass_of(cls: Any, data: Any) -> Any:
    """``torch._export.serde.serialize._dict_to_dataclass(cls, data)``: torch's schema
    dataclass of parsed JSON ``data``, with each class's type hints computed once.

    torch's asks ``typing.get_type_hints`` again for every dataclass and union it builds
    (34k calls for a 256x4 Llama's programs, 8 of 16 CPU-s of reading them back); a
    weights-only night reads last night's programs back from the store, so that was most
    of its time.  Same walk otherwise; ``tests/test_serialize.py`` compares the two."""
    from torch._export.serde import serialize as serde

    return _dataclass_of(cls, data, serde._resolve_schema_cls, serde._Union)


def _dataclass_of(cls: Any, data: Any, resolve: Callable, union: type) -> Any:
    cls = resolve(cls)
    if isinstance(cls, str):
        raise AssertionError(f"Unresolved class type: '{cls}'.")
    origin = typing.get_origin(cls)
    if origin is None and isinstance(cls, type):
        if issubclass(cls, union):
            if not isinstance(data, dict) or len(data) != 1:
                raise AssertionError(f"expected a dict with 1 key for {cls.__name__}, got {data!r:.80}")
            ((tag, value),) = data.items()
            return cls.create(**{tag: _dataclass_of(_schema_hints(cls)[tag], value, resolve, union)})
        if dataclasses.is_dataclass(cls):
            hints = _schema_hints(cls)
            # as torch: keys the dataclass does not define are ignored (forward compatibility)
            return cls(**{name: _dataclass_of(hints[name], data[name], resolve, union)
                          for name in _schema_fields(cls) if name in data})
    else:
        if origin is typing.Annotated:
            return _dataclass_of(cls.__origin__, data, resolve, union)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
            if data is None:
                return None
            args = typing.get_args(cls)
            if len(args) != 2:
                raise AssertionError(f"expected 2 type args, got {len(args)}")
            return _dataclass_of(args[0], data, resolve, union)
    if isinstance(data, list):
        if not data:
            return data
        item = typing.get_args(cls)[0]
        return [_dataclass_of(item, d, resolve, union) for d in data]
    if isinstance(data, dict):
        item = typing.get_args(cls)[1]
        return {k: _dataclass_of(item, v, resolve, union) for k, v in data.items()}
    if cls is float:
        return float(data)
    return data


_SCHEMA_HINTS: dict[type, dict[str, Any]] = {}
_SCHEMA_FIELDS: dict[type, tuple[str, ...]] = {}


def _schema_hints(cls: type) -> dict[str, Any]:
    if cls not in _SCHEMA_HINTS:
        from torch._export.serde import schema

        _SCHEMA_HINTS[cls] = typing.get_type_hints(cls, globalns=vars(schema))
    return _SCHEMA_HINTS[cls]


def _schema_fields(cls: type) -> tuple[str, ...]:
    if cls not in _SCHEMA_FIELDS:
        _SCHEMA_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return _SCHEMA_FIELDS[cls]


#: How torch's serializer names an output of a multi-output node that no getitem read.
_UNUSED_OUTPUT = re.compile(r"_unused_\d+(?:_\d+)?$")


def drop_unused_output_getitems(ep: ExportedProgram) -> int:
    """Erase the getitem nodes torch's deserializer invents; returns how many (in place).

    torch's serializer names each output of a multi-output node that no getitem
    reads ``<node>_unused_<i>`` (a batch norm's saved mean and invstd, say), and
    its deserializer creates a getitem node for every output.  Without this, a
    program read back from the store has nodes the stored one did not: dead,
    untagged getitems on tagged nodes, which stage 3 fuses as extra partition
    outputs (issue 7: re-fusing a reloaded MobileNetV2 did not reproduce the
    plan), and extra graph steps for the memory planner.  Reversed order, so a
    list output's getitems go before the getitem of the list.
    """
    import operator

    erased = 0
    for node in reversed(list(ep.graph.nodes)):
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and not node.users
            and _UNUSED_OUTPUT.search(node.name)
        ):
            ep.graph.erase_node(node)
            erased += 1
    if erased:
        ep.graph_module.recompile()
    return erased


def embed(blobs: dict[str, bytes], child: Serialized) -> str:
    """Add ``child`` (a manifest and its blobs) to ``blobs``; returns the child manifest's digest.

    The building block of formats that hold other programs, e.g. a delegated
    program whose lowered modules keep their original program::

        blobs = {}
        top = embed(blobs, serialize_program(top_level_program))
        original = embed(blobs, serialize_program(lowered.original_module))
        processed = blob_digest(payload); blobs[processed] = payload
        manifest = canonical_json({"format": "lowerflow.delegated_program", "version": 1,
            "program": top, "delegates": [{"name": "lowered_module_0", "backend_id": ...,
            "compile_specs": [...], "processed": processed, "original_program": original}],
            "blobs": sorted(blobs)})

    A manifest's ``"blobs"`` lists every blob it needs, transitively, so stores
    verify and copy any format the same way; a child loads with
    ``deserialize_program(get_blob(digest), get_blob)``.
    """
    blobs.update(child.blobs)
    digest = blob_digest(child.manifest)
    blobs[digest] = child.manifest
    return digest


def _graph_json(ep: ExportedProgram, *, keep_stack_traces: bool, allow_delegates: bool = False) -> bytes:
    """torch's JSON serde of the graph alone (no tensors), normalized to be deterministic."""
    for node in ep.graph.nodes:
        if allow_delegates:
            break
        if node.op == "call_function" and "executorch_call_delegate" in str(node.target):
            raise SerializationError(
                f"node {node.name!r} calls a lowered module: serialize_program stores plain "
                "programs; programs holding lowered modules need a delegated-program format "
                "built with embed()"
            )
    try:
        obj = json_values(_serialized_dataclass(ep))
    except Exception as exc:
        raise SerializationError(
            f"torch cannot serialize the graph: {type(exc).__name__}: {exc}"
        ) from exc
    _normalize_graph(obj["graph_module"]["graph"], keep_stack_traces)
    return canonical_json(obj)


def _serialized_graph(ep: ExportedProgram) -> bytes:
    """The JSON ``torch._export.serde.serialize(ep).exported_program`` gives, without the
    tensors and without its self-check (``tests/test_serialize.py`` compares them)."""
    return _serde._to_json_bytes(_serialized_dataclass(ep))


def _serialized_dataclass(ep: ExportedProgram) -> Any:
    """torch's serialized form of ``ep`` (its ``schema.ExportedProgram`` dataclass),
    without the tensors and without its self-check.

    torch's ``ExportedProgramSerializer.serialize`` also canonicalizes a deep copy
    of the serialized program only to test that its canonical form is well
    defined, and throws the copy away.  That check cost 40% of serializing
    (11.5 s of 23 s over a cold bert + mobilenet_v2 + cnn fleet, profiled); the
    bytes are the same without it (``tests/test_serialize.py`` compares them).
    """
    ep.validate()
    with _serde._enable_graph_inputs_of_type_nn_module(ep.example_inputs):
        graph_module = _serde.GraphModuleSerializer(ep.graph_signature, ep.module_call_graph)
        serialized = _serde.ExportedProgram(
            graph_module=graph_module.serialize(ep.graph_module),
            opset_version=dict(_OPSET_VERSION),
            range_constraints=_serde.serialize_range_constraints(ep.range_constraints),
            schema_version=_serde.SchemaVersion(major=_serde.SCHEMA_VERSION[0], minor=_serde.SCHEMA_VERSION[1]),
            verifiers=[v.dialect for v in ep.verifiers],
            torch_version=torch.__version__,
            guards_code=ep._guards_code,
        )
    return serialized


def json_values(obj: Any) -> Any:
    """``json.loads(torch._export.serde.serialize._to_json_bytes(obj))``, without the bytes.

    torch turns its schema dataclasses into JSON in two walks (``_dataclass_to_dict``,
    then ``json.dumps`` with its ``EnumEncoder``); lowerflow then parsed the text back
    to normalize it.  The three were 7% of a cold flow run's CPU (py-spy, issue 9).
    This is one walk giving the same values: a union is ``{tag: value}``, a dataclass
    a dict of its fields, tuples are lists, an enum its value, bytes base64 text,
    ±inf and nan the strings torch writes, dict keys JSON's (``1`` -> ``"1"``,
    ``True`` -> ``"true"``).  Anything else JSON cannot hold raises ``TypeError``, as
    ``json.dumps`` does.  ``tests/test_serialize.py`` compares the two on every test
    model, delegated and dynamic ones included.
    """
    kind = type(obj)
    if kind is str or kind is int or kind is bool or obj is None:
        return obj
    if kind is list or kind is tuple:
        return [json_values(x) for x in obj]
    if kind is dict:
        return {_json_key(k): json_values(v) for k, v in obj.items()}
    if kind is float:
        return _json_float(obj)
    if isinstance(obj, _serde._Union):
        return {str.__str__(obj.type): json_values(obj.value)}
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(obj):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {name: json_values(getattr(obj, name)) for name in names}
    if isinstance(obj, Enum):  # what EnumEncoder (or JSON's own int/str handling) writes
        return json_values(obj.value)
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode("utf-8")
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _json_float(float(obj))
    if isinstance(obj, (list, tuple)):
        return [json_values(x) for x in obj]
    if isinstance(obj, dict):
        return {_json_key(k): json_values(v) for k, v in obj.items()}
    raise TypeError(f"Object of type {kind.__name__} is not JSON serializable")


#: Field names per schema dataclass (``dataclasses.fields`` is slow to call per object).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _json_float(value: float) -> float | str:
    """torch's spelling of the floats JSON has no literal for."""
    if value == math.inf:
        return "Infinity"
    if value == -math.inf:
        return "-Infinity"
    return "NaN" if math.isnan(value) else value


def _json_key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (it allows str, int, float, bool, None)."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is True or key is False:
        return "true" if key else "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        if math.isinf(key) or math.isnan(key):
            raise ValueError("Out of range float values are not JSON compliant")
        return float.__repr__(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


#: The opset ``ExportedProgramSerializer()`` records: ATen's operator version.
_OPSET_VERSION = {"aten": torch._C._get_max_operator_version()}


def _normalize_graph(graph: dict[str, Any], keep_stack_traces: bool) -> None:
    """Make the graph JSON a function of the program alone (in place).

    * ``from_node`` provenance names graphs by ``id()``: meaningless in another
      process, and ids of freed temporary graphs are reused within one, so two
      graphs may or may not share an id from run to run.  All are written as 0.
    * Storage offsets of traced views: torch's deserializer resets them to 0, so
      they are written as 0 and ``serialize(deserialize(x)) == x`` holds.
    """
    for value in graph.get("tensor_values", {}).values():
        if isinstance(value, dict) and "storage_offset" in value:
            value["storage_offset"] = {"as_int": 0}
    for node in graph.get("nodes", []):
        metadata = node.get("metadata") or {}
        if "from_node" in metadata:
            metadata["from_node"] = _GRAPH_ID.sub('"graph_id": 0', metadata["from_node"])
        if not keep_stack_traces:
            metadata.pop("stack_trace", None)


def _example_inputs_to_json(example_inputs: Any, add: Callable[[bytes], str]) -> dict | None:
    """Example inputs as a pytree spec plus leaves (tensor metadata or JSON scalars)."""
    if example_inputs is None:
        return None
    leaves, spec = pytree.tree_flatten(example_inputs)
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            meta, data = tensor_to_blob(leaf, name=f"example input leaf {i}")
            add(data)
            out.append({"tensor": meta})
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append({"value": leaf})
        else:
            raise SerializationError(
                f"example input leaf {i}: cannot serialize a {type(leaf).__name__}"
            )
    return {"treespec": pytree.treespec_dumps(spec), "leaves": out}


def _example_inputs_from_json(obj: dict | None, blob: Callable[[str, str], bytes]) -> Any:
    if obj is None:
        return None
    leaves = []
    for i, leaf in enumerate(obj["leaves"]):
        if "tensor" in leaf:
            what = f"example input leaf {i}"
            leaves.append(tensor_from_blob(leaf["tensor"], blob(leaf["tensor"]["blob"], what), name=what))
        else:
            leaves.append(leaf["value"])
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(obj["treespec"]))


# --------------------------------------------------------------------------- delegated programs

#: ``"format"`` of the manifest written by :func:`serialize_delegated_program`.
DELEGATED_FORMAT = "lowerflow.delegated_program"
DELEGATED_FORMAT_VERSION = 1


def serialize_delegated_program(ep: ExportedProgram, *, keep_stack_traces: bool = True) -> Serialized:
    """A program holding lowered modules, as a manifest plus blobs::

        {"format": "lowerflow.delegated_program", "version": 1,
         "program": <top-level program manifest>,        # delegate calls name their module
         "delegates": [{"name": "lowered_module_0", "backend_id": "ReferenceBackend",
                        "compile_specs": [{"key": "k", "value": "<hex>"}],
                        "processed": <blob>, "original_program": <program manifest>,
                        "named_data": [{"key": k, "blob": <blob>}, ...]   # only when non-empty
                        }, ...],
         "blobs": [...every blob, transitively...]}

    torch's serde writes a delegate call's module argument as the string
    ``"<name>-<backend id>"``; :func:`deserialize_delegated_program` links it back.
    A program without lowered modules is stored the same way with no delegates.
    A lowered module inside a cond branch / map body is named by its scope
    (``"true_graph_0/lowered_module_0"``).
    """
    from .delegate import is_lowered_module

    blobs: dict[str, bytes] = {}
    delegates = []
    found = []
    for scope, gm in iter_scopes(ep.graph_module):
        for node in gm.graph.nodes:
            if node.op == "get_attr" and is_lowered_module(getattr(gm, node.target, None)):
                found.append((scope + node.target, getattr(gm, node.target)))
    for name, lowered in found:
        lowered.module_name = name  # what torch's serde writes for the call's argument
        processed = blob_digest(lowered.processed_bytes)
        blobs[processed] = lowered.processed_bytes
        entry = {
            "name": name,
            "backend_id": lowered.backend_id,
            "compile_specs": [{"key": c.key, "value": c.value.hex()} for c in lowered.compile_specs],
            "processed": processed,
            "original_program": embed(
                blobs, serialize_program(lowered.original_module, keep_stack_traces=keep_stack_traces)
            ),
        }
        named = getattr(lowered, "named_data", None) or {}
        if named:  # absent when empty: manifests of earlier programs stay byte-identical
            entry["named_data"] = named_data_to_json(named, blobs)
        delegates.append(entry)
    top = embed(blobs, serialize_program(ep, keep_stack_traces=keep_stack_traces, _allow_delegates=True))
    manifest = {
        "format": DELEGATED_FORMAT,
        "version": DELEGATED_FORMAT_VERSION,
        "program": top,
        "delegates": delegates,
        "blobs": sorted(blobs),
    }
    return Serialized(canonical_json(manifest), blobs)


def deserialize_delegated_program(manifest: bytes, get_blob: Callable[[str], bytes]) -> ExportedProgram:
    """Rebuild a :func:`serialize_delegated_program` program with its lowered modules."""
    from .delegation import CompileSpec
    from .lowered_module import LoweredBackendModule
    from .program import rebuild_program

    obj = read_manifest(manifest, expected_format=DELEGATED_FORMAT)
    if obj.get("version") != DELEGATED_FORMAT_VERSION:
        raise SerializationError(f"manifest version {obj.get('version')!r} is not {DELEGATED_FORMAT_VERSION}")

    blob = _checked_blobs(get_blob)
    program = deserialize_program(blob(obj["program"], "top-level program"), get_blob)
    modules = {}
    for entry in obj["delegates"]:
        name = entry["name"]
        original = deserialize_program(blob(entry["original_program"], f"{name} program"), get_blob)
        specs = [CompileSpec(c["key"], bytes.fromhex(c["value"])) for c in entry["compile_specs"]]
        # bytes, as a lowered module holds them (a store may hand writable buffers, for tensors)
        named = named_data_from_json(entry.get("named_data", []), lambda d, w: bytes(blob(d, f"{name} {w}")))
        modules[name] = LoweredBackendModule(
            original, entry["backend_id"], bytes(blob(entry["processed"], f"{name} payload")), specs, named
        )
    for scope, gm in list(iter_scopes(program.graph_module)):
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or "executorch_call_delegate" not in str(node.target):
                continue
            reference = node.args[0]
            name = reference.split("-", 1)[0] if isinstance(reference, str) else None
            if name not in modules or not name.startswith(scope):
                raise SerializationError(f"delegate call {node.name!r} names unknown lowered module {reference!r}")
            local = name[len(scope):]
            gm.add_submodule(local, modules[name])
            with gm.graph.inserting_before(node):
                attr = gm.graph.get_attr(local)
            node.args = (attr, *node.args[1:])
        gm.recompile()
    return rebuild_program(program)


def named_data_to_json(named_data: Mapping[str, bytes], blobs: dict[str, bytes]) -> list[dict[str, str]]:
    """A lowered module's named data as ``[{"key": k, "blob": <sha256>}]`` (sorted by key);
    each blob is added to ``blobs`` under its digest (content-addressed, stored once)."""
    out = []
    for key in sorted(named_data):
        data = named_data[key]  # bytes or a weight's read-only view: stored as it is
        digest = blob_digest(data)
        blobs[digest] = data
        out.append({"key": key, "blob": digest})
    return out


def named_data_from_json(
    entries: list[dict[str, str]], blob: Callable[[str, str], bytes]
) -> dict[str, bytes]:
    """Inverse of :func:`named_data_to_json`; ``blob(digest, what)`` returns verified bytes."""
    if not isinstance(entries, list):
        raise SerializationError("field 'named_data' is not a list")
    named = {}
    for entry in entries:
        try:
            key, digest = entry["key"], entry["blob"]
        except (KeyError, TypeError):
            raise SerializationError(f"bad named data entry {entry!r}") from None
        named[key] = blob(digest, f"named data {key!r}")
    return named


def serialize_any(ep: ExportedProgram, *, keep_stack_traces: bool = True) -> Serialized:
    """A plain program in the program format, one holding lowered modules in the delegated one."""
    from .delegate import executorch_call_delegate

    if any(n.target is executorch_call_delegate for _, gm in iter_scopes(ep.graph_module) for n in gm.graph.nodes):
        return serialize_delegated_program(ep, keep_stack_traces=keep_stack_traces)
    return serialize_program(ep, keep_stack_traces=keep_stack_traces)


def deserialize_any(manifest: bytes, get_blob: Callable[[str], bytes]) -> ExportedProgram:
    """Load a manifest written by :func:`serialize_any`, whichever format it has."""
    if read_manifest(manifest)["format"] == DELEGATED_FORMAT:
        return deserialize_delegated_program(manifest, get_blob)
    return deserialize_program(manifest, get_blob)
