"""The reference backend's payload: a partition's program as JSON + raw tensor bytes.

Layout (all integers little-endian)::

    b"LFRB" | u32 version | u64 json length | json (utf-8) | pad to 16 | tensor data

The JSON lists the program's inputs (user inputs and the names of its
constants), its nodes in execution order (op by qualified name, arguments
encoded without pickle), its outputs and buffer mutations, and for each
constant its dtype, shape and offset into the tensor data (16-byte aligned).
The same program always gives the same bytes.
"""

from __future__ import annotations

import json
import operator
import struct

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

MAGIC = b"LFRB"
VERSION = 1
_HEADER = struct.Struct("<4sIQ")
ALIGNMENT = 16


class PayloadError(ValueError):
    """A payload that cannot be written or read."""


def serialize_program(program: ExportedProgram) -> bytes:
    """Serialize ``program`` (edge form, static shapes) into a payload."""
    sig = program.graph_signature
    constants, data = {}, bytearray()
    inputs = []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            inputs.append({"name": name, "kind": "input"})
            continue
        tensor = (program.constants if spec.target in program.constants else program.state_dict)[spec.target]
        offset = _append_tensor(data, tensor)
        constants[name] = {
            "dtype": _dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "offset": offset,
            "nbytes": tensor.numel() * tensor.element_size(),
        }
        inputs.append({"name": name, "kind": "buffer" if spec.kind == InputKind.BUFFER else "constant"})
    nodes = [_encode_node(n) for n in program.graph.nodes if n.op == "call_function"]
    output = program.graph.output_node()
    outputs, mutations = [], []
    for spec, arg in zip(sig.output_specs, output.args[0]):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buffer = next(s.arg.name for s in sig.input_specs if s.target == spec.target)
            mutations.append({"buffer": buffer, "value": _encode(arg)})
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(_encode(arg))
        else:
            raise PayloadError(f"output kind {spec.kind.name} is not supported")
    doc = {
        "inputs": inputs,
        "constants": constants,
        "nodes": nodes,
        "outputs": outputs,
        "mutations": mutations,
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    head = _HEADER.pack(MAGIC, VERSION, len(text)) + text
    return bytes(head + bytes(_pad(len(head))) + data)


def deserialize_program(payload: bytes) -> tuple[dict, memoryview]:
    """The JSON document and the tensor data of a payload."""
    if len(payload) < _HEADER.size:
        raise PayloadError("payload is shorter than its header")
    magic, version, length = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"not a reference-backend payload (magic {magic!r})")
    if version != VERSION:
        raise PayloadError(f"payload version {version} is not supported (expected {VERSION})")
    start = _HEADER.size
    doc = json.loads(bytes(payload[start : start + length]))
    data_start = start + length + _pad(start + length)
    return doc, memoryview(payload)[data_start:]


def _append_tensor(data: bytearray, tensor: torch.Tensor) -> int:
    data.extend(bytes(_pad(len(data))))
    offset = len(data)
    flat = tensor.detach().contiguous().view(-1)
    data.extend(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return offset


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def _encode_node(node: torch.fx.Node) -> dict:
    target = node.target
    if target is operator.getitem:
        op = "getitem"
    elif isinstance(target, torch._ops.OpOverload):
        op = f"{target._schema.name}.{target._overloadname}"
    else:
        raise PayloadError(f"node {node.name!r}: target {target} cannot be serialized")
    return {"name": node.name, "op": op, "args": _encode(list(node.args)), "kwargs": _encode(dict(node.kwargs))}


def _encode(value):
    if isinstance(value, torch.fx.Node):
        return {"$node": value.name}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"$dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"$dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).split(".")[-1]}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).split(".")[-1]}
    if isinstance(value, float):
        return {"$float": repr(value)}  # exact, and keeps inf/nan valid JSON
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise PayloadError(f"argument {value!r} of type {type(value).__name__} cannot be serialized")


def decode(value, env: dict):
    """Inverse of the argument encoding; node references are looked up in ``env``."""
    if isinstance(value, list):
        return [decode(v, env) for v in value]
    if isinstance(value, dict):
        (key, inner), = value.items()
        if key == "$node":
            return env[inner]
        if key == "$dict":
            return {k: decode(v, env) for k, v in inner.items()}
        if key == "$dtype":
            return getattr(torch, inner)
        if key == "$device":
            return torch.device(inner)
        if key == "$memory_format":
            return getattr(torch, inner)
        if key == "$layout":
            return getattr(torch, inner)
        if key == "$float":
            return float(inner)
        raise PayloadError(f"unknown encoded value {key!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]
