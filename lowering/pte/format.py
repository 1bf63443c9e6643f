"""The ``.pte`` container: flatbuffer program + extended header + data segments.

File layout (all integers little-endian)::

    [0:4]    root table offset of the flatbuffer
    [4:8]    file identifier "ET12"
    [8:40]   extended header "eh00" (32 bytes, see :func:`extended_header`)
    [40:P]   rest of the flatbuffer program (P = program size)
    pad to 128
    [B:...]  segments (B = segment base offset); each starts 128-aligned
             relative to B.  Segment 0 is the constant segment (tensors
             16-byte aligned inside it), then the mutable-data segment (initial
             values of planned mutable buffers, unpadded), then one segment per
             distinct delegate payload, then one segment per distinct named
             data blob (``Program.named_data``: key -> segment index).
             Physically they follow in index order except one: the segment
             that needs the most padding to 128 is written last, unpadded
             (ties: the highest index), which minimises the file.  The table
             carries each offset, so the runtime does not care about the order
             (``tests/test_pte_format.py`` runs such a file on ExecuTorch's).
             A named blob equal to a constant tensor's bytes (a tied
             embedding / lm_head weight: the embedding reads the constant, the
             XNNPACK delegate the named data) gets no bytes of its own: its
             segment is a window onto that tensor inside segment 0.

The facts above (header fields and order, header padded to the largest
``force_align`` of the schema, 128-byte segment alignment, 16-byte tensor
alignment, deduplicated delegate payloads) are those of ExecuTorch's
``exir/_serialize/_program.py``; the code is lowerflow's own.

The in-memory form is :class:`PteData`: the flatbuffer object tree (generated
object API, ``ProgramT``) whose tensors and delegates refer by index to plain
byte lists held next to it, so that callers never deal with segment offsets.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field


from ..errors import LoweringError
from .flatbuffer_builder import Builder
from .generated import program_generated as fb

#: The flatbuffer file identifier of the ExecuTorch program schema.
FILE_IDENTIFIER = b"ET12"
#: Magic of the extended header inserted after the file identifier.
EXTENDED_HEADER_MAGIC = b"eh00"
#: Bytes of header content: magic, length, program size, segment base, segment size.
EXTENDED_HEADER_LENGTH = 4 + 4 + 8 + 8 + 8
#: Header without the segment data size field (written by older ExecuTorch).
_MINIMUM_HEADER_LENGTH = 4 + 4 + 8 + 8
#: Largest ``force_align`` in program.fbs; the inserted header is padded to it
#: so that every aligned flatbuffer vector stays aligned after the insertion.
SCHEMA_MAX_ALIGNMENT = 16
#: Alignment of each segment start (relative to the segment base offset too).
SEGMENT_ALIGNMENT = 128
#: Alignment of each constant tensor inside the constant segment.
CONSTANT_TENSOR_ALIGNMENT = 16
#: ExecuTorch schema version written in ``Program.version``.
SCHEMA_VERSION = 0


class PteFormatError(LoweringError):
    """Bytes that are not a well-formed ``.pte`` program."""


@dataclass
class PteData:
    """A program and the data blobs its tables refer to by index.

    - ``constants[i]``: bytes of the constant tensor whose ``data_buffer_idx``
      is ``i`` (and which has no ``allocation_info``).  Entry 0 is reserved and
      empty: ``data_buffer_idx == 0`` means "not a constant".
    - ``mutable_data[i]``: initial bytes of the planned tensor whose
      ``allocation_info`` is set and whose ``data_buffer_idx`` is ``i``; entry
      0 is reserved and empty.  Empty list when no tensor has an initial value.
    - ``delegate_data[i]``: processed payload of every ``BackendDelegate``
      whose ``processed`` reference has ``location == SEGMENT`` and
      ``index == i``.
    - ``named_data``: key -> blob, the program's named data (weights that
      delegate payloads refer to by key); written in key order, blobs with
      equal bytes share one segment.
    - ``external``: key -> :class:`~lowering.pte.flat_tensor.PtdEntry`, the data
      the program binds at load time from its ``.ptd`` (external weights):
      constant tensors whose table says ``EXTERNAL`` (key: their fully qualified
      name) and delegate named data.  Not written by :func:`serialize`: by
      :func:`~lowering.pte.flat_tensor.serialize_ptd`.
    """

    program: fb.ProgramT
    constants: list[bytes] = field(default_factory=lambda: [b""])
    mutable_data: list[bytes] = field(default_factory=list)
    delegate_data: list[bytes] = field(default_factory=list)
    named_data: dict[str, bytes] = field(default_factory=dict)
    external: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# serialize


def serialize(pte: PteData) -> bytes:
    """Return the ``.pte`` bytes of ``pte``; deterministic for equal inputs.

    ``pte.program`` is not modified: the segment tables are written into a
    shallow working copy of the root table.
    """
    program = _copy_root(pte.program)
    segments: list[bytes] = []
    program.constantSegment = _add_subsegments(
        segments, pte.constants, CONSTANT_TENSOR_ALIGNMENT
    )
    program.mutableDataSegments = None
    if pte.mutable_data:
        program.mutableDataSegments = [_add_subsegments(segments, pte.mutable_data, 1)]
    program.executionPlan = _delegates_to_segments(program.executionPlan, pte.delegate_data, segments)
    program.namedData = None
    if pte.named_data:
        windows = _constant_windows(pte.constants, program.constantSegment)
        program.namedData = _named_data_to_segments(pte.named_data, segments, windows)
    # Empty vectors rather than absent ones: ExecuTorch's python reader
    # expects these lists to exist.
    program.backendDelegateData = []
    program.constantBuffer = []
    segment_table, segment_parts = _layout_segments(segments)
    program.segments = segment_table
    flatbuffer = _finish_flatbuffer(program)
    return _assemble(flatbuffer, segment_parts)


def _copy_root(program: fb.ProgramT) -> fb.ProgramT:
    """Shallow copy of the root table (its children are shared, not modified)."""
    copy = fb.ProgramT()
    copy.__dict__.update(program.__dict__)
    copy.version = program.version or SCHEMA_VERSION
    return copy


def _add_subsegments(segments: list, blobs: list[bytes], alignment: int) -> fb.SubsegmentOffsetsT:
    """Append one segment packing ``blobs`` (each ``alignment``-aligned); return its offsets.

    The segment is a :class:`_Parts` (the blobs and their padding, not joined): the
    file's bytes are joined once, in :func:`_assemble`.
    """
    offsets: list[int] = []
    parts: list = []
    position = 0
    for i, blob in enumerate(blobs):
        offsets.append(position)
        parts.append(blob)
        position += len(blob)
        if i < len(blobs) - 1:
            pad = _padding(position, alignment)
            parts.append(b"\0" * pad)
            position += pad
    table = fb.SubsegmentOffsetsT()
    table.segmentIndex = len(segments)
    table.offsets = offsets
    segments.append(_Parts(parts, position))
    return table


@dataclass(frozen=True)
class _Parts:
    """A segment made of several byte strings written one after the other (``size`` bytes in all).

    Segments are kept as their parts until the one join of the whole file, so the
    weights are copied once when the ``.pte`` is built (joining each segment, then
    the segments, then the header, was three copies of the file at once).
    """

    parts: list
    size: int

    def __len__(self) -> int:
        return self.size


def _delegates_to_segments(plans, delegate_data: list[bytes], segments: list[bytes]):
    """Point every delegate at a segment holding its payload, one segment per distinct payload.

    Returns new ``ExecutionPlanT`` objects with new delegate tables (the input
    plans are not modified).
    """
    if not plans:
        return plans
    segment_of_payload: dict[bytes, int] = {}
    new_plans = []
    for plan in plans:
        new_plan = fb.ExecutionPlanT()
        new_plan.__dict__.update(plan.__dict__)
        new_delegates = []
        for delegate in plan.delegates or []:
            reference = delegate.processed
            if reference is None or reference.location != fb.DataLocation.SEGMENT:
                raise PteFormatError(
                    f"delegate {decode_string(delegate.id)!r}: payload must be given in PteData.delegate_data"
                )
            if reference.index >= len(delegate_data):
                raise PteFormatError(
                    f"delegate {decode_string(delegate.id)!r}: payload index {reference.index} "
                    f">= {len(delegate_data)} payloads"
                )
            payload = bytes(delegate_data[reference.index])
            if payload not in segment_of_payload:
                segment_of_payload[payload] = len(segments)
                segments.append(payload)
            new_delegate = fb.BackendDelegateT()
            new_delegate.__dict__.update(delegate.__dict__)
            new_delegate.processed = _data_reference(fb.DataLocation.SEGMENT, segment_of_payload[payload])
            new_delegates.append(new_delegate)
        new_plan.delegates = new_delegates
        new_plans.append(new_plan)
    return new_plans


@dataclass(frozen=True)
class _Window:
    """A segment that holds no bytes of its own: ``size`` bytes of segment ``segment`` from ``start``.

    ExecuTorch's runtime reads a segment as (offset, size) and checks neither
    overlap nor order (``PteDataMap::get_data`` loads exactly that range), so
    a named-data key can name bytes that the constant segment already holds.
    """

    segment: int
    start: int
    size: int


def blob_key(data) -> bytes:
    """The dict key of a data blob (bytes, or a tensor's memoryview, which is not hashable):
    the sha256 of its bytes.  Equal keys, equal bytes; nothing is copied to compute it."""
    return hashlib.sha256(data).digest()


def _constant_windows(constants: list[bytes], table: fb.SubsegmentOffsetsT) -> dict[bytes, _Window]:
    """Each distinct non-empty constant blob (by :func:`blob_key`) -> its window inside the constant segment."""
    windows: dict[bytes, _Window] = {}  # by blob_key
    for blob, start in zip(constants, table.offsets):
        if len(blob) and blob_key(blob) not in windows:
            windows[blob_key(blob)] = _Window(table.segmentIndex, start, len(blob))
    return windows


def _named_data_to_segments(
    named_data: dict[str, bytes], segments: list, windows: dict[bytes, _Window] | None = None
) -> list[fb.NamedDataT]:
    """One ``NamedData{key, segment_index}`` per key (sorted); one segment per distinct blob.

    A blob found in ``windows`` (a constant tensor's bytes) becomes a window
    segment instead of a copy: the bytes are stored once.
    """
    windows = windows or {}
    segment_of_blob: dict[bytes, int] = {}
    table = []
    for key in sorted(named_data):
        blob = named_data[key]
        digest = blob_key(blob)
        if digest not in segment_of_blob:
            segment_of_blob[digest] = len(segments)
            segments.append(windows.get(digest, blob))
        entry = fb.NamedDataT()
        entry.key = key
        entry.segmentIndex = segment_of_blob[digest]
        table.append(entry)
    return table


def _data_reference(location: int, index: int) -> fb.BackendDelegateDataReferenceT:
    reference = fb.BackendDelegateDataReferenceT()
    reference.location = location
    reference.index = index
    return reference


def _layout_segments(segments: list) -> tuple[list[fb.DataSegmentT], list]:
    """Place segments, each starting at a multiple of SEGMENT_ALIGNMENT; return the table and the
    byte strings of the segment data in file order (padding included), not joined.

    The table is in index order; the data in :func:`segment_order`.  A
    :class:`_Window` adds a table entry inside an earlier segment and no bytes.
    """
    table: list[fb.DataSegmentT] = [fb.DataSegmentT() for _ in segments]
    real = [i for i, data in enumerate(segments) if not isinstance(data, _Window)]
    parts: list = []
    position = 0
    for k in segment_order([len(segments[i]) for i in real]):
        index = real[k]
        pad = _padding(position, SEGMENT_ALIGNMENT)
        if pad:
            parts.append(b"\0" * pad)
        position += pad
        table[index].offset = position
        table[index].size = len(segments[index])
        data = segments[index]
        parts.extend(data.parts if isinstance(data, _Parts) else [data])
        position += len(data)
    for index, data in enumerate(segments):
        if isinstance(data, _Window):
            table[index].offset = table[data.segment].offset + data.start
            table[index].size = data.size
    return table, parts


def segment_order(sizes: list[int]) -> list[int]:
    """Physical order of segments of these sizes: index order, the one needing the most padding last.

    Every segment but the last is padded to SEGMENT_ALIGNMENT, so leaving the
    largest padding out is the smallest file; ties go to the highest index,
    which keeps index order whenever it is already smallest.
    """
    if not sizes:
        return []
    last = max(range(len(sizes)), key=lambda i: (_padding(sizes[i], SEGMENT_ALIGNMENT), i))
    return [i for i in range(len(sizes)) if i != last] + [last]


def _finish_flatbuffer(program: fb.ProgramT) -> bytes:
    """Pack the object tree into flatbuffer bytes with the ET12 identifier."""
    builder = Builder(1024)
    root = program.Pack(builder)
    builder.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def extended_header(program_size: int, segment_base_offset: int, segment_data_size: int) -> bytes:
    """The ``eh00`` header, padded to SCHEMA_MAX_ALIGNMENT.

    Fields: magic ``eh00``, uint32 header length (32), uint64 program size
    (flatbuffer bytes including this header), uint64 offset of the first
    segment (0 if none), uint64 total size of the segment data.
    """
    header = (
        EXTENDED_HEADER_MAGIC
        + EXTENDED_HEADER_LENGTH.to_bytes(4, "little")
        + program_size.to_bytes(8, "little")
        + segment_base_offset.to_bytes(8, "little")
        + segment_data_size.to_bytes(8, "little")
    )
    return header + b"\0" * _padding(len(header), SCHEMA_MAX_ALIGNMENT)


def _padded_header_length() -> int:
    return EXTENDED_HEADER_LENGTH + _padding(EXTENDED_HEADER_LENGTH, SCHEMA_MAX_ALIGNMENT)


def _assemble(flatbuffer: bytes, segment_parts: list) -> bytes:
    """Insert the extended header after the file identifier and append the segment data
    (``segment_parts``, in file order): the file's bytes, joined once."""
    if flatbuffer[4:8] != FILE_IDENTIFIER:
        raise PteFormatError(f"flatbuffer identifier is {flatbuffer[4:8]!r}, expected {FILE_IDENTIFIER!r}")
    segment_size = sum(len(part) for part in segment_parts)
    header_length = _padded_header_length()
    program_size = header_length + len(flatbuffer)
    segment_base = program_size + _padding(program_size, SEGMENT_ALIGNMENT) if segment_size else 0
    root_offset = int.from_bytes(flatbuffer[0:4], "little") + header_length
    parts = [
        root_offset.to_bytes(4, "little"),
        flatbuffer[4:8],
        extended_header(program_size, segment_base, segment_size),
        memoryview(flatbuffer)[8:],
    ]
    if segment_size:
        parts.append(b"\0" * (segment_base - program_size))
        parts.extend(segment_parts)
    return b"".join(parts)


# --------------------------------------------------------------------------
# deserialize


@dataclass(frozen=True)
class ExtendedHeader:
    """The decoded ``eh00`` header."""

    program_size: int
    segment_base_offset: int
    segment_data_size: int


def read_extended_header(data: bytes) -> ExtendedHeader | None:
    """The extended header of ``data``, or None if the file has none.

    Older writers omit the last field (segment data size): the header is then
    24 bytes long, which its length field says.
    """
    if len(data) < 8 + _MINIMUM_HEADER_LENGTH or data[8:12] != EXTENDED_HEADER_MAGIC:
        return None
    length = int.from_bytes(data[12:16], "little")
    if length < _MINIMUM_HEADER_LENGTH:
        raise PteFormatError(f"extended header length {length} < {_MINIMUM_HEADER_LENGTH}")
    has_data_size = length >= EXTENDED_HEADER_LENGTH and len(data) >= 8 + EXTENDED_HEADER_LENGTH
    return ExtendedHeader(
        program_size=int.from_bytes(data[16:24], "little"),
        segment_base_offset=int.from_bytes(data[24:32], "little"),
        segment_data_size=int.from_bytes(data[32:40], "little") if has_data_size else 0,
    )


def deserialize(data: bytes) -> PteData:
    """Parse ``.pte`` bytes (ours or ExecuTorch's) into :class:`PteData`.

    Constant tensors, mutable initial values and delegate payloads are taken
    out of their segments (or out of the inline ``constant_buffer`` /
    ``backend_delegate_data`` tables of files without segments) into the byte
    lists of PteData; the returned program has no segment tables, so
    ``serialize(deserialize(b))`` is a valid file again.

    Constants and named data are read-only memoryviews of ``data`` (a program's
    weights are not copied to be read; they compare equal to their bytes);
    delegate payloads and mutable initial values are bytes.
    """
    data = bytes(data)
    if len(data) < 8 or data[4:8] != FILE_IDENTIFIER:
        raise PteFormatError(
            f"not an ExecuTorch program: identifier {data[4:8]!r}, expected {FILE_IDENTIFIER!r}"
        )
    header = read_extended_header(data)
    program_size = header.program_size if header else len(data)
    if program_size > len(data):
        raise PteFormatError(f"program size {program_size} exceeds file size {len(data)}")
    program = fb.ProgramT.InitFromPackedBuf(data[:program_size], 0)
    segment_area = memoryview(data)[header.segment_base_offset:] if header and header.segment_base_offset else b""
    segments = _read_segments(program, segment_area)
    pte = PteData(
        program=program,
        constants=_read_constants(program, segments),
        mutable_data=_read_mutable_data(program, segments),
        delegate_data=_read_delegate_payloads(program, segments),
        named_data=_read_named_data(program, segments),
    )
    program.namedData = None
    program.segments = None
    program.constantSegment = None
    program.mutableDataSegments = None
    program.constantBuffer = None
    program.backendDelegateData = None
    return pte


def program_table(pte: "bytes | str | os.PathLike") -> fb.ProgramT:
    """The flatbuffer program of ``pte`` (bytes, or a file's path) without its segments:
    its plans, operators and delegates' ids, which is what a caller reading the program's
    structure needs.  A file is read up to the program's end only (its weights, in the
    segments after it, are never read: a big program's table costs what its table is)."""
    if isinstance(pte, (bytes, bytearray, memoryview)):
        head = bytes(pte[:8 + EXTENDED_HEADER_LENGTH])
        header = read_extended_header(head)
        size = header.program_size if header else len(pte)
        return _table_of(bytes(pte[:size]), size)
    with open(pte, "rb") as f:
        head = f.read(8 + EXTENDED_HEADER_LENGTH)
        header = read_extended_header(head)
        f.seek(0)
        data = f.read(header.program_size) if header else f.read()
    return _table_of(data, len(data) if header is None else header.program_size)


def _table_of(flatbuffer: bytes, expected: int) -> fb.ProgramT:
    if len(flatbuffer) < 8 or flatbuffer[4:8] != FILE_IDENTIFIER:
        raise PteFormatError(
            f"not an ExecuTorch program: identifier {flatbuffer[4:8]!r}, expected {FILE_IDENTIFIER!r}"
        )
    if len(flatbuffer) < expected:
        raise PteFormatError(f"program size {expected} exceeds file size {len(flatbuffer)}")
    return fb.ProgramT.InitFromPackedBuf(flatbuffer, 0)


def data_windows(data: bytes, minimum: int = 4096) -> list[tuple[int, int]]:
    """``(offset, size)`` in the file of each stored byte-string of ``data`` (a ``.pte``)
    of at least ``minimum`` bytes: every segment (delegate payloads, named data, mutable
    data) and every constant tensor inside the constant segment (its bytes, without the
    padding after it).  What a store can keep once: the same bytes a stage stored as a
    blob (a weight) are these windows of the program file."""
    header = read_extended_header(data)
    if header is None or not header.segment_base_offset:
        return []
    program = fb.ProgramT.InitFromPackedBuf(bytes(data[:header.program_size]), 0)
    base = header.segment_base_offset
    windows = [(base + int(s.offset), int(s.size)) for s in program.segments or []]
    table = program.constantSegment
    if table is not None and table.offsets is not None and len(table.offsets):
        start = base + int(program.segments[table.segmentIndex].offset)
        offsets = [int(o) for o in table.offsets]
        for index, nbytes in _constant_sizes(program).items():
            if index < len(offsets):
                windows.append((start + offsets[index], nbytes))
    return sorted({w for w in windows if w[1] >= minimum})


def _constant_sizes(program: fb.ProgramT) -> dict[int, int]:
    """Constant buffer index -> bytes of the tensor stored there (its sizes and dtype)."""
    import math

    from .scalar_types import SCALAR_TYPE_TO_DTYPE

    sizes: dict[int, int] = {}
    for plan in program.executionPlan or []:
        for value in plan.values or []:
            tensor = value.val
            index = getattr(tensor, "dataBufferIdx", 0) if value.valType == fb.KernelTypes.Tensor else 0
            if index and tensor.allocationInfo is None:
                dtype = SCALAR_TYPE_TO_DTYPE.get(tensor.scalarType)
                if dtype is None:
                    continue
                nbytes = math.prod(int(d) for d in (tensor.sizes if tensor.sizes is not None else [])) * dtype.itemsize
                sizes[index] = max(sizes.get(index, 0), nbytes)
    return sizes


def _read_segments(program: fb.ProgramT, area: memoryview) -> list[memoryview]:
    segments = []
    for i, entry in enumerate(program.segments or []):
        end = entry.offset + entry.size
        if end > len(area):
            raise PteFormatError(f"segment {i} ends at {end}, past the {len(area)} bytes of segment data")
        segments.append(area[entry.offset:end])
    return segments


def _split_subsegments(table: fb.SubsegmentOffsetsT, segments: list[bytes], what: str) -> list[bytes]:
    """Cut a segment at the given offsets; each piece keeps its trailing padding."""
    if table.segmentIndex >= len(segments):
        raise PteFormatError(f"{what} segment index {table.segmentIndex} >= {len(segments)} segments")
    blob = segments[table.segmentIndex]
    offsets = [int(o) for o in table.offsets] if table.offsets is not None else []
    ends = offsets[1:] + [len(blob)]
    return [blob[start:end] for start, end in zip(offsets, ends)]


def _read_constants(program: fb.ProgramT, segments: list[bytes]) -> list[bytes]:
    table = program.constantSegment
    if table is not None and table.offsets is not None and len(table.offsets) > 0:
        return _split_subsegments(table, segments, "constant")
    inline = [vector_bytes(buffer.storage) for buffer in program.constantBuffer or []]
    return inline or [b""]


def _read_mutable_data(program: fb.ProgramT, segments: list[bytes]) -> list[bytes]:
    tables = program.mutableDataSegments or []
    if len(tables) > 1:
        raise PteFormatError(f"{len(tables)} mutable data segments; only one is supported")
    return [bytes(blob) for blob in _split_subsegments(tables[0], segments, "mutable data")] if tables else []


def delegate_payload(data: "bytes | memoryview", program: fb.ProgramT, delegate: fb.BackendDelegateT) -> bytes:
    """The processed bytes of ``delegate``, one of ``program``'s (:func:`program_table` of the
    ``.pte`` ``data``): its segment alone is read (``data`` may be a mapped file's view), or
    its inline data."""
    reference = delegate.processed
    if reference.location != fb.DataLocation.SEGMENT:
        return _inline_payload(program, delegate)
    header = read_extended_header(bytes(data[:8 + EXTENDED_HEADER_LENGTH]))
    segments = program.segments or []
    if reference.index >= len(segments):
        raise PteFormatError(f"delegate {decode_string(delegate.id)!r}: segment {reference.index} >= "
                             f"{len(segments)} segments")
    entry = segments[reference.index]
    start = (header.segment_base_offset if header else 0) + entry.offset
    if not header or not header.segment_base_offset or start + entry.size > len(data):
        raise PteFormatError(f"segment {reference.index} ends past the {len(data)} bytes of the file")
    return bytes(data[start:start + entry.size])


def _inline_payload(program: fb.ProgramT, delegate: fb.BackendDelegateT) -> bytes:
    inline = program.backendDelegateData or []
    if delegate.processed.index >= len(inline):
        raise PteFormatError(f"delegate {decode_string(delegate.id)!r}: inline data {delegate.processed.index} "
                             f">= {len(inline)}")
    return vector_bytes(inline[delegate.processed.index].data)


def _read_delegate_payloads(program: fb.ProgramT, segments: list[bytes]) -> list[bytes]:
    """Collect delegate payloads (deduplicated) and re-point delegates at them."""
    inline = program.backendDelegateData or []
    payloads: list[bytes] = []
    index_of: dict[bytes, int] = {}
    for plan in program.executionPlan or []:
        for delegate in plan.delegates or []:
            reference = delegate.processed
            if reference.location == fb.DataLocation.SEGMENT:
                if reference.index >= len(segments):
                    raise PteFormatError(
                        f"delegate {decode_string(delegate.id)!r}: segment {reference.index} >= {len(segments)} segments"
                    )
                payload = bytes(segments[reference.index])
            else:
                if reference.index >= len(inline):
                    raise PteFormatError(
                        f"delegate {decode_string(delegate.id)!r}: inline data {reference.index} >= {len(inline)}"
                    )
                payload = vector_bytes(inline[reference.index].data)
            if payload not in index_of:
                index_of[payload] = len(payloads)
                payloads.append(payload)
            delegate.processed = _data_reference(fb.DataLocation.SEGMENT, index_of[payload])
    return payloads


def _read_named_data(program: fb.ProgramT, segments: list[bytes]) -> dict[str, bytes]:
    named = {}
    for entry in program.namedData or []:
        key = decode_string(entry.key)
        if entry.segmentIndex >= len(segments):
            raise PteFormatError(f"named data {key!r}: segment {entry.segmentIndex} >= {len(segments)} segments")
        named[key] = segments[entry.segmentIndex]
    return named


def vector_bytes(vector) -> bytes:
    """Bytes of a ``[ubyte]`` field as the object API unpacks it (numpy array, list or None)."""
    if vector is None:
        return b""
    if hasattr(vector, "tobytes"):
        return vector.tobytes()
    return bytes(vector)


def decode_string(value) -> str:
    """A flatbuffer ``string`` field (the object API unpacks it as bytes) as str."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _padding(offset: int, alignment: int) -> int:
    return (-offset) % alignment
