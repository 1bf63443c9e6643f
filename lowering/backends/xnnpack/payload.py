"""The XNNPACK delegate payload: a 32-byte ``XH00`` header, then an ``XNNGraph`` flatbuffer.

Layout (little-endian)::

    [0:4]    zero (where a bare flatbuffer has its root offset)
    [4:8]    magic "XH00" (where a bare flatbuffer has its file identifier)
    [8:10]   u16 header length = 30
    [10:14]  u32 flatbuffer offset (= 32: the header padded to 16)
    [14:18]  u32 flatbuffer size
    [18:22]  u32 constant data offset (= 32 + flatbuffer size padded to 16)
    [22:30]  u64 constant data size
    [30:32]  zero padding
    flatbuffer (identifier "XN01"), zero-padded to 16, then constant data

lowerflow writes no inline constant data: every weight is named data (keyed by
the sha256 of its bytes) in the program, as ExecuTorch 1.5.1 does, so the
constant region is empty.  These facts are those of ExecuTorch's
``XNNHeader``; the code is lowerflow's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


from ...errors import BackendError
from ...pte.flatbuffer_builder import Builder
from .generated import xnngraph_generated as fbx

HEADER_MAGIC = b"XH00"
HEADER_LENGTH = 30
GRAPH_IDENTIFIER = b"XN01"
#: Identifiers the runtime accepts (XN00 is the runtime schema's own).
ACCEPTED_IDENTIFIERS = (b"XN00", b"XN01")
ALIGNMENT = 16
_HEADER = struct.Struct("<4s4sHIIIQ")  # 30 bytes

#: ``XNNTensorValue.external_id`` of internal values.
INVALID_ID = 0xFFFFFFFF
#: ``ConstantDataOffset.offset`` of a constant stored as named data.
NAMED_OFFSET = 0xFFFFFFFFFFFFFFFF
#: ``XNNTensorValue.flags``.
EXTERNAL_INPUT = 1
EXTERNAL_OUTPUT = 2
#: Node flags (XNNPACK's values).
FLAG_TRANSPOSE_WEIGHTS = 0x1
FLAG_KEEP_DIMS = 0x40
FLAG_ALIGN_CORNERS = 0x8
#: The runtime's limit on ``XNNGraph.num_externs``.
MAX_EXTERNS = 4096

DATATYPE_FP32 = fbx.XNNDatatype.xnn_datatype_fp32
DATATYPE_QINT8 = fbx.XNNDatatype.xnn_datatype_qint8
DATATYPE_QINT32 = fbx.XNNDatatype.xnn_datatype_qint32
DATATYPE_QCINT8 = fbx.XNNDatatype.xnn_datatype_qcint8
DATATYPE_QCINT32 = fbx.XNNDatatype.xnn_datatype_qcint32
DATATYPE_QCINT4 = fbx.XNNDatatype.xnn_datatype_qcint4
DATATYPE_QDINT8 = fbx.XNNDatatype.xnn_datatype_qdint8
DATATYPE_QBINT4 = fbx.XNNDatatype.xnn_datatype_qbint4
#: Short names of the datatypes constants are stored in (the role part of a stable key).
DATATYPE_NAMES = {DATATYPE_FP32: "f32", DATATYPE_QINT8: "q8", DATATYPE_QINT32: "q32", DATATYPE_QCINT8: "qc8",
                  DATATYPE_QCINT32: "qc32", DATATYPE_QCINT4: "qc4", DATATYPE_QBINT4: "qb4"}


class PayloadError(BackendError):
    """Bytes that are not a well-formed XNNPACK payload."""


@dataclass(frozen=True)
class Header:
    flatbuffer_offset: int
    flatbuffer_size: int
    constant_data_offset: int
    constant_data_size: int


def _pad(n: int) -> int:
    return (-n) % ALIGNMENT


def graph_to_bytes(graph: fbx.XNNGraphT) -> bytes:
    """The flatbuffer of ``graph`` (identifier XN01); deterministic for equal graphs."""
    builder = Builder(4096)
    builder.Finish(graph.Pack(builder), file_identifier=GRAPH_IDENTIFIER)
    return bytes(builder.Output())


def serialize_payload(graph: fbx.XNNGraphT, constant_data: bytes = b"") -> bytes:
    """Header + flatbuffer (+ inline constant data, normally empty)."""
    flatbuffer = graph_to_bytes(graph)
    offset = HEADER_LENGTH + _pad(HEADER_LENGTH)
    constant_offset = offset + len(flatbuffer) + _pad(len(flatbuffer))
    header = _HEADER.pack(
        b"\0\0\0\0", HEADER_MAGIC, HEADER_LENGTH, offset, len(flatbuffer), constant_offset, len(constant_data)
    )
    return b"".join([
        header, b"\0" * _pad(HEADER_LENGTH), flatbuffer, b"\0" * _pad(len(flatbuffer)), constant_data,
    ])


def read_header(payload: bytes) -> Header:
    """The header of ``payload``, checked as the runtime checks it."""
    if len(payload) < HEADER_LENGTH:
        raise PayloadError(f"payload of {len(payload)} bytes is shorter than the {HEADER_LENGTH}-byte header")
    _, magic, length, fb_offset, fb_size, const_offset, const_size = _HEADER.unpack_from(payload, 0)
    if magic != HEADER_MAGIC:
        raise PayloadError(f"payload magic is {magic!r}, expected {HEADER_MAGIC!r}")
    if length < HEADER_LENGTH:
        raise PayloadError(f"header length {length} < {HEADER_LENGTH}")
    if fb_size < 8 or fb_offset + fb_size > len(payload):
        raise PayloadError(f"flatbuffer [{fb_offset}, +{fb_size}) is not inside the {len(payload)}-byte payload")
    if const_offset < fb_offset + fb_size or const_offset + const_size > len(payload):
        raise PayloadError(f"constant data [{const_offset}, +{const_size}) overlaps the flatbuffer or the end")
    return Header(fb_offset, fb_size, const_offset, const_size)


def deserialize_payload(payload: bytes) -> tuple[fbx.XNNGraphT, bytes]:
    """The graph and the inline constant data of a payload."""
    payload = bytes(payload)
    header = read_header(payload)
    flatbuffer = payload[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size]
    if flatbuffer[4:8] not in ACCEPTED_IDENTIFIERS:
        raise PayloadError(f"graph identifier is {flatbuffer[4:8]!r}, expected one of {ACCEPTED_IDENTIFIERS}")
    graph = fbx.XNNGraphT.InitFromPackedBuf(flatbuffer, 0)
    constants = payload[header.constant_data_offset:header.constant_data_offset + header.constant_data_size]
    return graph, constants


def node_kind_names() -> dict[int, str]:
    """Union type number -> node kind name (``XNNAdd``...)."""
    return {v: k for k, v in vars(fbx.NodeUnion).items() if not k.startswith("_") and k != "NONE"}


#: XNNGraph's quantization-parameter union tag of each parameter table.
QUANT_TYPES = {
    fbx.PerChannelQuantT: fbx.QuantParams.PerChannelQuant,
    fbx.PerTensorQuantT: fbx.QuantParams.PerTensorQuant,
    fbx.PerTokenDynamicQuantT: fbx.QuantParams.PerTokenDynamicQuant,
    fbx.PerChannelGroupQuantT: fbx.QuantParams.PerChannelGroupQuant,
}


def per_tensor_quant(params) -> fbx.PerTensorQuantT:
    q = fbx.PerTensorQuantT()
    q.scale, q.zeroPoint = float(params.scale), int(params.zero_point)
    return q
