"""What the stages keep between them in one process (tasks.live), and what verify copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from examples.models import MODELS
from lowering.export import export
from lowering.program import copy_program
from lowering.tensor_blobs import tensor_memory
from lowering.verify import fresh_copy
from tasks.live import LiveObjects
from tasks.store import ArtifactRef


def _ref(n: int) -> ArtifactRef:
    return ArtifactRef(f"memory://live/{n}", f"{n:064x}", 1, "program")


def _weight_bytes(program) -> int:
    tensors = [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_programs_sharing_weights_count_them_once_and_are_let_go_when_cleared():
    model, inputs = MODELS["mlp"]()
    program = export(model, inputs)
    weights = _weight_bytes(program)
    live = LiveObjects(max_bytes=weights)  # room for one copy of the weights, not two
    live.put(_ref(1), program)
    live.put(_ref(2), copy_program(program))  # the tagged / partition programs share the weights
    live.put(_ref(3), tensor_memory(next(iter(program.state_dict.values())).detach()))  # named data: a view
    assert live.held_bytes == weights
    for n in (1, 2, 3):  # nothing was evicted: each is there without reading the store
        live.get(_ref(n), lambda: pytest.fail("evicted"))
    live.put(_ref(4), b"\0" * (weights + 1))  # a byte string of its own, over the bound: everything goes
    assert live.held_bytes == 0
    kept = weakref.ref(program)
    live.put(_ref(1), program)
    del program
    live.clear()
    gc.collect()
    assert kept() is None and live.held_bytes == 0


def test_a_dropped_program_is_let_go_and_read_back_on_the_next_get():
    """The quantize stage drops the fp32 program it read (tasks.stages.run_quantize): its
    weights are freed once nothing else holds them, and a later get loads it again."""
    model, inputs = MODELS["mlp"]()
    program = export(model, inputs)
    live = LiveObjects()
    live.put(_ref(1), program)
    live.put(_ref(2), copy_program(program))
    alive = weakref.ref(program)
    live.drop(_ref(1))
    live.drop(_ref(9))  # not kept: nothing happens
    del program
    gc.collect()
    assert alive() is None
    assert live.held_bytes == _weight_bytes(live.get(_ref(2), lambda: pytest.fail("evicted")))
    assert live.get(_ref(1), lambda: "read back") == "read back"


def test_verify_copies_of_the_eager_model_share_its_weights_not_its_state():
    model = torch.nn.Linear(4, 4)
    model.register_buffer("cache", torch.zeros(4))
    copy = fresh_copy(model)
    assert copy is not model and copy.weight is model.weight and copy.bias is model.bias
    assert copy.cache is not model.cache
    copy.cache.add_(1)
    assert model.cache.sum() == 0
    both = fresh_copy({"prefill": model, "decode": model})  # copied together: still one module
    assert both["prefill"] is both["decode"] and both["prefill"].weight is model.weight
