"""The stages' artifacts: programs, JSON documents, named-data blobs and emitted ``.pte``
files, put into the content-addressed store and kept live (:data:`tasks.live.LIVE`) so
the next stage in this process reads the object, not the store."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch

from lowering.partition import TAG
from lowering.program import strip_debug_metadata
from lowering.serialize import canonical_json

from .live import LIVE
from .store import ArtifactRef, ArtifactStore


def put_program(store: ArtifactStore, program: torch.export.ExportedProgram) -> ArtifactRef:
    """Store a program (plain or holding lowered modules): blobs once by content, then its manifest.

    Debug metadata (source lines, module paths) is dropped first, so the bytes,
    and every downstream cache key, do not depend on where or in which class
    the model's source lives.  Partition tags are dropped too (after the store
    wrote the program, which never holds them; stage 2 stores them apart): the
    object kept live must be what reading the digest back gives, or the next
    stage would see another target's tags on a program whose digest is the
    untagged one's (issue 7: reference's tags on the program xnnpack partitioned).
    """
    strip_debug_metadata(program)
    ref = store.put_program(program, keep_stack_traces=False)
    for node in program.graph.nodes:
        node.meta.pop(TAG, None)
    LIVE.put(ref, program)
    return ref


def get_program(store: ArtifactStore, ref: ArtifactRef) -> torch.export.ExportedProgram:
    return LIVE.get(ref, lambda: store.get_program(ref))


def get_program_tables(store: ArtifactStore, ref: ArtifactRef) -> tuple[dict, dict]:
    """``(state_dict, constants)`` of a stored program: the live program's, else read from the
    store without its graph (binding new weights needs no more of a program it does not emit)."""
    from lowering.serialize import deserialize_tables

    program = LIVE.peek(ref)
    if program is not None:
        return program.state_dict, program.constants
    what = f"blob of program {ref.sha256[:12]}"  # as ArtifactStore.get_program reads them
    return deserialize_tables(store.get_bytes(ref), lambda d: store.read_object_buffer(d, what=what))


def put_doc(store: ArtifactStore, doc: Any, kind: str) -> ArtifactRef:
    """Store a small JSON document (canonical bytes, so equal documents share one object)."""
    ref = store.put_bytes(canonical_json(_jsonable(doc)), kind)
    LIVE.put(ref, doc)
    return ref


def get_doc(store: ArtifactStore, ref: ArtifactRef) -> Any:
    import json

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
    partition's program (:func:`lowering.serialize.tensor_memory`), so adjust reads it
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
