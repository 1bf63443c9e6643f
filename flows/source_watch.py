"""Whether source files changed: :class:`SourceWatch`, the warm parent's staleness check.

The warm parent (:mod:`flows.warm_start`) must never fork a child from stale code:
before each fork it asks a :class:`SourceWatch` of every file its state depends on
whether any changed.  This module owns that answer: the files' (size, mtime) stamps,
and on Linux the inotify watches of their directories that spare stat-ing them all
each time (only on file systems whose every change this kernel sees).
"""

from __future__ import annotations

import os
import sys


def file_stamps(files) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of each file; (-1, -1) for one that is gone."""
    stamps = {}
    for f in files:
        try:
            st = os.stat(f)
            stamps[f] = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamps[f] = (-1, -1)
    return stamps


class SourceWatch:
    """Whether any of ``files`` (and directories) changed since the watch was made:
    (size, mtime) differs, or it appeared or went away.

    Stat-ing every file before each fork (~4,700 for a worker with transformers
    preloaded) cost 20-36 ms of every run's latency and 4% of the flow runs' CPU
    (py-spy, issue 9).  On Linux the watch asks the kernel instead: an inotify watch
    on each directory holding a file reports any write, truncation, touch, rename,
    creation or deletion there, synchronously, so an empty event queue means nothing
    changed.  Only when the queue has events does it stat the files (events for
    other files of those directories, a ``__pycache__`` created, are then found
    harmless and drained).  It stats every time, as before, for files on a file
    system whose changes made elsewhere inotify does not see (NFS, SMB, FUSE; only
    :data:`LOCAL_FILE_SYSTEMS` are watched), everywhere when inotify is missing or out
    of watches, and from the moment a watched directory is itself removed or moved.
    """

    #: File systems whose every change passes through this kernel's inotify.
    LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs",
                                    "f2fs", "squashfs", "bcachefs", "jfs", "reiserfs"})
    _IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x8, 0x40, 0x80
    _IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
    _IN_Q_OVERFLOW, _IN_IGNORED, _IN_NONBLOCK, _IN_CLOEXEC = 0x4000, 0x8000, 0o4000, 0o2000000

    def __init__(self, files) -> None:
        self.stamps = file_stamps(files)
        self.polled = dict(self.stamps)  # the files stat-ed before every fork
        self.fd: int | None = None
        self._changed = False
        self._watch()
        if self.fd is not None:  # a change between the stat-ing and the watches: seen too
            self._changed = file_stamps(self.stamps) != self.stamps

    def changed(self) -> bool:
        """True if a file changed since the watch was made (and from then on)."""
        if not self._changed:
            if self.fd is None or self._drain():
                self._changed = file_stamps(self.stamps) != self.stamps
            else:
                self._changed = bool(self.polled) and file_stamps(self.polled) != self.polled
        return self._changed

    def changed_files(self) -> list[str]:
        """The files whose stamp differs now (what :meth:`changed` saw), for the log."""
        now = file_stamps(self.stamps)
        return [f for f, stamp in self.stamps.items() if now[f] != stamp]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _watch(self) -> None:
        """Watch the directory of each file on a local file system (and each directory
        itself); those files are then no longer stat-ed before each fork."""
        if not sys.platform.startswith("linux"):
            return
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(self._IN_NONBLOCK | self._IN_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = (self._IN_MODIFY | self._IN_ATTRIB | self._IN_CLOSE_WRITE | self._IN_MOVED_FROM | self._IN_MOVED_TO
                | self._IN_CREATE | self._IN_DELETE | self._IN_DELETE_SELF | self._IN_MOVE_SELF)
        mounts = _mount_types()
        directories: dict[str, list[str]] = {}
        for path, stamp in self.stamps.items():
            if stamp == (-1, -1) or os.path.islink(path):
                continue  # gone (it may come back), or a link whose target's directory is elsewhere
            directories.setdefault(path if os.path.isdir(path) else os.path.dirname(path), []).append(path)
        for directory, paths in directories.items():
            if _mount_type(directory, mounts) not in self.LOCAL_FILE_SYSTEMS:
                continue
            if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
                os.close(fd)  # out of watches (fs.inotify.max_user_watches): stat everything
                self.polled = dict(self.stamps)
                return
            for path in paths:
                self.polled.pop(path, None)
        self.fd = fd

    def _drain(self) -> bool:
        """Read every pending event; True if there was one.  A watched directory
        removed or moved, or a lost event, turns the watch off for good."""
        import struct

        seen = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return seen
            if not data:
                return seen
            seen = True
            offset = 0
            while offset + 16 <= len(data):
                _wd, event, _cookie, length = struct.unpack_from("iIII", data, offset)
                offset += 16 + length
                if event & (self._IN_DELETE_SELF | self._IN_MOVE_SELF | self._IN_IGNORED | self._IN_Q_OVERFLOW):
                    self.close()
                    return True


def _mount_types() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts, longest point first."""
    mounts = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                if "-" in fields:
                    point = fields[4].replace("\\040", " ")
                    mounts.append((point, fields[fields.index("-") + 1]))
    except OSError:
        pass
    return sorted(mounts, key=lambda m: -len(m[0]))


def _mount_type(path: str, mounts: list[tuple[str, str]]) -> str | None:
    """The type of the file system ``path`` is on (None if unknown)."""
    real = os.path.realpath(path)
    for point, kind in mounts:
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return kind
    return None
