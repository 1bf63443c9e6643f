"""Local files of an artifact store (:mod:`tasks.store`): their digests (of a range, transposed),
stamps, identity, and the attribute that names the object a file holds."""

from __future__ import annotations

import contextlib
import hashlib
import os

#: The extended attribute of a local object's file naming the object (set when the store writes
#: it).  Every hard link to the file shares it: replacing or removing a link (a published output,
#: an ``-o`` file) moves the object's ctime, and the attribute says which object's check to keep.
OBJECT_XATTR = "user.lowerflow.object"


def name_file(path: str, digest: str) -> None:
    """Set the :data:`OBJECT_XATTR` of the local object file ``path`` (where the filesystem keeps
    user attributes; elsewhere a replaced link costs its object one more hash)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setxattr(path, OBJECT_XATTR, digest.encode())


def same_file(a: str, b: str) -> bool:
    """Whether two local paths are one file (a published output linked to its object)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def transposed(data: bytes, window: dict | None) -> bytes | bytearray:
    """``data`` (a window's range), transposed as its window's ``transpose`` says (else as it is)."""
    shape = (window or {}).get("transpose")
    if not shape:
        return data
    import numpy as np

    rows, cols, itemsize = shape
    dtype = np.dtype({1: "u1", 2: "u2", 4: "u4", 8: "u8"}.get(itemsize, f"V{itemsize}"))
    out = bytearray(len(data))
    np.copyto(np.frombuffer(out, dtype).reshape(cols, rows), np.frombuffer(data, dtype).reshape(rows, cols).T)
    return out


def path_stamp(path: str) -> dict | None:
    """A local file's size, mtime_ns, ctime_ns, inode and device (as in a check's stamp); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def file_digest(path: str, window: dict | None = None, chunk: int = 16 * 2**20) -> str | None:
    """The sha256 of a local file (of the range ``window`` names, transposed if it says so),
    read in chunks: a big object is hashed without being held; None when it is missing or short."""
    start, size = (int(window["offset"]), int(window["size"])) if window else (0, None)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            f.seek(start)
            if window and window.get("transpose"):  # held once: a transpose reads all of it
                data = f.read(size)
                return hashlib.sha256(transposed(data, window)).hexdigest() if len(data) == size else None
            left = os.fstat(f.fileno()).st_size - start if size is None else size
            while left > 0:
                data = f.read(min(chunk, left))
                if not data:
                    return None
                digest.update(data)
                left -= len(data)
    except OSError:
        return None
    return digest.hexdigest()


def read_into_buffer(path: str) -> bytearray:
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
