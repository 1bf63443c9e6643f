"""The ``.ptd`` recipes (lowering/ptd_recipes.py): recorded and checked when a program is emitted,
they write a retrain's ``.ptd`` from the new weights alone, byte-identical to a cold lowering's;
what they cannot prove is refused (then the flow binds the slow way, tests/test_weights_only_flow.py)."""

from __future__ import annotations

import pytest
import torch

from examples import models
from lowering import lower
from lowering.ptd_recipes import record_recipes, replay, tables_of
from lowering.quantize.graph import DERIVED_META
from lowering.rebind import NotWeightsOnly, emit_bound_ptd, folded_views, stored_bindings
from lowering.targets import partitioner_for


def trained(cls, seed: int):
    torch.manual_seed(seed)
    model = cls().eval()
    for name, buffer in model.named_buffers():  # BatchNorm statistics of a trained model
        if name.endswith("running_var"):
            buffer.uniform_(0.5, 1.5)
        elif name.endswith("running_mean"):
            buffer.uniform_(-0.5, 0.5)
    return model


def record_of(result) -> dict:
    program = result.exported_program
    return record_recipes(lambda b: emit_bound_ptd(program, b, result.memory_plan, result.pte),
                          tables_of(program), result.ptd)


def bindings(result, model, recipe) -> dict:
    """target -> tensor of ``model``'s weights for the program ``result`` lowered (what bind_weights
    computes from the stored tables)."""
    source, quantized = result.source_program, result.quantized_program
    return stored_bindings((source.state_dict, source.constants), folded_views(source), model, quantize=recipe,
                           quantized={**quantized.state_dict, **quantized.constants} if quantized else None,
                           derived=quantized.graph_module.meta.get(DERIVED_META) if quantized else None,
                           mutated=source.graph_signature.buffers_to_mutate.values())


@pytest.mark.parametrize("cls, inputs, target, recipe, kinds", [
    (models.MLP, (torch.randn(4, 64),), "portable", None, {"tensor"}),
    (models.MLP, (torch.randn(4, 64),), "xnnpack", None, {"view"}),
    (models.MLP, (torch.randn(4, 64),), "xnnpack", "8da4w", {"view"}),  # int4 packed, bf16 scales
    (models.CNN, (torch.randn(1, 3, 32, 32),), "portable", None, {"tensor"}),
    (models.CNN, (torch.randn(1, 3, 32, 32),), "xnnpack", None, {"conv_filter", "conv_bias", "view"}),  # BN folded
])
def test_a_retrains_ptd_from_the_recipes_is_a_cold_lowerings(cls, inputs, target, recipe, kinds):
    old, new = trained(cls, 1), trained(cls, 2)

    def cold(model):
        return lower(model, inputs, partitioner=partitioner_for(target), quantize=recipe, external_weights=True)

    night1, night2 = cold(old), cold(new)
    record = record_of(night1)
    assert "unproven" not in record, record
    assert {r["fn"] for r in record["recipes"].values()} == kinds
    assert night2.pte == night1.pte
    assert replay(record, bindings(night1, new, recipe)) == night2.ptd  # no graph read, no preprocess, no emit
    assert replay(record, bindings(night1, old, recipe)) == night1.ptd


def test_a_weight_the_check_did_not_perturb_is_pinned():
    """An int64 buffer is not perturbed by the check: a retrain that changes it is refused."""
    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8)
            self.register_buffer("shift", torch.arange(8))

        def forward(self, x):
            return self.fc(x) + self.shift

    model = Shifted().eval()
    night1 = lower(model, (torch.randn(2, 16),), partitioner=partitioner_for("portable"), external_weights=True)
    record = record_of(night1)
    assert list(record["pinned"]) == ["shift"]
    weights = bindings(night1, model, None)
    replay(record, weights)
    weights["shift"] = weights["shift"].flip(0)
    with pytest.raises(NotWeightsOnly, match="'shift' \\(changed\\)"):
        replay(record, weights)
    weights["shift"] = weights["shift"].flip(0)
    weights["fc.bias"] = torch.zeros(9)
    with pytest.raises(NotWeightsOnly, match="another architecture"):
        replay(record, weights)


def test_what_the_check_cannot_prove_is_refused():
    """A program whose .pte depends on the weights (control flow: not bound at all) records why,
    and its record replays nothing."""
    model = models.CondLinear().eval()
    night1 = lower(model, (torch.rand(4, 16) + 0.1,), partitioner=partitioner_for("portable"), external_weights=True)
    record = record_of(night1)
    assert "control flow" in record["unproven"], record
    with pytest.raises(NotWeightsOnly, match="control flow"):
        replay(record, tables_of(night1.exported_program))


@pytest.mark.parametrize("cls, inputs, target", [
    (models.MLP, (torch.randn(4, 64),), "xnnpack"),
    (models.CNN, (torch.randn(1, 3, 32, 32),), "xnnpack"),  # conv_filter / conv_bias recipes
    (models.CNN, (torch.randn(1, 3, 32, 32),), "portable"),
])
def test_the_check_records_the_same_from_the_entries_the_ptd_was_written_from(cls, inputs, target):
    """Emit checks the recipes against the entries its ``.ptd`` was written from (views of the
    weights, the ``.ptd``'s bytes let go): the same record as from the ``.ptd``'s bytes."""
    from lowering.emit.method import build_pte
    from lowering.pte.flat_tensor import serialize_ptd

    result = lower(trained(cls, 1), inputs, partitioner=partitioner_for(target), external_weights=True)
    entries = build_pte(result.exported_program, result.memory_plan, external_weights=True).external
    assert serialize_ptd(entries) == result.ptd
    program = result.exported_program
    from_entries = record_recipes(lambda b: emit_bound_ptd(program, b, result.memory_plan, result.pte),
                                  tables_of(program), entries)
    assert "unproven" not in from_entries, from_entries
    assert from_entries == record_of(result)


def test_perturbed_weights_are_computed_a_slice_at_a_time_to_the_same_values():
    """The check's perturbation, ``x * 1.5 + 0.25`` in float64, computed in slices (several, and a
    last short one): every value and the layout as computed on the whole tensor; names of one
    tensor (a tied weight) share one perturbed tensor, a copy of equal values gets its own."""
    from lowering.ptd_recipes import PERTURB_SLICE, perturbed_tables

    torch.manual_seed(0)
    weight = torch.randn(3 * PERTURB_SLICE // 64 + 5, 64)
    tables = {"w": weight, "w_dup": weight, "w_copy": weight.clone(), "t": weight.t(),
              "bf16": weight.to(torch.bfloat16), "f16": weight[:100].to(torch.float16),
              "col": torch.randn(1, 7).t(), "i8": torch.randint(-8, 8, (5,), dtype=torch.int8),
              "zeros": torch.zeros(3, dtype=torch.int8), "index": torch.arange(4)}
    changed = perturbed_tables(tables)
    for name, tensor in tables.items():
        if tensor.is_floating_point():
            expected = (tensor.to(torch.float64) * 1.5 + 0.25).to(tensor.dtype)
            assert torch.equal(changed[name], expected) and changed[name].stride() == expected.stride(), name
    assert torch.equal(changed["i8"], -tables["i8"] - 1)
    assert changed["zeros"] is None and changed["index"] is None
    assert changed["w_dup"] is changed["w"] and changed["w_copy"] is not changed["w"]
