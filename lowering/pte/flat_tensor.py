"""The ExecuTorch external-data format (``.ptd``, "FlatTensor"), written and read without executorch.

A ``.ptd`` holds named blobs a program binds by key at load time: a portable
program's constant tensors (key = the tensor's fully qualified name, with its
layout) and a delegate's weights (key = what the delegate payload names; no
layout).  File layout (all integers little-endian)::

    [0:4]    root table offset of the flatbuffer
    [4:8]    file identifier "FT01"
    [8:56]   header "FH01", u32 length (40), u64 flatbuffer offset (48: the header
             padded to 16), u64 flatbuffer size, u64 segment base offset,
             u64 segment data size; 8 bytes of padding
    [56:F]   rest of the flatbuffer (FlatTensor {version, segments, named_data});
             the runtime reads [0, flatbuffer offset + flatbuffer size) as one flatbuffer
    pad to 128
    [B:...]  one segment per distinct blob, each 128-aligned relative to B

Schema (ExecuTorch ``extension/flat_tensor/serialize/flat_tensor.fbs``; field
order is the field id)::

    table TensorLayout { scalar_type: ScalarType (byte); sizes: [int32]; dim_order: [uint8]; }
    table DataSegment  { offset: uint64; size: uint64; }
    table NamedData    { key: string; segment_index: uint32; tensor_layout: TensorLayout; }
    table FlatTensor   { version: uint32; segments: [DataSegment]; named_data: [NamedData]; }

The runtime (``FlatTensorDataMap``) finds a key by linear search, loads the file
from 0 to ``flatbuffer_offset + flatbuffer_size`` as the flatbuffer, and each
segment at ``segment_base_offset + offset``.  Nothing ties a ``.ptd`` to a
program but the key strings (and, for portable tensors, the layouts): the checks
a loader cannot skip are in :func:`lowering.external.check_pair`.

The code is lowerflow's own (the facts are ExecuTorch's ``serialize.py`` and
``flat_tensor_header.h``); the flatbuffer is built with
:class:`lowering.pte.flatbuffer_builder.Builder` (the same bytes with every flatbuffers release).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from flatbuffers import number_types as N
from flatbuffers.table import Table

from ..errors import LoweringError
from .flatbuffer_builder import Builder

#: The flatbuffer file identifier of the FlatTensor schema.
FILE_IDENTIFIER = b"FT01"
#: Magic of the header inserted after the file identifier.
HEADER_MAGIC = b"FH01"
#: Bytes of header content: magic, length, flatbuffer offset and size, segment base and size.
HEADER_LENGTH = 4 + 4 + 8 + 8 + 8 + 8
#: The header is padded to this (the schema's largest alignment, as the .pte's).
HEADER_ALIGNMENT = 16
#: Alignment of each segment (and of the segment base), ExecuTorch's default.
SEGMENT_ALIGNMENT = 128
#: ``FlatTensor.version`` (the runtime's ``kMaxSupportedSchemaVersion``).
VERSION = 0


class PtdFormatError(LoweringError):
    """Bytes that are not a well-formed ``.ptd`` file."""


@dataclass(frozen=True)
class TensorLayout:
    """How a tensor's bytes are laid out: ScalarType code, sizes, dim order."""

    scalar_type: int
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        from .scalar_types import SCALAR_TYPE_TO_DTYPE

        numel = 1
        for size in self.sizes:
            numel *= int(size)
        dtype = SCALAR_TYPE_TO_DTYPE.get(self.scalar_type)
        return numel * (dtype.itemsize if dtype is not None else 1)

    def describe(self) -> str:
        from .scalar_types import SCALAR_TYPE_TO_DTYPE

        dtype = SCALAR_TYPE_TO_DTYPE.get(self.scalar_type)
        name = str(dtype).replace("torch.", "") if dtype is not None else f"scalar type {self.scalar_type}"
        return f"{name}{list(self.sizes)}"


@dataclass(frozen=True)
class PtdEntry:
    """One named blob of a ``.ptd``: its bytes and, for a tensor, its layout."""

    data: bytes
    layout: TensorLayout | None = None


# --------------------------------------------------------------------------- write


def serialize_ptd(entries: Mapping[str, PtdEntry]) -> bytes:
    """The ``.ptd`` bytes of ``entries`` (key -> :class:`PtdEntry`): :func:`ptd_parts` joined.

    Keys are written sorted; blobs with equal bytes share one segment (the
    runtime reads a segment per key, several keys may name one).  Same entries,
    same bytes.
    """
    return b"".join(ptd_parts(entries))


def ptd_parts(entries: Mapping[str, PtdEntry]) -> list:
    """The ``.ptd`` of ``entries`` as the pieces of its bytes, in order: the header and
    flatbuffer, then each segment's padding and its blob as the entry holds it (a view of a
    tensor's memory is not copied).  A store hashes and writes them one after another
    (:meth:`tasks.store.ArtifactStore.put_parts`), without a joined copy of the weights."""
    segments: list = []
    segment_of: dict[tuple, int] = {}
    table: list[tuple[str, int, TensorLayout | None]] = []
    looks = {key: _look(entry.data) for key, entry in entries.items()}
    shared = {look for look, n in Counter(looks.values()).items() if n > 1}
    for key in sorted(entries):
        entry = entries[key]
        # equal bytes look alike (size, first bytes): only a blob that looks like another is hashed
        same = (looks[key], hashlib.sha256(entry.data).digest() if looks[key] in shared else None)
        if same not in segment_of:
            segment_of[same] = len(segments)
            segments.append((entry.data, looks[key][0]))
        table.append((key, segment_of[same], entry.layout))
    offsets, position = [], 0
    for _, size in segments:
        position += _padding(position, SEGMENT_ALIGNMENT)
        offsets.append((position, size))
        position += size
    flatbuffer = _flatbuffer(offsets, table)
    header_size = HEADER_LENGTH + _padding(HEADER_LENGTH, HEADER_ALIGNMENT)
    flatbuffer_end = header_size + len(flatbuffer)
    base = flatbuffer_end + _padding(flatbuffer_end, SEGMENT_ALIGNMENT)
    header = (HEADER_MAGIC + HEADER_LENGTH.to_bytes(4, "little") + header_size.to_bytes(8, "little")
              + len(flatbuffer).to_bytes(8, "little") + base.to_bytes(8, "little")
              + position.to_bytes(8, "little"))
    root = int.from_bytes(flatbuffer[0:4], "little") + header_size
    parts = [b"".join([root.to_bytes(4, "little"), flatbuffer[4:8], header, b"\0" * (header_size - len(header)),
                       flatbuffer[8:], b"\0" * (base - flatbuffer_end)])]
    written = 0
    for (offset, size), (data, _) in zip(offsets, segments):
        if offset > written:
            parts.append(b"\0" * (offset - written))
        parts.append(data)
        written = offset + size
    return parts


def _look(data) -> tuple[int, bytes]:
    """A blob's size and first 4 KiB: blobs that differ there differ (most weights, at once)."""
    view = memoryview(data)
    view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    return view.nbytes, bytes(view[:4096])


def _flatbuffer(offsets: list[tuple[int, int]], table: list[tuple[str, int, TensorLayout | None]]) -> bytes:
    builder = Builder(1024)
    named = []
    for key, index, layout in table:
        key_offset = builder.CreateString(key)
        layout_offset = _layout(builder, layout) if layout is not None else None
        builder.StartObject(3)
        builder.PrependUOffsetTRelativeSlot(0, key_offset, 0)
        builder.PrependUint32Slot(1, index, 0)
        if layout_offset is not None:
            builder.PrependUOffsetTRelativeSlot(2, layout_offset, 0)
        named.append(builder.EndObject())
    segments = []
    for offset, size in offsets:
        builder.StartObject(2)
        builder.PrependUint64Slot(0, offset, 0)
        builder.PrependUint64Slot(1, size, 0)
        segments.append(builder.EndObject())
    segments_vector = _offset_vector(builder, segments)
    named_vector = _offset_vector(builder, named)
    builder.StartObject(3)
    builder.PrependUint32Slot(0, VERSION, 0)
    builder.PrependUOffsetTRelativeSlot(1, segments_vector, 0)
    builder.PrependUOffsetTRelativeSlot(2, named_vector, 0)
    builder.Finish(builder.EndObject(), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _layout(builder: Builder, layout: TensorLayout) -> int:
    builder.StartVector(4, len(layout.sizes), 4)
    for size in reversed(layout.sizes):
        builder.PrependInt32(int(size))
    sizes = builder.EndVector()
    builder.StartVector(1, len(layout.dim_order), 1)
    for dim in reversed(layout.dim_order):
        builder.PrependUint8(int(dim))
    dim_order = builder.EndVector()
    builder.StartObject(3)
    builder.PrependInt8Slot(0, int(layout.scalar_type), 0)
    builder.PrependUOffsetTRelativeSlot(1, sizes, 0)
    builder.PrependUOffsetTRelativeSlot(2, dim_order, 0)
    return builder.EndObject()


def _offset_vector(builder: Builder, items: list[int]) -> int:
    builder.StartVector(4, len(items), 4)
    for item in reversed(items):
        builder.PrependUOffsetTRelative(item)
    return builder.EndVector()


# --------------------------------------------------------------------------- read


def is_ptd(data: bytes) -> bool:
    """Whether ``data`` starts like a ``.ptd`` (identifier and header magic)."""
    return len(data) >= 8 + HEADER_LENGTH and data[4:8] == FILE_IDENTIFIER and data[8:12] == HEADER_MAGIC


def deserialize_ptd(data: bytes) -> dict[str, PtdEntry]:
    """Key -> :class:`PtdEntry` of ``.ptd`` bytes (ours or ExecuTorch's), in file order.

    Raises :class:`PtdFormatError` naming what is wrong (identifier, header,
    a segment past the end of the file).  A memoryview (e.g. of a mapped file) is read in
    place: the entries' data are views of it, and only the table is read to find them.
    """
    data = data if isinstance(data, (bytes, memoryview)) else bytes(data)
    if len(data) < 8 or data[4:8] != FILE_IDENTIFIER:
        raise PtdFormatError(f"not an ExecuTorch data file (.ptd): identifier {data[4:8]!r}, "
                             f"expected {FILE_IDENTIFIER!r}")
    if data[8:12] != HEADER_MAGIC:
        raise PtdFormatError(f"not an ExecuTorch data file (.ptd): header magic {data[8:12]!r}, "
                             f"expected {HEADER_MAGIC!r}")
    length = int.from_bytes(data[12:16], "little")
    if length < HEADER_LENGTH or len(data) < 8 + HEADER_LENGTH:
        raise PtdFormatError(f".ptd header length {length} < {HEADER_LENGTH}")
    fb_offset, fb_size, base, data_size = (int.from_bytes(data[16 + 8 * i:24 + 8 * i], "little") for i in range(4))
    if fb_offset + fb_size > len(data) or base + data_size > len(data):
        raise PtdFormatError(f".ptd is truncated: {len(data)} bytes, its header says "
                             f"{max(fb_offset + fb_size, base + data_size)}")
    root = Table(data, int.from_bytes(data[0:4], "little"))
    segments = [(_u64(t, 0), _u64(t, 1)) for t in _tables(root, 1)]
    entries: dict[str, PtdEntry] = {}
    for table in _tables(root, 2):
        key = _string(table, 0)
        index = _u32(table, 1)
        if index >= len(segments):
            raise PtdFormatError(f".ptd key {key!r}: segment {index} >= {len(segments)} segments")
        offset, size = segments[index]
        if base + offset + size > len(data):
            raise PtdFormatError(f".ptd key {key!r}: its segment ends past the end of the file")
        layout_table = _table(table, 2)
        layout = None
        if layout_table is not None:
            layout = TensorLayout(_i8(layout_table, 0), tuple(_vector(layout_table, 1, N.Int32Flags)),
                                  tuple(_vector(layout_table, 2, N.Uint8Flags)))
        entries[key] = PtdEntry(data[base + offset:base + offset + size], layout)
    return entries


def _field(table: Table, slot: int) -> int:
    return table.Offset(4 + 2 * slot)


def _u64(table: Table, slot: int) -> int:
    o = _field(table, slot)
    return table.Get(N.Uint64Flags, o + table.Pos) if o else 0


def _u32(table: Table, slot: int) -> int:
    o = _field(table, slot)
    return table.Get(N.Uint32Flags, o + table.Pos) if o else 0


def _i8(table: Table, slot: int) -> int:
    o = _field(table, slot)
    return table.Get(N.Int8Flags, o + table.Pos) if o else 0


def _string(table: Table, slot: int) -> str:
    o = _field(table, slot)
    return table.String(o + table.Pos).decode() if o else ""


def _table(table: Table, slot: int) -> Table | None:
    o = _field(table, slot)
    return Table(table.Bytes, table.Indirect(o + table.Pos)) if o else None


def _tables(table: Table, slot: int) -> list[Table]:
    o = _field(table, slot)
    if not o:
        return []
    start, count = table.Vector(o), table.VectorLen(o)
    return [Table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(count)]


def _vector(table: Table, slot: int, flags) -> list[int]:
    o = _field(table, slot)
    if not o:
        return []
    start, count = table.Vector(o), table.VectorLen(o)
    return [table.Get(flags, start + flags.bytewidth * i) for i in range(count)]


def _padding(offset: int, alignment: int) -> int:
    return (-offset) % alignment
