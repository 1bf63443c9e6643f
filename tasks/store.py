"""The artifact store: content-addressed objects and named outputs on any fsspec URL.

Layout under the store's root URL (a local directory, ``s3://bucket/prefix``,
``memory://name``, ...)::

    <root>/objects/ab/cdef0123...      every artifact, named by the sha256 of its bytes
    <root>/outputs/<name>              named outputs, e.g. outputs/mlp/reference.pte
    <root>/quarantine/<sha256>.<time>  objects that failed their digest check, moved aside

Tasks pass :class:`ArtifactRef` values (uri, sha256, size, kind): small, JSON-able,
and what Prefect persists as a task result.

Guarantees:

* ``put_bytes`` is idempotent: an object already present with the right size is not
  rewritten (a present object of the wrong size is quarantined and rewritten).
* Writes are atomic: on a local filesystem bytes go to a temporary name in the same
  directory and are renamed into place; on object stores (s3, gcs, memory, ...)
  a single put is atomic.  A reader never sees a half-written object.
* ``get_bytes`` checks the sha256 of what it read: a missing object raises
  :class:`ArtifactMissing`, a corrupt one is quarantined and raises
  :class:`ArtifactCorrupt` (so that recomputing and storing it again repairs the store).
* Objects are located by digest, so refs stay valid when a store is copied or moved;
  ``ArtifactRef.uri`` says where the object was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import fsspec

if TYPE_CHECKING:  # torch is imported only by the program helpers, on use
    from torch.export import ExportedProgram

#: Root used when no URL is given and ``$LOWERFLOW_STORE`` is unset.
DEFAULT_ROOT = "./.lowerflow"
#: Environment variable naming the default store URL.
STORE_ENV = "LOWERFLOW_STORE"
#: Kinds whose objects are manifests naming further objects (``lowering.serialize``).
MANIFEST_KINDS = frozenset({"program"})

#: Filesystems where one put is atomic; everywhere else bytes are written then renamed.
_ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "az", "memory"})
_HEX = frozenset("0123456789abcdef")


class StoreError(Exception):
    """Base class of artifact store errors."""


class ArtifactMissing(StoreError):
    """The object an :class:`ArtifactRef` names is not in the store."""


class ArtifactCorrupt(StoreError):
    """The object's bytes do not match the digest that names them."""


@dataclass(frozen=True)
class ArtifactRef:
    """A stored artifact: where it was written, its sha256 (hex), its size and kind."""

    uri: str
    sha256: str
    size: int
    kind: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or not set(self.sha256) <= _HEX:
            raise ValueError(f"ArtifactRef {self.uri!r}: sha256 {self.sha256!r} is not 64 hex digits")

    def to_json(self) -> dict[str, Any]:
        """The ref as a JSON object."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ArtifactRef":
        """The ref a :meth:`to_json` object describes; raises ValueError if malformed."""
        try:
            return cls(str(obj["uri"]), str(obj["sha256"]), int(obj["size"]), str(obj["kind"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an ArtifactRef: {obj!r}") from exc


def sha256_hex(data: bytes) -> str:
    """The digest that names ``data`` in the store."""
    return hashlib.sha256(data).hexdigest()


class ArtifactStore:
    """Content-addressed artifacts under one fsspec root URL.

    ``url`` defaults to ``$LOWERFLOW_STORE`` or ``./.lowerflow`` (made absolute);
    ``storage_options`` go to fsspec (e.g. ``client_kwargs={"endpoint_url": ...}`` for s3).
    """

    def __init__(self, url: str | None = None, **storage_options: Any) -> None:
        url = url or os.environ.get(STORE_ENV) or DEFAULT_ROOT
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.url = self.fs.unstrip_protocol(self.root)
        self.storage_options = dict(storage_options)
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.is_local = "file" in protocols
        self._atomic_put = bool(protocols & _ATOMIC_PUT_PROTOCOLS)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # ------------------------------------------------------------------ locations

    def object_path(self, sha256: str) -> str:
        """Filesystem path of the object named ``sha256``."""
        return f"{self.root}/objects/{sha256[:2]}/{sha256[2:]}"

    def named_path(self, name: str) -> str:
        """Filesystem path of the named output ``name`` (e.g. ``"mlp/reference.pte"``)."""
        return f"{self.root}/outputs/{_check_name(name)}"

    def uri(self, path: str) -> str:
        """The full URL of a path of this store."""
        return self.fs.unstrip_protocol(path)

    # ------------------------------------------------------------------ objects

    def put_bytes(self, data: bytes, kind: str) -> ArtifactRef:
        """Store ``data`` (bytes or any contiguous buffer, e.g. a tensor's memoryview: not
        copied) under its sha256 (no rewrite if present) and return its ref."""
        view = byte_view(data)
        return self._put_digested(sha256_hex(view), view, kind)

    def _put_digested(self, digest: str, view: memoryview, kind: str) -> ArtifactRef:
        """The write path: store ``view``, whose sha256 is ``digest``, unless present."""
        path = self.object_path(digest)
        size = self._size(path)
        if size is not None and size != view.nbytes:
            self._quarantine(path, digest)
            size = None
        if size is None:
            self._write_atomic(path, view)
        elif self.is_local:
            os.utime(path)  # in use again: garbage collection counts its age from now
        return ArtifactRef(self.uri(path), digest, view.nbytes, kind)

    def get_bytes(self, ref: ArtifactRef) -> bytes:
        """The bytes of ``ref`` (an object, or a named output of this store), digest-checked."""
        name = self._output_name(ref.uri)
        if name is not None:
            path = self.named_path(name)
            return self._read_verified(path, ref.sha256, f"named output {name!r} ({ref.kind})", quarantine=False)
        return self.read_object(ref.sha256, what=f"{ref.kind} artifact")

    def read_object(self, sha256: str, *, what: str = "object") -> bytes:
        """The bytes of the object named ``sha256``; quarantines and raises if corrupt."""
        return self._read_verified(self.object_path(sha256), sha256, what, quarantine=True)

    def read_object_buffer(self, sha256: str, *, what: str = "object") -> bytes | bytearray:
        """:meth:`read_object`, as a ``bytearray`` on a local store (read in place, no copy:
        what :func:`lowering.serialize.tensor_from_blob` keeps as a tensor's memory)."""
        return self._read_verified(self.object_path(sha256), sha256, what, quarantine=True, writable=True)

    def has(self, sha256: str) -> bool:
        """Whether an object named ``sha256`` is present (without checking its bytes)."""
        return self._size(self.object_path(sha256)) is not None

    def exists(self, ref: ArtifactRef) -> bool:
        """Whether ``ref`` (an object or a named output) is present with its size."""
        name = self._output_name(ref.uri)
        path = self.named_path(name) if name is not None else self.object_path(ref.sha256)
        return self._size(path) == ref.size

    def verify(self, ref: ArtifactRef, *, deep: bool = True) -> None:
        """Raise ArtifactMissing/ArtifactCorrupt unless ``ref`` (and, for manifests with
        ``deep``, every object the manifest names) is present and intact."""
        data = self.get_bytes(ref)
        if deep and ref.kind in MANIFEST_KINDS:
            from lowering.serialize import manifest_blobs

            for digest in manifest_blobs(data):
                self.read_object(digest, what=f"blob of {ref.kind} {ref.sha256[:12]}")

    # ------------------------------------------------------------------ named outputs

    def put_named(self, name: str, data: bytes, kind: str = "named") -> ArtifactRef:
        """Atomically write ``data`` at ``<root>/outputs/<name>`` (overwriting) and return its ref."""
        view = byte_view(data)
        path = self.named_path(name)
        self._write_atomic(path, view)
        return ArtifactRef(self.uri(path), sha256_hex(view), view.nbytes, kind)

    def get_named(self, name: str) -> bytes:
        """The bytes of the named output ``name``; raises ArtifactMissing if absent."""
        path = self.named_path(name)
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise ArtifactMissing(f"named output {name!r} is not in store {self.url}") from None

    def remove_named(self, name: str) -> bool:
        """Remove the named output ``name`` if present; returns whether it was there."""
        path = self.named_path(name)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def put_json(self, name: str, obj: Any, kind: str = "json") -> ArtifactRef:
        """A named JSON output (sorted keys, indented) such as a fleet manifest."""
        text = json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n"
        return self.put_named(name, text.encode("utf-8"), kind)

    def get_json(self, name: str) -> Any:
        """The parsed named JSON output ``name``."""
        return json.loads(self.get_named(name))

    # ------------------------------------------------------------------ programs

    def put_program(self, ep: "ExportedProgram", *, keep_stack_traces: bool = True) -> ArtifactRef:
        """Store a program (plain, or holding lowered modules) as its manifest plus one
        object per blob (weights stored once)."""
        from lowering.serialize import serialize_any

        serialized = serialize_any(ep, keep_stack_traces=keep_stack_traces)
        for digest, data in serialized.blobs.items():  # views of the program's tensors, hashed once
            self._put_digested(digest, byte_view(data), "blob")
        return self.put_bytes(serialized.manifest, "program")

    def get_program(self, ref: ArtifactRef) -> "ExportedProgram":
        """Load the program a :meth:`put_program` ref names, checking every digest.  Each
        weight is read into the buffer its tensor keeps (one copy, never two)."""
        from lowering.serialize import deserialize_any

        what = f"blob of program {ref.sha256[:12]}"
        return deserialize_any(self.get_bytes(ref), lambda d: self.read_object_buffer(d, what=what))

    def put_blobs(self, blobs: Iterable[bytes]) -> list[ArtifactRef]:
        """Store manifest blobs (kind ``"blob"``); present ones are not rewritten."""
        return [self.put_bytes(b, "blob") for b in blobs]

    # ------------------------------------------------------------------ internals

    def _output_name(self, uri: str) -> str | None:
        """The output name if ``uri`` is a named output of this store, else None."""
        prefix = f"{self.url}/outputs/"
        return uri[len(prefix):] if uri.startswith(prefix) else None

    def _size(self, path: str) -> int | None:
        try:
            return int(self.fs.size(path))
        except FileNotFoundError:
            return None

    def _read_verified(self, path: str, sha256: str, what: str, *, quarantine: bool,
                       writable: bool = False) -> bytes:
        try:
            data = _read_into_buffer(path) if writable and self.is_local else self.fs.cat_file(path)
        except FileNotFoundError:
            raise ArtifactMissing(f"{what} {sha256} is missing from store {self.url}") from None
        actual = sha256_hex(data)
        if actual != sha256:
            if quarantine:
                self._quarantine(path, sha256)
            raise ArtifactCorrupt(
                f"{what} {sha256} in store {self.url} is corrupt: its {len(data)} bytes "
                f"hash to {actual}" + (" (moved to quarantine/)" if quarantine else "")
            )
        return data

    def _write_atomic(self, path: str, data: bytes | memoryview) -> None:
        parent = posixpath.dirname(path)
        if not self.is_local:
            data = bytes(data)  # fsspec's remote filesystems take bytes
        if self._atomic_put:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        if self.is_local:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:  # e.g. sftp: rename is atomic there too
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)

    def _quarantine(self, path: str, sha256: str) -> None:
        """Move a bad object aside so that the next put of its bytes rewrites it."""
        target = f"{self.root}/quarantine/{sha256}.{time.time_ns()}"
        try:
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.mv(path, target)
        except FileNotFoundError:
            pass  # already moved or removed by someone else


def byte_view(data: Any) -> memoryview:
    """``data`` (bytes, bytearray, memoryview, numpy array ...) as a flat memoryview of bytes, no copy."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _read_into_buffer(path: str) -> bytearray:
    """A local file's bytes read straight into one ``bytearray`` (``cat_file`` would give bytes
    that the caller then copies into writable memory)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return buffer if done == size else buffer[:done]


def _check_name(name: str) -> str:
    """A named output must be a relative POSIX path without '.' or '..' parts."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"output name {name!r} must be a relative path like 'model/target.pte'")
    return name
