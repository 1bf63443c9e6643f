"""Executes reference-backend payloads on tensors, without the original program."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from .payload import PayloadError, decode, deserialize_program


class ReferenceRuntime:
    """``init(processed, compile_specs) -> handle``; ``execute(handle, args) -> outputs``.

    A handle owns the partition's constants and its mutable buffers, so buffer
    state persists across ``execute`` calls on the same handle.
    """

    def init(self, processed: bytes, compile_specs: Sequence[Any] = ()) -> "_Handle":
        doc, data = deserialize_program(processed)
        constants = {
            name: _tensor(data, meta) for name, meta in doc["constants"].items()
        }
        ops = [(n["name"], _resolve(n["op"]), n["args"], n["kwargs"]) for n in doc["nodes"]]
        return _Handle(doc, constants, ops)

    def execute(self, handle: "_Handle", args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[str, Any] = dict(handle.constants)
        user_inputs = [i["name"] for i in handle.doc["inputs"] if i["kind"] == "input"]
        if len(args) != len(user_inputs):
            raise PayloadError(f"payload expects {len(user_inputs)} inputs, got {len(args)}")
        env.update(zip(user_inputs, args))
        for name, fn, args_doc, kwargs_doc in handle.ops:
            env[name] = fn(*decode(args_doc, env), **decode(kwargs_doc, env))
        for mutation in handle.doc["mutations"]:
            handle.constants[mutation["buffer"]].copy_(decode(mutation["value"], env))
        return [decode(o, env) for o in handle.doc["outputs"]]


class _Handle:
    def __init__(self, doc: dict, constants: dict[str, torch.Tensor], ops: list) -> None:
        self.doc = doc
        self.constants = constants
        self.ops = ops


def _tensor(data: memoryview, meta: dict) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"])
    raw = bytearray(data[meta["offset"] : meta["offset"] + meta["nbytes"]])
    flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(meta["shape"]).clone()


def _resolve(op: str):
    if op == "getitem":
        return operator.getitem
    qualified, overload = op.rsplit(".", 1)
    namespace, name = qualified.split("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except AttributeError as exc:
        raise PayloadError(f"operator {op!r} is not available in this torch") from exc
