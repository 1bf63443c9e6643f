"""torch's JSON-to-dataclass step of program deserialization, each class's type hints resolved once.

torch's ``_dict_to_dataclass`` (``torch._export.serde.serialize``) calls
``typing.get_type_hints`` on every object it builds: reading a quantized
SmolLM2-135M program back (4,268 nodes) made 82,769 such calls, most of its
CPU.  :func:`bytes_to_dataclass` is the same walk with the hints of each class
computed once: the same dataclasses, field for field.

Before::  _dict_to_dataclass(Node, {...})   -> get_type_hints(Node) at every node
After::   dict_to_dataclass(Node, {...})    -> get_type_hints(Node) once per process
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Annotated, Any


def _schema():
    from torch._export.serde import schema

    return schema


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a schema class, as torch's serde resolves them (once)."""
    return typing.get_type_hints(cls, globalns=vars(_schema()))


def _resolve(cls: Any) -> Any:
    if isinstance(cls, str):
        resolved = getattr(_schema(), cls, None)
        if resolved is not None:
            return resolved
    if isinstance(cls, typing.ForwardRef):
        return _resolve(cls.__forward_arg__)
    return cls


def dict_to_dataclass(cls: Any, data: Any) -> Any:
    """torch's ``_dict_to_dataclass`` (torch 2.13), with :func:`type_hints` cached."""
    from torch._export.serde.union import _Union

    cls = _resolve(cls)
    if isinstance(cls, str):
        raise AssertionError(f"Unresolved class type: '{cls}'.")
    if typing.get_origin(cls) is Annotated:
        return dict_to_dataclass(cls.__origin__, data)
    if typing.get_origin(cls) in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
        if data is None:
            return None
        args = typing.get_args(cls)
        if len(args) != 2:
            raise AssertionError(f"expected 2 type args, got {len(args)}")
        return dict_to_dataclass(args[0], data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        if not isinstance(data, dict) or len(data) != 1:
            raise AssertionError(f"expected a dict with 1 key, got {data!r:.80}")
        (name, value), = data.items()
        if not isinstance(name, str):
            raise AssertionError(f"expected str key, got {type(name).__name__}")
        return cls.create(**{name: dict_to_dataclass(type_hints(cls)[name], value)})
    if dataclasses.is_dataclass(cls):
        hints = type_hints(cls)
        return cls(**{f.name: dict_to_dataclass(hints[f.name], data[f.name])
                      for f in dataclasses.fields(cls) if f.name in data})
    if isinstance(data, list):
        if not data:
            return data
        item = typing.get_args(cls)[0]
        return [dict_to_dataclass(item, d) for d in data]
    if isinstance(data, dict):
        value = typing.get_args(cls)[1]
        return {k: dict_to_dataclass(value, v) for k, v in data.items()}
    if cls is float:
        return float(data)
    return data


def bytes_to_dataclass(cls: Any, artifact: bytes) -> Any:
    """torch's ``_bytes_to_dataclass``: UTF-8 JSON to ``cls``."""
    return dict_to_dataclass(cls, json.loads(artifact.decode("utf-8")))
