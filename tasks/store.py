"""The artifact store: content-addressed objects and named outputs on any fsspec URL.

Layout under the store's root URL (a local directory, ``s3://bucket/prefix``,
``memory://name``, ...)::

    <root>/objects/ab/cdef0123...      every artifact, named by the sha256 of its bytes
    <root>/outputs/<name>              named outputs, e.g. outputs/mlp/reference.pte
    <root>/quarantine/<sha256>.<time>  objects that failed their digest check, moved aside
    <root>/windows/ab/cdef0123...      objects kept as a range of a bigger object or of a file (see "windows")
    <root>/checked/ab/cdef0123...      a local store: the stamp of the file an object's digest was checked on

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

Checked objects (a local store).  :meth:`ArtifactStore.verify` (what a cache hit runs
before it is used) hashes every object it names, unless this store checked the object
before and the file holding it has not changed since: ``checked/ab/cdef...`` records the
file's stamp (path, size, mtime_ns, ctime_ns, inode, device; for a window, the window
too) when its bytes last hashed to the object's name, or when the store wrote them.  A
stamp that differs in any field means the object is hashed again (and quarantined if
corrupt); except that a window of an object, once checked, stays checked while that
object is (the object's bytes are fixed by its name, so are the range's), whatever moved
the object's stamp since (a hard link to it: a published output, ``lowerflow lower -o``).
So a cached rerun stats its objects instead of re-reading them (SmolLM2-135M: 1.1 GB
hashed per warm run before).  What the stamp catches, and what it cannot:

* caught: any write through the filesystem to the object's file (it moves mtime and
  ctime; putting mtime back with ``touch -d`` or ``os.utime`` still moves ctime, which
  no call sets), a truncated or extended file (size), a file replaced by another
  (rename over it: inode, ctime), a file copied elsewhere with ``cp -a`` (inode, ctime);
* not caught: bytes changed below the filesystem (a failing disk, writes to the block
  device, a filesystem image edited offline), a record file forged to match, and a
  change by another writer within the same timestamp tick as the stamp was taken (none
  on Linux >= 6.13, whose ext4/xfs/btrfs/tmpfs give a change after a stat of the file
  a later ctime; one kernel tick, a few ms, before).
  ``LOWERFLOW_STORE_REHASH=1`` ignores the records (every check hashes, as before).

Why one room: objects, windows (of objects and of files) and check records are one
namespace whose rules every method keeps together (a put consults windows, a stamp covers
a window's container, a quarantine frees the windows of what it moves, a window that no
longer holds its bytes is dropped with its record); split, each half would reach into the
other's private helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import fsspec

from .local_files import (OBJECT_XATTR, file_digest, name_file, path_stamp, read_into_buffer, same_file,
                          transposed)

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


#: Environment variable: set (to anything but "" or "0"), checks ignore the checked records
#: and hash every object (see "Checked objects" above).
REHASH_ENV = "LOWERFLOW_STORE_REHASH"


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
        return self.put_parts([data], kind)

    def put_parts(self, parts: Iterable[Any], kind: str) -> ArtifactRef:
        """:meth:`put_bytes` of the concatenation of ``parts`` (buffers, e.g. a ``.ptd``'s header
        and its weights' tensor memory: :func:`lowering.pte.flat_tensor.ptd_parts`), hashed and
        written one after another, never joined in memory (on a local store)."""
        views = [byte_view(part) for part in parts]
        digest = hashlib.sha256()
        for view in views:
            digest.update(view)
        return self._put_digested(digest.hexdigest(), views, kind)

    def _put_digested(self, digest: str, views: list[memoryview], kind: str) -> ArtifactRef:
        """The write path: store the bytes of ``views`` (in order), whose sha256 is ``digest``, unless present."""
        path = self.object_path(digest)
        size, nbytes = self._size(path), sum(view.nbytes for view in views)
        if size is not None and size != nbytes:
            self._quarantine(path, digest)
            size = None
        if size is None and self._window_size(digest) == nbytes and self._window_holds(digest):
            self._touch(self.window_path(digest))  # kept as a window of a bigger object (or of a file)
        elif size is None:
            self._write_atomic(path, views)
            if self.is_local:
                name_file(path, digest)  # before its stamp: setting it moves the ctime
            self._record_check(digest, self._file_stamp(digest))  # its bytes are the ones just hashed
        elif self.is_local:
            with self._keeping_check(digest):
                os.utime(path)  # in use again: garbage collection counts its age from now
        return ArtifactRef(self.uri(path), digest, nbytes, kind)

    def get_bytes(self, ref: ArtifactRef) -> bytes:
        """The bytes of ``ref`` (an object, or a named output of this store), digest-checked."""
        name = self._output_name(ref.uri)
        if name is not None:
            path = self.named_path(name)
            return self._read_verified(path, ref.sha256, f"named output {name!r} ({ref.kind})", quarantine=False)
        return self.read_object(ref.sha256, what=f"{ref.kind} artifact")

    def read_object(self, sha256: str, *, what: str = "object") -> bytes:
        """The bytes of the object named ``sha256`` (or of its window); quarantines and
        raises if corrupt."""
        try:
            return self._read_verified(self.object_path(sha256), sha256, what, quarantine=True)
        except ArtifactMissing:
            data = self._read_window(sha256, what)
            if data is None:
                raise
            return data

    def local_object_path(self, ref: ArtifactRef) -> str | None:
        """The local file of the object ``ref`` names, for a reader that maps it rather than
        reading it into memory (ExecuTorch's runtime loading a ``.pte``); None where the
        store is not a local directory or the object is not there at its size.  Its
        digest is not checked here (verify runs it; what is published is checked)."""
        if not self.is_local or self._output_name(ref.uri) is not None:
            return None
        path = self.object_path(ref.sha256)
        return path if self._size(path) == ref.size else None

    def read_object_buffer(self, sha256: str, *, what: str = "object") -> bytes | bytearray:
        """:meth:`read_object`, as a ``bytearray`` on a local store (read in place, no copy:
        what :func:`lowering.serialize.tensor_from_blob` keeps as a tensor's memory); a window
        of a bigger object is read as its range (bytes)."""
        try:
            return self._read_verified(self.object_path(sha256), sha256, what, quarantine=True, writable=True)
        except ArtifactMissing:
            data = self._read_window(sha256, what)
            if data is None:
                raise
            return data

    def has(self, sha256: str) -> bool:
        """Whether an object named ``sha256`` is present (without checking its bytes)."""
        return self._object_size(sha256) is not None

    def exists(self, ref: ArtifactRef) -> bool:
        """Whether ``ref`` (an object or a named output) is present with its size."""
        name = self._output_name(ref.uri)
        if name is not None:
            return self._size(self.named_path(name)) == ref.size
        return self._object_size(ref.sha256) == ref.size

    def verify(self, ref: ArtifactRef, *, deep: bool = True) -> None:
        """Raise ArtifactMissing/ArtifactCorrupt unless ``ref`` (and, for manifests with
        ``deep``, every object the manifest names) is present and intact."""
        if ref.kind not in MANIFEST_KINDS and self._output_name(ref.uri) is None:
            self._check_object(ref.sha256, f"{ref.kind} artifact")
            return
        data = self.get_bytes(ref)
        if deep and ref.kind in MANIFEST_KINDS:
            from lowering.serialize import manifest_blobs

            for digest in manifest_blobs(data):
                self._check_object(digest, f"blob of {ref.kind} {ref.sha256[:12]}")

    def _check_object(self, sha256: str, what: str) -> None:
        """:meth:`read_object` for its digest check, unless the store checked the object
        before and the file holding it is unchanged since (a local store: "Checked objects"
        above); a check that hashes records the stamp."""
        stamp = self._file_stamp(sha256)
        if self.checked(sha256, stamp):
            return
        if self._follows_container(stamp, self._check_record(sha256)):  # hash the object once, not each window
            container = str(stamp["window"]["object"])
            try:
                self._check_object(container, f"container of {what}")
            except ArtifactMissing:
                pass  # the window is read alone below
            except ArtifactCorrupt as exc:  # quarantined: the window has its own file if it was intact
                if self._file_stamp(sha256) is None:
                    raise ArtifactCorrupt(f"{what} {sha256} in store {self.url} is corrupt: its window of object "
                                          f"{container} is in a corrupt object ({exc})") from None
            stamp = self._file_stamp(sha256)
            if self.checked(sha256, stamp):
                return
        if stamp is None or file_digest(posixpath.join(self.root, stamp["file"]), stamp["window"]) != sha256:
            self.read_object(sha256, what=what)  # elsewhere, or the error it raises (quarantined)
        if stamp is not None and self._file_stamp(sha256) == stamp:  # unchanged while it was hashed
            self._record_check(sha256, stamp)

    def checked(self, sha256: str, stamp: dict | None = None) -> bool:
        """Whether the local file holding the object ``sha256`` is as it was when its bytes
        last hashed to ``sha256`` (its stamp equals the recorded one); False on other stores,
        without a record, or with ``$LOWERFLOW_STORE_REHASH`` set."""
        stamp = stamp if stamp is not None else self._file_stamp(sha256)
        if stamp is None or os.environ.get(REHASH_ENV, "") not in ("", "0"):
            return False
        record = self._check_record(sha256)
        if record == stamp:
            return True
        return self._follows_container(stamp, record) and self.checked(str(stamp["window"]["object"]))

    @staticmethod
    def _follows_container(stamp: dict | None, record: Any) -> bool:
        """Whether the object of ``stamp`` is a window of an object (not of an outside file)
        whose bytes hashed to its name in that same range of that same object, as its check
        ``record`` says: the object's bytes are its name's, so while that object is checked
        the window's are too (a link to the object moves its ctime, never its bytes)."""
        window = (stamp or {}).get("window")
        return (bool(window) and "object" in window and isinstance(record, dict) and record.get("window") == window
                and record.get("file") == stamp.get("file"))

    def _check_record(self, sha256: str) -> Any:
        """The recorded stamp of the object's last check (None without one)."""
        try:
            with open(self.checked_path(sha256), "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    def checked_path(self, sha256: str) -> str:
        """Filesystem path of the record of the object ``sha256``'s last check."""
        return f"{self.root}/checked/{sha256[:2]}/{sha256[2:]}"

    def _record_check(self, sha256: str, stamp: dict | None) -> None:
        """Record that the file of ``stamp`` holds bytes hashing to ``sha256``."""
        if stamp is not None:
            self._write_atomic(self.checked_path(sha256), json.dumps(stamp, sort_keys=True).encode())

    def _forget_check(self, sha256: str) -> None:
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.checked_path(sha256))

    @contextlib.contextmanager
    def _keeping_check(self, sha256: str):
        """Run a change of the object's file's metadata (utime, a hard link: they move its
        ctime, never its bytes): an object checked before it stays checked after it."""
        before = self._file_stamp(sha256)
        was_checked = self.checked(sha256, before)
        yield
        if was_checked:
            self._record_check(sha256, self._file_stamp(sha256))

    def _file_stamp(self, sha256: str) -> dict | None:
        """The stamp of the local file holding the object (its window's container for a
        window): path within the store (absolute for a file window), size, mtime_ns,
        ctime_ns, inode, device, and the window; None elsewhere or when absent."""
        if not self.is_local:
            return None
        path, window = self.object_path(sha256), None
        if not os.path.exists(path):
            window = self.window(sha256)
            if window is None:
                return None
            path = self._window_source(window)
        stamp = path_stamp(path)
        if stamp is None:
            return None
        inside = window is None or "object" in window
        return {"file": posixpath.relpath(path, self.root) if inside else path, **stamp, "window": window}

    # ------------------------------------------------------------------ named outputs

    def put_named(self, name: str, data: bytes, kind: str = "named") -> ArtifactRef:
        """Atomically write ``data`` at ``<root>/outputs/<name>`` (overwriting) and return its ref."""
        view = byte_view(data)
        path = self.named_path(name)
        self._write_atomic(path, view)
        return ArtifactRef(self.uri(path), sha256_hex(view), view.nbytes, kind)

    def publish_object(self, name: str, ref: ArtifactRef, kind: str = "named") -> ArtifactRef:
        """The object ``ref`` at ``<root>/outputs/<name>`` (overwriting), checked against its
        digest, without a second copy where the store allows: a hard link in a local
        directory (nothing to do when it is linked already), a server-side copy on an
        object store (memory:// copies the bytes).  Returns the output's ref."""
        path = self.named_path(name)
        source = self.object_path(ref.sha256)
        if self._size(source) == ref.size and (self.is_local or _server_side_copy(self.fs)):
            if self.is_local and same_file(source, path):
                return ArtifactRef(self.uri(path), ref.sha256, ref.size, kind)
            if self.is_local:
                self._check_object(ref.sha256, f"{ref.kind} artifact")
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                if not self._link(ref.sha256, path):
                    self._replace_file(path, lambda tmp: shutil.copyfile(source, tmp))
            else:
                self._check_file_digest(source, ref)
                self.fs.copy(source, path)
            return ArtifactRef(self.uri(path), ref.sha256, ref.size, kind)
        return self.put_named(name, self.get_bytes(ref), kind)

    def copy_out(self, ref: ArtifactRef, path: str) -> int:
        """Write the bytes of ``ref`` (an object, or a named output of one) to the local file
        ``path`` (atomically), digest-checked; returns their size.  From a local store on the
        same filesystem ``path`` becomes a hard link to the object's file (as a published
        output is: no second copy; a 2 GB program's copy was 3.3 s of a 11 s cached rerun),
        else the file is copied file to file (the kernel copies it); the object's digest is
        checked first unless checked before and unchanged since (:meth:`_check_object`), so
        an earlier output written over in place is caught (quarantined, ArtifactCorrupt), never
        handed out.  A file at ``path`` that already holds those bytes (a rerun writing the
        same output; hashing it costs a third of copying it) is left as it is."""
        source = self.object_path(ref.sha256)
        if self.is_local and same_file(source, path):
            self._check_object(ref.sha256, f"{ref.kind} artifact")
            return ref.size
        if os.path.isfile(path) and os.path.getsize(path) == ref.size and file_digest(path) == ref.sha256:
            return ref.size
        if self.is_local and self._size(source) == ref.size:  # linked or copied: checked first
            self._check_object(ref.sha256, f"{ref.kind} artifact")
            if not self._link(ref.sha256, path):
                self._replace_file(path, lambda tmp: shutil.copyfile(source, tmp))
        else:
            data = self.get_bytes(ref)

            def write(tmp: str) -> None:
                with open(tmp, "wb") as f:
                    f.write(data)

            self._replace_file(path, write)
        return ref.size

    def _replace_file(self, path: str, fill: Callable[[str], Any]) -> None:
        """Replace the local file ``path`` atomically by what ``fill(tmp)`` writes at ``tmp``."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            fill(tmp)
            with self._keeping_replaced(path):
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _link(self, sha256: str, path: str) -> bool:
        """Make ``path`` (replacing it) a hard link to the object's file; False where the
        filesystem cannot (another device, no links): the caller copies."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with self._keeping_check(sha256):  # a link and its rename move the object's ctime
                os.link(self.object_path(sha256), tmp)
                with self._keeping_replaced(path):
                    os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            return False
        return True

    @contextlib.contextmanager
    def _keeping_replaced(self, path: str):
        """Replace or remove the local file ``path``: when it is a hard link to an object's file
        (last night's published output), that object, checked before, stays checked after (the
        link's removal moves its ctime, never its bytes; its next check would hash it again)."""
        linked = self._object_linked_at(path) if self.is_local else None
        with self._keeping_check(linked) if linked is not None else contextlib.nullcontext():
            yield

    def _object_linked_at(self, path: str) -> str | None:
        """The object whose file the local file ``path`` is (its :data:`OBJECT_XATTR`), or None."""
        try:
            digest = os.getxattr(path, OBJECT_XATTR).decode()
        except (OSError, AttributeError, UnicodeDecodeError):  # none, not a file, no xattrs here
            return None
        if len(digest) != 64 or not set(digest) <= _HEX or path == self.object_path(digest):
            return None
        return digest if same_file(path, self.object_path(digest)) else None

    def _check_file_digest(self, path: str, ref: ArtifactRef) -> None:
        """ArtifactCorrupt (the object quarantined) unless the file at ``path`` hashes to ``ref``'s digest."""
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(16 * 2**20):
                digest.update(chunk)
        if digest.hexdigest() != ref.sha256:
            self._quarantine(path, ref.sha256)
            raise ArtifactCorrupt(f"{ref.kind} artifact {ref.sha256} in store {self.url} is corrupt: it hashes to "
                                  f"{digest.hexdigest()} (moved to quarantine/)")

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
            with self._keeping_replaced(path):
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

    # ------------------------------------------------------------------ memos

    def memo_path(self, key: str) -> str:
        """Path of the memo ``key``: ``memo/<key>.json``."""
        return f"{self.root}/memo/{_check_name(key)}.json"

    def put_memo(self, key: str, value: Any) -> None:
        """Remember ``value`` (JSON) under ``key``, a digest of everything that decides it
        (e.g. :func:`tasks.hf_spec.describe`'s description of an hf: model's config), with
        the sha256 of its canonical JSON, which :meth:`get_memo` checks."""
        text = json.dumps(value, sort_keys=True, allow_nan=False)
        document = {"sha256": sha256_hex(text.encode("utf-8")), "value": value}
        self._write_atomic(self.memo_path(key), json.dumps(document, sort_keys=True).encode("utf-8"))

    def get_memo(self, key: str) -> Any | None:
        """The value remembered under ``key``, or None (absent, unreadable, or not the value
        its digest names).  A hit refreshes a local memo's time (``lowerflow gc`` removes
        memos unused for ``--keep-days``)."""
        path = self.memo_path(key)
        try:
            document = json.loads(self.fs.cat_file(path))
            value = document["value"]
            if document["sha256"] != sha256_hex(json.dumps(value, sort_keys=True, allow_nan=False).encode("utf-8")):
                return None
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        self._touch(path)
        return value

    # ------------------------------------------------------------------ programs

    def put_program(self, ep: "ExportedProgram", *, keep_stack_traces: bool = True,
                    files: "Callable[[memoryview], Iterable[tuple[str, int, Any]]] | None" = None) -> ArtifactRef:
        """Store a program (plain, or holding lowered modules) as its manifest plus one
        object per blob (weights stored once).  ``files(blob)``: where a blob's bytes may
        also be in a local file outside the store, as ``(path, offset)`` candidates (an hf:
        checkpoint's tensors, :func:`tasks.artifacts.checkpoint_ranges`), and ``(rows, cols,
        itemsize)`` if transposed: a blob whose range there hashes to its digest is kept as a
        window of that file (:meth:`keep_in_file`)."""
        from lowering.serialize import serialize_any

        serialized = serialize_any(ep, keep_stack_traces=keep_stack_traces)
        for digest, data in serialized.blobs.items():  # views of the program's tensors, hashed once
            view = byte_view(data)
            candidates = files(view) if files is not None and not self.has(digest) else ()
            if not any(self.keep_in_file(digest, path, offset, view.nbytes, transpose)
                       for path, offset, transpose in candidates):
                self._put_digested(digest, [view], "blob")
        return self.put_bytes(serialized.manifest, "program")

    def get_program(self, ref: ArtifactRef) -> "ExportedProgram":
        """Load the program a :meth:`put_program` ref names, checking every digest.  Each
        weight is read into the buffer its tensor keeps (one copy, never two)."""
        from lowering.serialize import CheckingReader, deserialize_any

        what = f"blob of program {ref.sha256[:12]}"
        return deserialize_any(self.get_bytes(ref), CheckingReader(lambda d: self.read_object_buffer(d, what=what)))

    def put_blobs(self, blobs: Iterable[bytes]) -> list[ArtifactRef]:
        """Store manifest blobs (kind ``"blob"``); present ones are not rewritten."""
        return [self.put_bytes(b, "blob") for b in blobs]

    # ------------------------------------------------------------------ windows
    #
    # An object whose bytes are a window of a bigger object (a weight blob of the stages'
    # programs inside the emitted .pte) is kept once: ``windows/ab/cdef...`` (JSON
    # ``{"object": digest, "offset": n, "size": n}``) replaces its file, and reads of it
    # read that range of the bigger object (digest-checked as ever).  Garbage collection
    # keeps the bigger object while a window of it is in use (tasks.gc).
    #
    # A *file window* ``{"file": absolute path, "offset": n, "size": n}`` (a local store
    # only) keeps an object as a range of a file outside the store: the export stage's
    # weights inside the hf: checkpoint they were loaded from.  The file is not the
    # store's: it is never written, moved or quarantined; a range that no longer hashes to
    # the object's digest (the file rewritten, moved or removed) makes the object missing
    # (its window dropped: the stage that wrote it runs again), never a wrong byte.

    def window_path(self, sha256: str) -> str:
        """Filesystem path of the window of the object named ``sha256``."""
        return f"{self.root}/windows/{sha256[:2]}/{sha256[2:]}"

    def window(self, sha256: str) -> dict | None:
        """The window ``{"object" | "file", "offset", "size"[, "transpose"]}`` the object ``sha256``
        is kept as, or None."""
        try:
            doc = json.loads(self.fs.cat_file(self.window_path(sha256)))
        except (FileNotFoundError, ValueError):
            return None
        return doc if _is_window(doc) else None

    def _window_source(self, doc: dict) -> str:
        """The path of what the window ``doc`` is a range of (an object, or a local file)."""
        return self.object_path(str(doc["object"])) if "object" in doc else str(doc["file"])

    def keep_in_file(self, sha256: str, path: str, offset: int, size: int,
                     transpose: tuple[int, int, int] | None = None) -> bool:
        """Keep the object ``sha256`` as the range ``[offset, offset + size)`` of the local
        file ``path`` (outside the store) if that range hashes to ``sha256`` and the object is
        not stored otherwise; returns whether it is now kept so.  A local store only.
        ``transpose=(rows, cols, itemsize)``: the object is the transpose of the range read as
        a ``rows x cols`` matrix (an exported program's folded ``weight#t`` of a checkpoint's
        ``weight``)."""
        if not self.is_local or self._object_size(sha256) is not None:
            return False
        path = os.path.realpath(path)
        doc = {"file": path, "offset": int(offset), "size": int(size)}
        if transpose is not None:
            doc["transpose"] = [int(n) for n in transpose]
        before = path_stamp(path)
        if before is None or not _is_window(doc) or file_digest(path, doc) != sha256:
            return False
        self._write_atomic(self.window_path(sha256), json.dumps(doc, sort_keys=True).encode())
        stamp = self._file_stamp(sha256)
        if stamp is not None and {k: stamp[k] for k in before} == before:  # unchanged while it was hashed
            self._record_check(sha256, stamp)
        else:
            self._forget_check(sha256)
        return True

    def _window_holds(self, sha256: str) -> bool:
        """Whether the window ``sha256`` still holds its bytes: always for a window of an
        object (the store's own, digest-checked when read); for a file window, the file
        checked unchanged since, or its range hashing to ``sha256`` (else the window is dropped)."""
        doc = self.window(sha256)
        if doc is None or "object" in doc:
            return doc is not None
        try:
            self._check_object(sha256, "object")
        except StoreError:
            return False
        return True

    def keep_as_windows(self, container: ArtifactRef, windows: Iterable[tuple[int, int]], data: bytes) -> int:
        """Each stored object whose bytes are ``data[offset:offset + size]`` (``data``: the
        bytes of ``container``, a stored object) becomes a window of ``container``: its own
        file is removed once the window is written (readers then read the range).  An
        object kept as a window of another object is pointed at ``container`` instead, so
        the newest program holds the blobs it shares with older ones.  Returns the bytes freed.
        ``data`` must be what ``container`` names (the caller hashed it: :meth:`put_bytes`):
        a window of a container checked and unchanged since is recorded checked too."""
        if self._size(self.object_path(container.sha256)) != container.size:
            return 0
        trusted = self.checked(container.sha256)
        view, freed = memoryview(data), 0
        for offset, size in windows:
            digest = sha256_hex(view[offset:offset + size])
            if digest == container.sha256:
                continue
            path = self.object_path(digest)
            held = self._size(path)
            if held is None and self._window_size(digest) != size:
                continue  # not stored: nothing to keep once
            doc = {"object": container.sha256, "offset": offset, "size": size}
            self._write_atomic(self.window_path(digest), json.dumps(doc, sort_keys=True).encode())
            if held is not None:
                try:
                    self.fs.rm_file(path)
                    freed += held
                except FileNotFoundError:
                    pass
            if trusted:
                self._record_check(digest, self._file_stamp(digest))
            else:
                self._forget_check(digest)
        return freed

    def _window_size(self, sha256: str) -> int | None:
        """The size of the window ``sha256`` when what it is a window of is there."""
        doc = self.window(sha256)
        if doc is None:
            return None
        held = self._size(self._window_source(doc))
        if held is None or int(doc["offset"]) + int(doc["size"]) > held:
            return None
        return int(doc["size"])

    def _object_size(self, sha256: str) -> int | None:
        size = self._size(self.object_path(sha256))
        return size if size is not None else self._window_size(sha256)

    def _read_window(self, sha256: str, what: str) -> bytes | None:
        """The bytes of the window ``sha256``, digest-checked; None when it is not a window.
        A file window that is gone or no longer holds the bytes is dropped: ArtifactMissing."""
        doc = self.window(sha256)
        if doc is None:
            return None
        start, source = int(doc["offset"]), self._window_source(doc)
        of = f"object {doc['object']}" if "object" in doc else f"file {source}"
        try:
            data = transposed(self.fs.cat_file(source, start=start, end=start + int(doc["size"])), doc)
        except FileNotFoundError:
            data = None
        if data is not None and sha256_hex(data) == sha256:
            return data
        if "file" in doc:  # not the store's file: what it holds now is not this object
            self._forget_check(sha256)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.window_path(sha256))
        if data is None or "file" in doc:
            changed = "which is gone" if data is None else "which no longer holds its bytes"
            raise ArtifactMissing(f"{what} {sha256} is missing from store {self.url} (a window of {of}, {changed})")
        raise ArtifactCorrupt(f"{what} {sha256} in store {self.url} is corrupt: its window of {of} "
                              f"hashes to {sha256_hex(data)}")

    def _release_windows(self, container: str, path: str) -> None:
        """Every window of the object ``container`` (its file at ``path``) whose range still
        hashes to its digest becomes a whole object again: a corrupt program must not take
        the weights of earlier stages with it."""
        for window_path in self._window_files():
            digest = "".join(window_path.rsplit("/", 2)[-2:])
            doc = self.window(digest)
            if doc is None or doc.get("object") != container:
                continue
            start = int(doc["offset"])
            try:
                data = self.fs.cat_file(path, start=start, end=start + int(doc["size"]))
            except FileNotFoundError:
                return
            if sha256_hex(data) == digest:
                self._write_atomic(self.object_path(digest), data)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(window_path)

    def _window_files(self) -> list[str]:
        try:
            return [p for p in self.fs.find(f"{self.root}/windows") if ".tmp-" not in p]
        except FileNotFoundError:
            return []

    def _touch(self, path: str) -> None:
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)

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
            data = read_into_buffer(path) if writable and self.is_local else self.fs.cat_file(path)
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

    def _write_atomic(self, path: str, data: bytes | memoryview | list[memoryview]) -> None:
        """Write ``data`` (or its parts, in order) at ``path``: a reader sees all of it or none."""
        parent = posixpath.dirname(path)
        if not self.is_local:
            data = b"".join(data) if isinstance(data, list) else bytes(data)  # fsspec's remote filesystems take bytes
        if self._atomic_put:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        if self.is_local:
            with open(tmp, "wb") as f:
                f.writelines(data if isinstance(data, list) else [data])
            os.replace(tmp, path)
        else:  # e.g. sftp: rename is atomic there too
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)

    def _quarantine(self, path: str, sha256: str) -> None:
        """Move a bad object aside so that the next put of its bytes rewrites it (the objects
        kept as windows of it and still intact first get their own files back)."""
        self._release_windows(sha256, path)
        self._forget_check(sha256)
        target = f"{self.root}/quarantine/{sha256}.{time.time_ns()}"
        try:
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.mv(path, target)
        except FileNotFoundError:
            pass  # already moved or removed by someone else






def _server_side_copy(fs) -> bool:
    """Whether ``fs`` copies an object without the bytes passing through this process."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & {"s3", "s3a", "gs", "gcs", "abfs", "az"})


def byte_view(data: Any) -> memoryview:
    """``data`` (bytes, bytearray, memoryview, numpy array ...) as a flat memoryview of bytes, no copy."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_window(doc: Any) -> bool:
    """Whether ``doc`` is a window: ``offset``, ``size`` and one of ``object`` / ``file``; a
    ``transpose`` ``[rows, cols, itemsize]`` of that size (a file window's)."""
    if not isinstance(doc, dict) or not {"offset", "size"} <= set(doc) or len({"object", "file"} & set(doc)) != 1:
        return False
    shape = doc.get("transpose")
    return shape is None or (isinstance(shape, list) and len(shape) == 3 and all(type(n) is int and n > 0 for n in shape)
                             and shape[0] * shape[1] * shape[2] == doc["size"])










def _check_name(name: str) -> str:
    """A named output must be a relative POSIX path without '.' or '..' parts."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"output name {name!r} must be a relative path like 'model/target.pte'")
    return name
