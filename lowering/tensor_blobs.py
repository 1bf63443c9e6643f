"""One tensor as a blob of raw bytes plus the JSON that rebuilds it: the tensor half of
the stored program format (:mod:`lowering.serialize`)::

    TENSOR = {"blob": "<sha256 of the bytes>", "dtype": "float32", "shape": [256, 64],
              "stride": [64, 1], "parameter": true, "requires_grad": true}

The bytes are the tensor's memory in its own dense order (a view, no copy), except an
int8 tensor of 4-bit values (8da4w's weights), stored two values per byte in XNNPACK's
layout with ``"encoding": "int4"``; reading gives back the same tensor, bit for bit.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

from .errors import LoweringError

#: dtype name (as the manifest writes it) -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.uint16, torch.uint32, torch.uint64, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}  # fmt: skip


class SerializationError(LoweringError):
    """A program or blob cannot be serialized or deserialized; names the offending item."""


def blob_digest(data: bytes) -> str:
    """The sha256 hex digest that names ``data`` (the same one the artifact store uses)."""
    return hashlib.sha256(data).hexdigest()


def tensor_to_blob(tensor: torch.Tensor, *, name: str = "<tensor>") -> tuple[dict[str, Any], memoryview]:
    """Raw bytes of ``tensor`` in memory order and the JSON metadata to rebuild it.

    The metadata's ``"blob"`` is the digest of the bytes.  Strides of dense tensors
    (e.g. channels-last) are kept; other layouts are stored contiguous.  The bytes
    are a read-only view of the tensor's memory (:func:`tensor_memory`), not a copy:
    serializing a program holds no second copy of its weights.  Except an int8 tensor
    whose values all fit 4 bits (an 8da4w weight, its zero points): its bytes are
    :func:`pack_nibbles`'s, half its size, and ``"encoding": "int4"`` says so (the store
    keeps an 8da4w program's weights in half the bytes; reading gives the same tensor).
    """
    if not isinstance(tensor, torch.Tensor):
        raise SerializationError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.dtype not in DTYPES.values():
        raise SerializationError(
            f"{name}: unsupported tensor (layout {tensor.layout}, dtype {tensor.dtype})"
        )
    t = tensor.detach().cpu()
    order = memory_order(t)
    dense = t.permute(order) if order is not None else t.contiguous()
    if order is None:
        t = dense
    packed = pack_nibbles(dense)
    data = tensor_memory(dense if packed is None else packed)
    meta = {
        "blob": blob_digest(data),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "parameter": isinstance(tensor, torch.nn.Parameter),
        "requires_grad": bool(tensor.requires_grad),
    }
    if packed is not None:
        meta["encoding"] = INT4
    return meta, data


#: ``"encoding"`` of a tensor stored two 4-bit values per byte (:func:`pack_nibbles`).
INT4 = "int4"


def pack_nibbles(tensor: torch.Tensor) -> torch.Tensor | None:
    """A dense int8 ``tensor``'s values in memory order, two per byte (value + 8, the first of
    each pair in the low nibble; an odd count padded with a 0 nibble), or None unless every
    value is in [-8, 7]::

        int8 [-8, 7, 0, -1, 3]  ->  uint8 [0xf0, 0x78, 0x0b]

    The layout XNNPACK takes 4-bit weights in (``lowering.backends.xnnpack.ops.quantized.pack_int4``,
    rows of even length): a quantized program's ``[N, K]`` weight is then the bytes its ``.pte``
    holds, which the store keeps once (``tasks.artifacts.put_pte``).
    """
    if tensor.dtype != torch.int8 or tensor.numel() < 2:
        return None
    flat = tensor.reshape(-1)
    low, high = torch.aminmax(flat)
    if int(low) < -8 or int(high) > 7:
        return None
    nibbles = flat.view(torch.uint8) + 8  # wraps: -8 -> 0, 7 -> 15
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_nibbles(data: bytes, numel: int) -> bytearray:
    """:func:`pack_nibbles` undone: the ``numel`` int8 values' bytes, in a new buffer."""
    import numpy as np

    packed, buffer = np.frombuffer(data, dtype=np.uint8), bytearray(numel)
    values = np.frombuffer(buffer, dtype=np.uint8)
    values[0::2] = packed & 0x0F
    values[1::2] = (packed >> 4)[:numel // 2]
    values -= np.uint8(8)  # wraps back: 0 -> 248, -8 as int8
    return buffer


def tensor_memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor`` as a flat read-only memoryview of its memory
    (no copy; it keeps the tensor's storage alive).  Compares, hashes and joins as bytes."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).toreadonly()


def tensor_from_blob(meta: Mapping[str, Any], data: bytes, *, name: str = "<tensor>") -> torch.Tensor:
    """Rebuild the tensor :func:`tensor_to_blob` described, from its (verified) bytes.

    A ``bytearray`` (what the artifact store reads) becomes the tensor's memory as it
    is; other bytes are copied first (the tensor must own writable memory)."""
    try:
        dtype = DTYPES[meta["dtype"]]
        shape, stride = [int(s) for s in meta["shape"]], [int(s) for s in meta["stride"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise SerializationError(f"{name}: bad tensor metadata {dict(meta)!r}") from exc
    numel = 1
    for s in shape:
        numel *= s
    encoding = meta.get("encoding")
    if encoding is not None:
        if encoding != INT4 or dtype != torch.int8 or len(data) != (numel + 1) // 2:
            raise SerializationError(f"{name}: {len(data)} bytes are not a {meta['dtype']} tensor of shape {shape} "
                                     f"encoded {encoding!r}")
        data = unpack_nibbles(data, numel)
    if len(data) != numel * dtype.itemsize or len(stride) != len(shape):
        raise SerializationError(
            f"{name}: {len(data)} bytes do not hold a {meta['dtype']} tensor of shape {shape}"
        )
    # Dims from outermost to innermost in memory: the reverse of ascending stride.
    order = sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]), reverse=True)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    dense = raw.view(dtype).reshape([shape[d] for d in order])
    tensor = dense.permute(inverse_order(order))
    if list(tensor.stride()) != stride and numel > 1:
        tensor = tensor.as_strided(shape, stride)  # same memory, size-1 dims' strides
    if meta.get("parameter"):
        return torch.nn.Parameter(tensor, requires_grad=bool(meta.get("requires_grad")))
    if meta.get("requires_grad"):
        tensor.requires_grad_(True)
    return tensor


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dim permutation that makes a dense ``t`` contiguous, or None if ``t`` is not dense."""
    if t.is_contiguous():
        return list(range(t.dim()))
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    expected = 1
    for d in reversed(order):  # innermost first: each stride must be the product so far
        if t.shape[d] != 1 and t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return order


def inverse_order(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse
