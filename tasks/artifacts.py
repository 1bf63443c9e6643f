"""The stages' artifacts: programs, JSON documents, named-data blobs and emitted ``.pte``
files, put into the content-addressed store and kept live (:data:`tasks.live.LIVE`) so
the next stage in this process reads the object, not the store."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from lowering.partition import TAG
from lowering.program import strip_debug_metadata
from lowering.serialize import canonical_json

from .live import LIVE
from .model_spec import ModelSpec
from .store import ArtifactRef, ArtifactStore


def put_program(store: ArtifactStore, program: torch.export.ExportedProgram,
                files: Callable[[memoryview], list[tuple[str, int]]] | None = None) -> ArtifactRef:
    """Store a program (plain or holding lowered modules): blobs once by content, then its manifest.

    Debug metadata (source lines, module paths) is dropped first, so the bytes,
    and every downstream cache key, do not depend on where or in which class
    the model's source lives.  Partition tags are dropped too (after the store
    wrote the program, which never holds them; stage 2 stores them apart): the
    object kept live must be what reading the digest back gives, or the next
    stage would see another target's tags on a program whose digest is the
    untagged one's (issue 7: reference's tags on the program xnnpack partitioned).
    ``files``: where its weights also are, outside the store (:func:`checkpoint_ranges`).
    """
    strip_debug_metadata(program)
    ref = store.put_program(program, keep_stack_traces=False, files=files)
    for node in program.graph.nodes:
        node.meta.pop(TAG, None)
    LIVE.put(ref, program)
    return ref


#: Bytes per element of safetensors' dtypes.
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

#: ``(path, offset, transpose)`` where a blob's bytes may be: see :func:`checkpoint_ranges`.
Candidate = tuple[str, int, "tuple[int, int, int] | None"]


def checkpoint_ranges(model: str) -> Callable[[memoryview], list[Candidate]] | None:
    """Where a weight's bytes may be in the safetensors files of the hf: model ``model`` (a
    local directory): ``find(blob) -> [(path, offset, transpose)]``, the tensors of the blob's
    size whose first elements are the blob's, as they are (``transpose`` None) or transposed
    (``(rows, cols, itemsize)``: export folds a linear's ``weight.t()`` into a constant
    ``weight#t``).  The store hashes a candidate before it keeps a blob as it
    (:meth:`ArtifactStore.keep_in_file`).  An fp32 checkpoint's tensors are what the exported
    program holds, so its weights are not stored twice (issue 27).  None for other models."""
    spec = ModelSpec.parse(model)
    directory = Path(spec.location).expanduser()
    if spec.kind != "hf" or not directory.is_dir():
        return None
    by_size: dict[int, list[tuple[str, int, list[int], int]]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for offset, size, shape, itemsize in safetensors_tensors(path):
            by_size.setdefault(size, []).append((str(path), offset, shape, itemsize))

    def find(blob: memoryview) -> list[Candidate]:
        found: list[Candidate] = []
        for path, offset, shape, itemsize in by_size.get(blob.nbytes, ()):
            rows, cols = (shape[0], blob.nbytes // itemsize // shape[0]) if len(shape) == 2 and shape[0] else (0, 0)
            # element i of the transpose is element (i, 0) of the matrix: rows of it, cols apart
            picks = {"as it is": [(0, min(64, blob.nbytes))],
                     "transposed": [(i * cols * itemsize, itemsize) for i in range(min(rows, 8))] if rows > 1 < cols else []}
            with contextlib.suppress(OSError), open(path, "rb") as f:
                for how, spots in picks.items():
                    want = bytes(blob[:sum(n for _, n in spots)])
                    got = b""
                    for at, n in spots:
                        f.seek(offset + at)
                        got += f.read(n)
                    if spots and got == want:
                        found.append((path, offset, None if how == "as it is" else (rows, cols, itemsize)))
        return found

    return find if by_size else None


def safetensors_tensors(path: str | os.PathLike) -> list[tuple[int, int, list[int], int]]:
    """``(offset in the file, size, shape, itemsize)`` of each tensor of a safetensors file (none
    if it is not one)."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 0 < length <= 100_000_000 else None
    except (OSError, ValueError):
        return []
    tensors = []
    for name, info in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__" or not isinstance(info, dict) or info.get("dtype") not in _ITEMSIZE:
            continue
        begin, end = info.get("data_offsets") or (0, 0)
        shape = info.get("shape")
        if isinstance(begin, int) and isinstance(end, int) and end > begin and isinstance(shape, list):
            tensors.append((8 + length + begin, end - begin, shape, _ITEMSIZE[info["dtype"]]))
    return sorted(tensors)


def get_program(store: ArtifactStore, ref: ArtifactRef) -> torch.export.ExportedProgram:
    return LIVE.get(ref, lambda: store.get_program(ref))


def get_program_tables(store: ArtifactStore, ref: ArtifactRef, skip: Any = frozenset()) -> tuple[dict, dict]:
    """``(state_dict, constants)`` of a stored program: the live program's, else read from the
    store without its graph (binding new weights needs no more of a program it does not emit);
    ``skip``: entries whose bytes are not read (tensors on the ``meta`` device: new weights
    replace them, :func:`lowering.serialize.deserialize_tables`)."""
    from lowering.serialize import CheckingReader, deserialize_tables

    program = LIVE.peek(ref)
    if program is not None:
        return program.state_dict, program.constants
    what = f"blob of program {ref.sha256[:12]}"  # as ArtifactStore.get_program reads them
    return deserialize_tables(store.get_bytes(ref), CheckingReader(lambda d: store.read_object_buffer(d, what=what)), skip)


def put_doc(store: ArtifactStore, doc: Any, kind: str) -> ArtifactRef:
    """Store a small JSON document (canonical bytes, so equal documents share one object)."""
    ref = store.put_bytes(canonical_json(_jsonable(doc)), kind)
    LIVE.put(ref, doc)
    return ref


def get_doc(store: ArtifactStore, ref: ArtifactRef) -> Any:
    return LIVE.get(ref, lambda: _from_jsonable(json.loads(store.get_bytes(ref))))


def _jsonable(doc: Any) -> Any:
    if isinstance(doc, ArtifactRef):
        return {"$ref": doc.to_json()}
    if isinstance(doc, dict):
        return {k: _jsonable(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_jsonable(v) for v in doc]
    return doc


def _from_jsonable(doc: Any) -> Any:
    if isinstance(doc, dict):
        if set(doc) == {"$ref"}:
            return ArtifactRef.from_json(doc["$ref"])
        return {k: _from_jsonable(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_from_jsonable(v) for v in doc]
    return doc


def put_blob(store: ArtifactStore, blob: Any, kind: str = "named_data") -> ArtifactRef:
    """Store a blob of named data and keep it live: mostly a view of a weight of the
    partition's program (:func:`lowering.tensor_blobs.tensor_memory`), so adjust reads it
    without a second copy of the weight."""
    ref = store.put_bytes(blob, kind)
    LIVE.put(ref, blob)
    return ref


def get_blob(store: ArtifactStore, ref: ArtifactRef) -> Any:
    return LIVE.get(ref, lambda: store.get_bytes(ref))


def put_pte(store: ArtifactStore, pte: bytes) -> ArtifactRef:
    """Store an emitted ``.pte``; the blobs of earlier stages it holds verbatim (weights,
    delegate named data) are then kept as windows of it, so each weight byte-string is
    stored once across the stages and the program (ArtifactStore.keep_as_windows)."""
    from lowering.pte.format import data_windows

    ref = store.put_bytes(pte, "pte")
    store.keep_as_windows(ref, data_windows(pte), pte)
    return ref


def local_pte(store: ArtifactStore, ref: ArtifactRef, files: contextlib.ExitStack) -> str:
    """A local file of the program ``ref`` (or its ``.ptd``): the store's own where it is a
    local directory, else a temporary copy (removed when ``files`` closes)."""
    path = store.local_object_path(ref)
    if path is not None:
        return path
    tmp = files.enter_context(tempfile.TemporaryDirectory(prefix="lowerflow-benchmark-"))
    path = os.path.join(tmp, f"{ref.sha256}.{ref.kind or 'pte'}")
    with open(path, "wb") as f:
        f.write(store.get_bytes(ref))
    return path
