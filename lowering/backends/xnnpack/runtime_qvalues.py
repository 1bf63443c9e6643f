"""Quantized values of an XNNPACK payload, as lowerflow's runtime holds them.

An ``XNNQuantizedTensorValue`` is read into its ``XNNTensorValue`` (dims, flags,
ids) and a :class:`QParams`; a constant one also into its integer data:

    qint8 / quint8 / qcint8      int8 / uint8 bytes            -> int32 tensor
    qint32 / qcint32             int32 bytes                    -> int32 tensor
    qcint4 / qbint4 [OC, IC]     [OC, ceil(IC/2)] bytes, byte j of a row
                                 = (w[2j]+8) | (w[2j+1]+8) << 4 -> int32 tensor in [-8, 7]

Scales: ``PerTensorQuant`` inline; ``PerChannelQuant`` inline when
``scale_buffer_idx == 0``, else fp32 ``[num_scales]`` from the constant table
(named data); ``PerChannelGroupQuant`` bf16 ``[OC, IC/gs]`` from the table, or
inline fp32 rounded to bf16 (as the ExecuTorch runtime does).  Per-channel and
blockwise weights have zero point 0 (qcint8) or 8 (4-bit, removed on unpacking
above), as the runtime implies; they are never serialized.

At run time a quantized activation is an int32 tensor of its quantized integers;
a ``qdint8`` one is a :class:`DynamicQ` carrying its per-row scale/zero point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ...runtime.errors import ExecutorError
from .generated import xnngraph_generated as fbx

D = fbx.XNNDatatype
QP = fbx.QuantParams

#: Integer range of each quantized datatype (4-bit after removing the nibble offset 8).
RANGES: dict[int, tuple[int, int]] = {
    D.xnn_datatype_qint8: (-128, 127),
    D.xnn_datatype_qcint8: (-128, 127),
    D.xnn_datatype_qdint8: (-128, 127),
    D.xnn_datatype_quint8: (0, 255),
    D.xnn_datatype_qint32: (-(2**31), 2**31 - 1),
    D.xnn_datatype_qcint32: (-(2**31), 2**31 - 1),
    D.xnn_datatype_qcint4: (-8, 7),
    D.xnn_datatype_qbint4: (-8, 7),
}
QUANTIZED = frozenset(RANGES)
DATATYPE_NAMES = {v: k.replace("xnn_datatype_", "") for k, v in vars(D).items() if k.startswith("xnn_datatype_")}
_BYTE_TYPES = {
    D.xnn_datatype_qint8: torch.int8, D.xnn_datatype_qcint8: torch.int8, D.xnn_datatype_quint8: torch.uint8,
    D.xnn_datatype_qint32: torch.int32, D.xnn_datatype_qcint32: torch.int32,
}
_FOUR_BIT = (D.xnn_datatype_qcint4, D.xnn_datatype_qbint4)
_SCHEMES = {QP.PerTensorQuant: "tensor", QP.PerChannelQuant: "channel",
            QP.PerTokenDynamicQuant: "token", QP.PerChannelGroupQuant: "group"}


@dataclass(frozen=True)
class QParams:
    """The quantization of one value.  ``scale``: a float (per tensor), an fp32
    ``[C]`` tensor (per channel) or ``[OC, IC/gs]`` (blockwise, bf16-rounded);
    None for ``qdint8`` (computed per row at run time)."""

    datatype: int
    scheme: str  # "tensor", "channel", "token", "group"
    scale: Any = None
    zero_point: int = 0
    channel_dim: int = 0
    group_size: int = 0
    num_nonbatch_dims: int = 0

    @property
    def qmin(self) -> int:
        return RANGES[self.datatype][0]

    @property
    def qmax(self) -> int:
        return RANGES[self.datatype][1]

    @property
    def name(self) -> str:
        return DATATYPE_NAMES.get(self.datatype, str(self.datatype))

    def same_as(self, other: "QParams | None") -> bool:
        return (other is not None and self.scheme == other.scheme == "tensor" and self.datatype == other.datatype
                and self.scale == other.scale and self.zero_point == other.zero_point)


@dataclass
class DynamicQ:
    """A ``qdint8`` value: int32 data with one (scale, zero point) per row; ``scale``
    and ``zero_point`` broadcast against ``q`` (size 1 in its non-batch dims)."""

    q: torch.Tensor
    scale: torch.Tensor  # fp32
    zero_point: torch.Tensor  # int32

    def contiguous(self) -> "DynamicQ":
        return self

    def clone(self) -> "DynamicQ":
        return DynamicQ(self.q.clone(), self.scale.clone(), self.zero_point.clone())


def is_quantized(value: fbx.XValueT) -> bool:
    return value.xvalueUnionType == fbx.ValueUnion.XNNQuantizedTensorValue


def tensor_part(value: fbx.XValueT) -> fbx.XNNTensorValueT:
    """The ``XNNTensorValue`` of a plain or quantized value."""
    body = value.xvalueUnion
    return body.tensorValue if is_quantized(value) else body


def read_qparams(value: fbx.XValueT, read_blob: Callable[[int, str], bytes]) -> QParams:
    """The :class:`QParams` of a quantized value; ``read_blob(buffer_idx, what)`` reads constant bytes."""
    body = value.xvalueUnion
    tensor = body.tensorValue
    vid, datatype = tensor.idOut, tensor.datatype
    if datatype not in QUANTIZED:
        raise ExecutorError(f"XNNPACK payload: quantized value {vid} has datatype "
                            f"{DATATYPE_NAMES.get(datatype, datatype)}, not a quantized one")
    scheme = _SCHEMES.get(body.quantParamsType)
    params = body.quantParams
    if scheme is None or params is None:
        raise ExecutorError(f"XNNPACK payload: quantized value {vid} has no quantization parameters")
    if scheme == "tensor":
        return QParams(datatype, scheme, float(torch.tensor(params.scale, dtype=torch.float32)),
                       int(params.zeroPoint))
    if scheme == "token":
        return QParams(datatype, scheme, num_nonbatch_dims=int(params.numNonbatchDims))
    if scheme == "channel":
        scale = _fp32_scales(vid, params, read_blob, "per-channel scales")
        return QParams(datatype, scheme, scale, 0, int(params.channelDim))
    if datatype != D.xnn_datatype_qbint4:
        raise ExecutorError(f"XNNPACK payload: blockwise value {vid} must be qbint4, is {DATATYPE_NAMES.get(datatype)}")
    if params.scaleBufferIdx:
        raw = read_blob(params.scaleBufferIdx, f"blockwise scales of value {vid}")
        scale = torch.frombuffer(bytearray(raw[:2 * params.numScales]), dtype=torch.bfloat16).float()
    else:
        scale = torch.tensor(_floats(params.scale), dtype=torch.float32).bfloat16().float()
    dims = [int(d) for d in tensor.dims]
    if len(dims) != 2 or params.groupSize <= 0 or scale.numel() != dims[0] * dims[1] // params.groupSize:
        raise ExecutorError(f"XNNPACK payload: blockwise value {vid} has {scale.numel()} scales for dims {dims} "
                            f"and group size {params.groupSize}")
    return QParams(datatype, scheme, scale.reshape(dims[0], -1), 0, int(params.channelDim), int(params.groupSize))


def _fp32_scales(vid: int, params: Any, read_blob: Callable[[int, str], bytes], what: str) -> torch.Tensor:
    if params.scaleBufferIdx:
        raw = read_blob(params.scaleBufferIdx, f"{what} of value {vid}")
        if len(raw) < 4 * params.numScales:
            raise ExecutorError(f"XNNPACK payload: {what} of value {vid}: {len(raw)} bytes for {params.numScales}")
        return torch.frombuffer(bytearray(raw[:4 * params.numScales]), dtype=torch.float32).clone()
    return torch.tensor(_floats(params.scale), dtype=torch.float32)


def decode_constant(vid: int, datatype: int, dims: list[int], data: bytes) -> torch.Tensor:
    """The int32 tensor of a quantized constant's bytes (4-bit: nibble offset 8 removed)."""
    count = 1
    for d in dims:
        count *= d
    if datatype in _FOUR_BIT:
        if len(dims) != 2:
            raise ExecutorError(f"XNNPACK payload: 4-bit constant {vid} has dims {dims}, expected [OC, IC]")
        rows, cols = dims
        row_bytes = (cols + 1) // 2
        if len(data) < rows * row_bytes:
            raise ExecutorError(f"XNNPACK payload: 4-bit constant {vid} has {len(data)} bytes, needs {rows * row_bytes}")
        packed = torch.frombuffer(bytearray(data[:rows * row_bytes]), dtype=torch.uint8).reshape(rows, row_bytes)
        packed = packed.to(torch.int32)
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, 2 * row_bytes)
        return (nibbles[:, :cols] - 8).contiguous()
    dtype = _BYTE_TYPES.get(datatype)
    if dtype is None:
        raise ExecutorError(f"XNNPACK payload: constant {vid} of datatype {DATATYPE_NAMES.get(datatype, datatype)} "
                            "cannot be a constant")
    size = torch.empty((), dtype=dtype).element_size() * count
    if len(data) < size:
        raise ExecutorError(f"XNNPACK payload: constant {vid} has {len(data)} bytes, needs {size}")
    return torch.frombuffer(bytearray(data[:size]), dtype=dtype).to(torch.int32).reshape(dims)


def storage_dtype(params: QParams) -> torch.dtype:
    """The torch dtype of a quantized external input or output (int8, uint8, int32)."""
    if params.datatype == D.xnn_datatype_quint8:
        return torch.uint8
    if params.datatype in (D.xnn_datatype_qint32, D.xnn_datatype_qcint32):
        return torch.int32
    return torch.int8


def blob_reader(table: list, inline: bytes, named_data: Mapping[str, bytes]) -> Callable[[int, str], bytes]:
    """``read(buffer_idx, what) -> bytes`` over a payload's constant table."""

    def read(idx: int, what: str) -> bytes:
        if idx >= len(table):
            raise ExecutorError(f"XNNPACK payload: {what} uses constant buffer {idx} of only {len(table)}")
        entry = table[idx]
        key = entry.namedKey.decode() if isinstance(entry.namedKey, bytes) else (entry.namedKey or "")
        if key:
            if key not in named_data:
                raise ExecutorError(f"XNNPACK payload: constant {key!r} ({what}) is not in the program's named data")
            return named_data[key]
        return inline[entry.offset:entry.offset + entry.size]

    return read


def _floats(vector: Any) -> list[float]:
    """A flatbuffer float vector (None, a list or a numpy array) as a list."""
    return [] if vector is None else [float(v) for v in vector]
