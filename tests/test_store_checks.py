"""Issue 27: a local store trusts an object it checked while the file holding it is unchanged.

``ArtifactStore.verify`` (what a cache hit runs) hashes the objects it names unless
``checked/ab/cdef...`` records the stamp (path, size, mtime_ns, ctime_ns, inode, device,
window) the file had when its bytes last hashed to the name (or were written by the
store).  A cached rerun then stats its objects instead of reading them; any change made
through the filesystem still makes the check hash, and a corrupt object is caught and
quarantined as before (tasks/store.py, "Checked objects").  Bytes read are counted with
``/proc/self/io`` (``rchar``: every byte this process read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.store import OBJECT_XATTR, REHASH_ENV, ArtifactCorrupt, ArtifactMissing, ArtifactStore

SIZE = 4 * 2**20


def bytes_read() -> int:
    """Bytes this process has read so far (any file, any call)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def verify_reads(store: ArtifactStore, ref) -> int:
    """Bytes read by ``store.verify(ref)``."""
    before = bytes_read()
    store.verify(ref)
    return bytes_read() - before


@pytest.fixture
def stored(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    data = bytes(range(256)) * (SIZE // 256)
    return store, store.put_bytes(data, "blob"), data


@pytest.fixture
def windowed(tmp_path):
    """(store, blob ref, program ref): a program holding the blob at offset 4, the blob kept as its window."""
    store = ArtifactStore(str(tmp_path / "store"))
    blob = os.urandom(SIZE)
    ref = store.put_bytes(blob, "blob")
    container = b"head" + blob + b"tail"
    program = store.put_bytes(container, "pte")
    assert store.keep_as_windows(program, [(4, SIZE)], container) == SIZE
    return store, ref, program


def _overwrite_keeping_times(path: str, offset: int, data: bytes) -> None:
    """Change bytes in place, then put the file's atime and mtime back to the nanosecond."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_an_object_the_store_wrote_or_hashed_is_not_read_again_while_its_file_is_unchanged(stored, monkeypatch):
    store, ref, _ = stored
    assert store.checked(ref.sha256)  # written by the store: its bytes were hashed then
    assert verify_reads(store, ref) < 4096  # the record, not the 4 MiB object
    os.utime(store.object_path(ref.sha256))  # touched: hashed once more, then trusted again
    assert not store.checked(ref.sha256)
    assert verify_reads(store, ref) >= SIZE
    assert store.checked(ref.sha256) and verify_reads(store, ref) < 4096
    monkeypatch.setenv(REHASH_ENV, "1")  # the records ignored: every check hashes
    assert not store.checked(ref.sha256) and verify_reads(store, ref) >= SIZE


@pytest.mark.parametrize("change", ["same size, times put back", "truncated", "extended", "replaced",
                                    "record garbled"])
def test_a_changed_object_is_hashed_and_caught(stored, change):
    store, ref, data = stored
    path = store.object_path(ref.sha256)
    if change == "same size, times put back":
        _overwrite_keeping_times(path, SIZE // 2, b"\xff\x00")
    elif change == "truncated":
        os.truncate(path, SIZE - 1)
    elif change == "extended":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif change == "replaced":  # another file renamed over it, with the original's times
        st = os.stat(path)
        with open(path + ".new", "wb") as f:
            f.write(data[:-1] + b"?")
        os.utime(path + ".new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(path + ".new", path)
    else:  # a record that does not parse: not trusted, and the object itself is fine
        with open(store.checked_path(ref.sha256), "wb") as f:
            f.write(b"{not json")
        assert verify_reads(store, ref) >= SIZE and store.checked(ref.sha256)
        return
    assert not store.checked(ref.sha256)
    with pytest.raises(ArtifactCorrupt, match=ref.sha256):
        store.verify(ref)
    assert not os.path.exists(store.checked_path(ref.sha256))  # quarantined with its record
    with pytest.raises(ArtifactMissing):
        store.verify(ref)
    assert store.put_bytes(data, "blob") == ref and store.checked(ref.sha256)  # rewritten, checked


def test_a_published_link_keeps_the_check_and_a_change_through_it_is_caught(stored):
    """``publish_object`` hard-links the output to the object (a link moves the object's
    ctime): the check is kept; bytes changed through the output's path are the object's."""
    store, ref, _ = stored
    published = store.publish_object("m/xnnpack.pte", ref, "pte")
    assert store.checked(ref.sha256) and verify_reads(store, ref) < 4096
    _overwrite_keeping_times(store.named_path("m/xnnpack.pte"), 0, b"\x01")
    with pytest.raises(ArtifactCorrupt):
        store.verify(ref)
    with pytest.raises(ArtifactCorrupt):
        store.get_bytes(published)


def test_a_window_is_checked_by_its_container_and_the_range(windowed):
    """An object kept as a window of a bigger one (keep_as_windows) is trusted while the
    container's file is unchanged; bytes changed in its range are caught."""
    store, ref, program = windowed
    assert not os.path.exists(store.object_path(ref.sha256)) and store.window(ref.sha256)
    assert store.checked(ref.sha256) and verify_reads(store, ref) < 4096
    _overwrite_keeping_times(store.object_path(program.sha256), 4 + SIZE // 3, b"\x00\x00\x00")
    assert not store.checked(ref.sha256)
    with pytest.raises(ArtifactCorrupt, match="window"):
        store.verify(ref)


def test_a_window_stays_checked_while_its_container_is_after_a_link_moves_its_stamp(windowed, tmp_path):
    """A hard link to the container (``lowerflow lower -o``, a published output, then either
    removed) moves its ctime: the container stays checked (the link is the store's) and so do
    its windows, without reading them; once a link goes, the container's stamp is stale and a
    window's check hashes the whole container once (not each window, then the container
    again); a container edited through the link is hashed again and caught."""
    store, ref, program = windowed
    out = tmp_path / "out.pte"
    store.copy_out(program, str(out))
    out.unlink()  # moves the container's ctime again, outside the store
    assert store.checked(program.sha256) is False  # its own record is stale: hashed once, then trusted
    assert SIZE <= verify_reads(store, ref) < SIZE + 2 * 4096  # the window's check hashes its container once
    assert store.checked(program.sha256) and store.checked(ref.sha256)
    assert verify_reads(store, ref) < 4096 and verify_reads(store, program) < 4096
    store.copy_out(program, str(out))
    _overwrite_keeping_times(str(out), 4 + SIZE // 2, b"\x00\x00\x00")
    assert not store.checked(ref.sha256)
    with pytest.raises(ArtifactCorrupt, match="window"):
        store.verify(ref)


def test_a_moved_window_record_is_not_trusted(windowed):
    """The record of a window names its range: the same container, another range, is hashed."""
    store, ref, program = windowed
    with open(store.window_path(ref.sha256), "w") as f:  # one byte later: other bytes
        json.dump({"object": program.sha256, "offset": 5, "size": SIZE}, f, sort_keys=True)
    assert not store.checked(ref.sha256)
    with pytest.raises(ArtifactCorrupt):
        store.verify(ref)


def test_other_stores_always_hash(tmp_path):
    store = ArtifactStore("memory://lowerflow-checks")
    ref = store.put_bytes(b"x" * 100, "blob")
    assert not store.checked(ref.sha256)
    store.fs.pipe_file(store.object_path(ref.sha256), b"y" * 100)
    with pytest.raises(ArtifactCorrupt):
        store.verify(ref)
    store.fs.rm(store.root, recursive=True)


def test_gc_removes_the_check_records_of_the_objects_it_removes(stored):
    from tasks.gc import collect

    store, ref, _ = stored
    kept = store.put_bytes(b"recent" * 100, "blob")  # new: kept, with its record
    os.utime(store.object_path(ref.sha256), (0, 0))  # old and unused: swept
    report = collect(store, keep_days=1)
    assert report.removed_objects == [ref.sha256]
    assert not os.path.exists(store.checked_path(ref.sha256))
    assert store.checked(kept.sha256)


def test_copy_out_links_the_object_and_leaves_a_file_that_holds_the_bytes_as_it_is(tmp_path):
    """``lowerflow lower -o`` from a local store: the output is a hard link to the object
    (no second copy), checked as the object is; a rerun finds it linked already and touches
    nothing; an output written over in place (it is the object's file) is caught, never handed
    out; a copied file holding the bytes is hashed, not copied again; other bytes are replaced."""
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_bytes(os.urandom(1 << 20), "pte")
    out = tmp_path / "out.pte"
    assert store.copy_out(ref, str(out)) == ref.size and out.read_bytes() == store.get_bytes(ref)
    assert os.path.samefile(out, store.object_path(ref.sha256)) and store.checked(ref.sha256)
    before = os.stat(out)
    assert store.copy_out(ref, str(out)) == ref.size
    assert os.stat(out).st_ino == before.st_ino and os.stat(out).st_ctime_ns == before.st_ctime_ns
    out.write_bytes(bytes(ref.size))  # in place: the object's bytes
    with pytest.raises(ArtifactCorrupt, match=ref.sha256):
        store.copy_out(ref, str(out))
    assert not os.path.exists(store.object_path(ref.sha256))  # quarantined
    ref = store.put_bytes(os.urandom(1 << 20), "pte")
    copied = tmp_path / "copied.pte"
    copied.write_bytes(store.get_bytes(ref))  # e.g. copied by hand: same bytes, its own file
    os.utime(copied, ns=(0, 10**9))
    store.copy_out(ref, str(copied))
    assert not os.path.samefile(copied, store.object_path(ref.sha256))
    assert os.stat(copied).st_mtime_ns == 10**9  # left as it is
    copied.write_bytes(bytes(ref.size))
    store.copy_out(ref, str(copied))
    assert copied.read_bytes() == store.get_bytes(ref) and os.path.samefile(copied, store.object_path(ref.sha256))


def test_an_output_replaced_or_removed_leaves_its_last_object_checked(tmp_path):
    """Tonight's program published over last night's (or an ``-o`` file over last night's, or
    an output removed): the old object's file loses a link, which moves its ctime; the store
    names each object file it writes (OBJECT_XATTR), so it keeps that object checked rather than
    hashing it again at its next check.  An object written in place after that is still caught."""
    store = ArtifactStore(str(tmp_path / "store"))
    nights = [store.put_bytes(os.urandom(SIZE), "ptd") for _ in range(3)]
    if not _has_xattr(store, nights[0]):
        pytest.skip("this filesystem keeps no user extended attributes")
    out = tmp_path / "model.ptd"
    store.publish_object("m/xnnpack.ptd", nights[0])
    store.copy_out(nights[0], str(out))
    store.publish_object("m/xnnpack.ptd", nights[1])  # the published link replaced
    store.copy_out(nights[1], str(out))  # the -o link replaced
    assert os.stat(store.object_path(nights[0].sha256)).st_nlink == 1
    assert store.checked(nights[0].sha256) and verify_reads(store, nights[0]) < 4096
    assert store.remove_named("m/xnnpack.ptd")
    assert store.checked(nights[1].sha256) and verify_reads(store, nights[1]) < 4096
    _overwrite_keeping_times(store.object_path(nights[0].sha256), 0, b"x")
    with pytest.raises(ArtifactCorrupt):
        store.verify(nights[0])
    store.copy_out(nights[2], str(out))  # the -o link to night 1 replaced too
    assert store.checked(nights[1].sha256) and store.checked(nights[2].sha256)


def _has_xattr(store, ref) -> bool:
    try:
        return bool(os.getxattr(store.object_path(ref.sha256), OBJECT_XATTR))
    except OSError:
        return False


def test_copy_out_to_another_filesystem_copies(tmp_path):
    """Where a hard link cannot be made (/dev/shm is another filesystem), the bytes are copied."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem here")
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_bytes(os.urandom(1 << 16), "pte")
    out = shm / f"lowerflow-copy-out-{os.getpid()}.pte"
    try:
        assert store.copy_out(ref, str(out)) == ref.size and out.read_bytes() == store.get_bytes(ref)
        assert not os.path.samefile(out, store.object_path(ref.sha256))
        assert not list(shm.glob(f"{out.name}.tmp-*"))
    finally:
        out.unlink(missing_ok=True)