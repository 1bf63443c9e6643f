"""Giving freed memory back to the system (glibc's malloc), so a process's peak is what it holds.

A lowering frees big tensors stage after stage (an exported program's folded weights,
a stage's programs once the next stage has its own).  glibc serves an allocation of
more than ``M_MMAP_THRESHOLD`` bytes with its own mapping, returned on free; but the
threshold is dynamic by default: each freed mapped block raises it (up to 32 MiB),
after which blocks of weights' sizes come from the heap and a freed one stays in the
process (measured, SmolLM2-135M: 0.4 GB of an exported program's freed constants
kept, RSS 1.59 GB after ``del`` against 1.10 GB with the threshold fixed).

    set_heap_policy()    the threshold fixed at 256 KiB (a command's process, at start)
    return_freed()       the free memory at the heap's top and in its arenas given back

Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: mallopt's parameter number of the threshold (malloc.h), and the value set: blocks of
#: 256 KiB and more get a mapping of their own (glibc's default starts at 128 KiB).
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 256 * 1024


@functools.lru_cache(maxsize=1)
def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def set_heap_policy() -> bool:
    """Fix malloc's mmap threshold (no dynamic raise): freed weight-sized blocks go back
    to the system.  For a command's own process (the library never calls it).  Returns
    whether it was set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def return_freed() -> None:
    """``malloc_trim(0)``: give the free memory of every arena back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
