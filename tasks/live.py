"""Objects a process stored, kept live by artifact sha256 (the stages' in-process cache).

Inside one process the objects a stage stored are kept live (:data:`LIVE`), so the
next stage does not read back what was just written; a stage reads the store
only when its input came from a cache hit or another process.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable

import torch


class LiveObjects:
    """Objects this process stored, by artifact sha256, least recently used out.

    Bounded by count and by the tensor bytes the objects hold (shared tensors are
    counted once per object: an over-estimate).  The bounds must hold a whole
    model's working set — its programs and every partition's program, 63 for
    MobileNetV2 on the reference backend — or the stages re-read their inputs
    from the store (the flow stays correct, only slower: 64 entries made
    MobileNetV2's adjust re-read every partition, 7 s of 11).

    An object kept here must be what reading its digest back from the store
    gives (see :func:`put_program`); stages must not modify the objects they get.
    """

    def __init__(self, capacity: int = 1024, max_bytes: int = 2 << 30) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, ref: ArtifactRef, obj: Any) -> None:
        size = _held_bytes(obj)
        with self._lock:
            if ref.sha256 in self._items:
                self._bytes -= self._items.pop(ref.sha256)[1]
            self._items[ref.sha256] = (obj, size)
            self._bytes += size
            while self._items and (len(self._items) > self.capacity or self._bytes > self.max_bytes):
                self._bytes -= self._items.popitem(last=False)[1][1]

    def get(self, ref: ArtifactRef, load: Callable[[], Any]) -> Any:
        with self._lock:
            if ref.sha256 in self._items:
                self._items.move_to_end(ref.sha256)
                return self._items[ref.sha256][0]
        obj = load()
        self.put(ref, obj)
        return obj

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within: nothing is kept and every input is read back from the store.

        For tests: a stage must give the same result whether its input is the
        live object or what the store returns, and this is the store's side.
        """
        with self._lock:
            capacity, self.capacity = self.capacity, 0
            self._items.clear()
            self._bytes = 0
        try:
            yield
        finally:
            with self._lock:
                self.capacity = capacity


def _held_bytes(obj: Any) -> int:
    """About how many bytes ``obj`` keeps alive: tensor storages of a program (and of
    its lowered modules' programs and payloads), or the length of bytes."""
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if not isinstance(obj, torch.export.ExportedProgram):
        return 0  # JSON documents, memory plans: small
    storages: dict[int, int] = {}
    programs, total = [obj], 0
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
                total += len(getattr(module, "processed_bytes", b""))
    return total + sum(storages.values())


LIVE = LiveObjects()
