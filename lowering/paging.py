"""Dropping the resident pages of weights mapped from a checkpoint file while they are not read.

An ``hf:`` model's weights are views of its safetensors file, mapped into memory: a page
becomes resident (and counts in the process's RSS) once read, and stays so while the
mapping lives.  Export reads every weight (its constant folding), verify reads them again
(eager's outputs); between those, and while verify's ExecuTorch interpreter runs in
another process, nothing does.  :func:`page_out` asks the kernel to reclaim such pages
(``madvise(MADV_PAGEOUT)``, Linux >= 5.4): a page of the file not written since it was
mapped is dropped and read again from the file (or the page cache) if used, a page
written since (private to the process) is never discarded; data is never lost.  Only
storages inside a file-backed mapping are advised: weights in anonymous memory (a
factory's model) are left alone.

Measured, SmolLM2-135M: the 0.54 GB of its weights resident in the lowering process
beside verify's ExecuTorch interpreter (which maps the 0.54 GB ``.pte`` and packs its
weights).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
from typing import Iterable

import torch

#: madvise's advice number (Linux): reclaim these pages.
MADV_PAGEOUT = 21


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    advise = libc.madvise
    advise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advise.restype = ctypes.c_int
    return advise


def file_mappings() -> list[tuple[int, int]]:
    """``[(start, end)]`` of this process's mappings of files (``/proc/self/maps`` entries
    with an inode), sorted; empty where there is no /proc."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    out.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(out)


def page_out(tensors: Iterable[torch.Tensor]) -> int:
    """Reclaim the resident pages of the storages of ``tensors`` that lie in a file mapping
    (whole pages inside each storage); returns the bytes advised (0 where nothing is
    mapped from a file, or the system cannot)."""
    advise = _madvise()
    mappings = file_mappings()
    if advise is None or not mappings:
        return 0
    starts = [start for start, _ in mappings]
    page, advised, seen = mmap.PAGESIZE, 0, set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not ptr or ptr in seen:
            continue
        seen.add(ptr)
        at = bisect.bisect_right(starts, ptr) - 1
        if at < 0 or ptr + size > mappings[at][1]:
            continue  # not (wholly) in a file mapping
        first, last = -(-ptr // page) * page, (ptr + size) // page * page
        if last > first and advise(first, last - first, MADV_PAGEOUT) == 0:
            advised += last - first
    return advised


def page_out_module(module: torch.nn.Module) -> int:
    """:func:`page_out` of a module's parameters and buffers."""
    return page_out([*module.parameters(), *module.buffers()])
