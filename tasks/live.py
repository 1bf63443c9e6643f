"""Objects a process stored, kept live by artifact sha256 (the stages' in-process cache).

Inside one process the objects a stage stored are kept live (:data:`LIVE`), so the
next stage does not read back what was just written; a stage reads the store
only when its input came from a cache hit or another process.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .heap import return_freed

if TYPE_CHECKING:
    from .store import ArtifactRef, ArtifactStore


class LiveObjects:
    """Objects this process stored, by artifact sha256, least recently used out.

    Bounded by count and by the bytes of the distinct tensor storages (and byte
    strings) the objects hold: a weight shared by several objects (the exported
    program, the tagged program, the partitions' programs, the named data viewing
    it) counts once, since evicting one of them frees none of it.  The bounds must
    hold a whole model's working set — its programs and every partition's program,
    63 for MobileNetV2 on the reference backend — or the stages re-read their inputs
    from the store: the flow stays correct, but slower, and a program read back while
    its live twin is still referenced elsewhere (by the model, by another program) is
    a second copy of its weights (64 entries made MobileNetV2's adjust re-read every
    partition, 7 s of 11; a 2 GiB bound made Qwen2.5-0.5B's stages hold several copies).

    An object kept here must be what reading its digest back from the store
    gives (see :func:`put_program`); stages must not modify the objects they get.
    """

    def __init__(self, capacity: int = 1024, max_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._items: collections.OrderedDict[str, tuple[Any, dict[int, int]]] = collections.OrderedDict()
        self._holders: collections.Counter[int] = collections.Counter()  # storage -> items holding it
        self._bytes = 0  # of the distinct storages held
        self._lock = threading.Lock()

    def put(self, ref: ArtifactRef, obj: Any) -> None:
        storages = _held_storages(obj)
        with self._lock:
            if ref.sha256 in self._items:
                self._forget(self._items.pop(ref.sha256)[1])
            self._items[ref.sha256] = (obj, storages)
            for key, size in storages.items():
                self._holders[key] += 1
                self._bytes += size if self._holders[key] == 1 else 0
            while self._items and (len(self._items) > self.capacity or self._bytes > self.max_bytes):
                self._forget(self._items.popitem(last=False)[1][1])

    def _forget(self, storages: dict[int, int]) -> None:
        for key, size in storages.items():
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                self._bytes -= size

    def get(self, ref: ArtifactRef, load: Callable[[], Any]) -> Any:
        with self._lock:
            if ref.sha256 in self._items:
                self._items.move_to_end(ref.sha256)
                return self._items[ref.sha256][0]
        obj = load()
        self.put(ref, obj)
        return obj

    def peek(self, ref: ArtifactRef) -> Any:
        """The object of ``ref`` if it is kept, else None (nothing is read)."""
        with self._lock:
            item = self._items.get(ref.sha256)
            return None if item is None else item[0]

    @property
    def held_bytes(self) -> int:
        """Bytes of the distinct storages the kept objects hold."""
        return self._bytes

    def drop(self, ref: ArtifactRef) -> None:
        """Stop keeping the object of ``ref`` (a later get reads it back from the store)."""
        self.pop(ref)

    def pop(self, ref: ArtifactRef) -> Any:
        """The object of ``ref``, no longer kept (None when it is not here): the caller's
        reference is then the only one this cache leaves."""
        with self._lock:
            if ref.sha256 not in self._items:
                return None
            obj, storages = self._items.pop(ref.sha256)
            self._forget(storages)
            return obj

    def clear(self, keep: ArtifactRef | None = None) -> None:
        """Keep nothing (but ``keep``'s object, when given and here)."""
        with self._lock:
            kept = self._items.get(keep.sha256) if keep is not None else None
            self._items.clear()
            self._holders.clear()
            self._bytes = 0
        if kept is not None:
            self.put(keep, kept[0])

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within: nothing is kept and every input is read back from the store.

        For tests: a stage must give the same result whether its input is the
        live object or what the store returns, and this is the store's side.
        """
        with self._lock:
            capacity, self.capacity = self.capacity, 0
            self._items.clear()
            self._holders.clear()
            self._bytes = 0
        try:
            yield
        finally:
            with self._lock:
                self.capacity = capacity


def default_max_bytes() -> int:
    """Half the machine's physical memory, at least 2 GiB: room for the working set of the
    largest model that fits the machine at all (its weights are held once, whatever
    number of stage objects share them)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 0
    return max(2 << 30, physical // 2)


def _held_storages(obj: Any) -> dict[int, int]:
    """``{storage: bytes}`` of what ``obj`` keeps alive: tensor storages of a program (and of
    its lowered modules' programs) by data pointer, byte strings, payloads and named data by id."""
    if isinstance(obj, memoryview):
        return {}  # a view of a weight (named data): its tensor's program counts it
    if isinstance(obj, (bytes, bytearray)):
        return {id(obj): len(obj)}
    if not isinstance(obj, torch.export.ExportedProgram):
        return {}  # JSON documents, memory plans: small
    storages: dict[int, int] = {}
    programs = [obj]
    while programs:
        program = programs.pop()
        for value in (*program.state_dict.values(), *program.constants.values()):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        for module in program.graph_module.modules():
            original = getattr(module, "original_module", None)
            if isinstance(original, torch.export.ExportedProgram):
                programs.append(original)
                processed = getattr(module, "processed_bytes", b"")
                storages[id(processed)] = len(processed)
                for blob in (getattr(module, "named_data", None) or {}).values():
                    storages.update(_held_storages(blob))
    return storages


LIVE = LiveObjects()


#: Bytes of weights the live objects must hold for :func:`release_live` to collect them at
#: once.  Below it (a small program's) the next automatic collection frees them: a full
#: collection of a process that imported torch, transformers and Prefect walks ~700k objects,
#: ~0.5 s of CPU for each verify stage (13 of them: 6.6 of tests/test_quantize_flow.py's 82 CPU-s).
RELEASE_COLLECT_BYTES = 64 << 20


def release_live(keep: ArtifactRef | None = None) -> None:
    """Let go of the stage objects this process kept live (:data:`LIVE`) before verify, which
    reads only the ``.pte`` and the eager model: the programs' weights that nothing else
    holds are freed while verify runs two runtimes (collected now, when they held at least
    :data:`RELEASE_COLLECT_BYTES`: a program's graph is a cycle of objects; and given back to
    the system: :mod:`tasks.heap`).  A later stage (another target) reads what it needs back
    from the store.  ``keep``: a program verify reads next (a quantized reference:
    :func:`take_program`), kept rather than read back."""
    held = LIVE.held_bytes
    LIVE.clear(keep)
    if held >= RELEASE_COLLECT_BYTES:
        gc.collect()
        return_freed()


def take_program(store: ArtifactStore, ref: ArtifactRef) -> torch.export.ExportedProgram:
    """The program of ``ref`` taken out of :data:`LIVE` (this process stored it: no second
    deserialization, ~10 CPU-s for SmolLM2-135M 8da4w's), else read from the store; either
    way the caller holds the only reference, so the program goes when the caller drops it."""
    taken = LIVE.pop(ref)
    return taken if taken is not None else store.get_program(ref)
