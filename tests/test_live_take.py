"""Issue 27: verify takes a quantized reference this process stored out of the live objects
(:func:`tasks.live.take_program`) instead of deserializing it again, and leaves the cache
holding nothing of it; a reference not live is read from the store; ``release_live(keep=)``
keeps that one program only."""

from __future__ import annotations

import torch
from torch import nn

from lowering import export
from lowering.partition import graph_fingerprint
from tasks.artifacts import put_program
from tasks.live import LIVE
from tasks.live import release_live, take_program
from tasks.store import ArtifactStore


def programs():
    torch.manual_seed(0)
    return [export(nn.Sequential(nn.Linear(8, width), nn.ReLU()).eval(), (torch.randn(2, 8),)) for width in (4, 6)]


def test_a_live_program_is_taken_not_read_and_a_missing_one_is_read(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    first, second = programs()
    refs = [put_program(store, first), put_program(store, second)]
    release_live(keep=refs[0])
    taken = take_program(store, refs[0])
    assert taken is first  # the live object itself: no second deserialization
    assert LIVE.pop(refs[0]) is None and LIVE.pop(refs[1]) is None  # nothing of either kept
    read = take_program(store, refs[1])  # not live: read back from the store
    assert read is not second and graph_fingerprint(read.graph) == graph_fingerprint(second.graph)
    release_live()
