"""Issue 29's weights-only path through the flow (flows/weights_only.py): with external weights,
a retrain (same code, new weights) hits every graph stage, keyed on the model's structure, and
runs only ``bind_weights`` (keyed on the weights' bytes), verify and publish.  The published
``.pte`` is last night's, byte for byte; the ``.ptd`` is a cold lowering's of the new weights,
byte for byte; verify ran the new pair on both runtimes.  ``int8`` static and a program the
weights cannot be bound to (control flow) are lowered fully and say why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.lower_fleet import lower_fleet
from flows.weights_only import STATIC_INT8
from lowering import lower
from lowering.targets import partitioner_for
from tests._lowering import executions_during

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("fresh_stages")

#: A factory whose weights come from seed.txt beside it (the retrain), its inputs from seed 0.
FACTORIES = '''
import pathlib
import torch
from examples import models


def _weights(cls, *args):
    torch.manual_seed(int((pathlib.Path(__file__).parent / "seed.txt").read_text()))
    m = cls(*args).eval()
    for name, b in m.named_buffers():
        if name.endswith("running_var"):
            b.uniform_(0.5, 1.5)
        elif name.endswith("running_mean"):
            b.uniform_(-0.5, 0.5)
    torch.manual_seed(0)
    return m


def mlp():
    return _weights(models.MLP), (torch.randn(4, 64),)


def cnn():
    return _weights(models.CNN), (torch.randn(1, 3, 32, 32),)


def cond():
    return _weights(models.CondLinear), (torch.rand(4, 16) + 0.1,)


class _Shifted(torch.nn.Module):
    """A linear and an int64 buffer a retrain changes (not perturbed by the .ptd recipes' check)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.register_buffer("shift", torch.randint(0, 1000, (8,)))

    def forward(self, x):
        return self.fc(x) + self.shift


def shifted():
    return _weights(_Shifted), (torch.randn(4, 16),)


class _Tied(torch.nn.Module):
    """An embedding and a head that share one weight (a tied LM head): on xnnpack the head's
    delegate gets a copy of it (lowering.partition.duplicate_shared_constants)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.emb(ids)))


def tied():
    return _weights(_Tied), (torch.randint(0, 32, (2, 5)),)


def two_methods():
    model = _weights(models.CNN)
    return {"small": (model, (torch.randn(1, 3, 32, 32),)), "again": (model, (torch.randn(1, 3, 32, 32),))}
'''


def retrain_fleet(tmp_path: Path, factory: str, targets, **entry) -> dict:
    (tmp_path / "retrained.py").write_text(FACTORIES)
    (tmp_path / "seed.txt").write_text("1")
    return {"store": str(tmp_path / "store"), "defaults": {"targets": list(targets)},
            "models": [{"name": "m", "model": f"{tmp_path / 'retrained.py'}:{factory}", "external_weights": True,
                        **entry}]}


def cold(tmp_path: Path, factory: str, target: str, quantize=None):
    """The library's cold lowering of tonight's weights."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("retrained_now", tmp_path / "retrained.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = getattr(module, factory)()
    if isinstance(made, dict):  # a model of several methods
        return lower(made, partitioner=partitioner_for(target), quantize=quantize, external_weights=True)
    model, inputs = made
    return lower(model, inputs, partitioner=partitioner_for(target), quantize=quantize, external_weights=True)


def published(ref: dict) -> bytes:
    return Path(ref["uri"].removeprefix("file://")).read_bytes()


def two_nights(tmp_path: Path, manifest: dict):
    first = lower_fleet(manifest)["models"]["m"]
    (tmp_path / "seed.txt").write_text("2")
    summary, ran = executions_during(lower_fleet, manifest)
    return first, summary["models"]["m"], ran


@pytest.mark.parametrize("factory, targets, recipe", [
    ("cnn", ("portable", "xnnpack"), None),  # conv + BatchNorm, fp32
    ("mlp", ("xnnpack",), "8da4w"),
])
def test_a_retrain_runs_only_bind_weights(tmp_path, factory, targets, recipe):
    manifest = retrain_fleet(tmp_path, factory, targets, **({"quantize": recipe} if recipe else {}))
    first, second, ran = two_nights(tmp_path, manifest)
    # the graph stages all hit (keyed on the structure); the weights are bound, verified, published
    assert dict(ran) == {"bind_weights": len(targets), "verify": len(targets)}, dict(ran)
    assert second["changed"] == ["weights"]
    for target in targets:
        entry, before = second["targets"][target], first["targets"][target]
        assert entry["ok"], entry["error"]
        assert before["weights_only"] == {"bind_weights": "as exported"}
        # a recipe: only the weights quantized again (the quantize stage's recorded recipes), no graph pass;
        # the .ptd written from emit's recipes (lowering/ptd_recipes.py), verify's reference from the tables
        assert entry["weights_only"] == {"bind_weights": "rebound", **({"quantized": "weights"} if recipe else {}),
                                         "ptd": "replayed"}
        assert entry["pte"]["sha256"] == before["pte"]["sha256"]  # last night's program, byte for byte
        library = cold(tmp_path, factory, target, recipe)
        assert published(entry["pte"]) == library.pte
        assert published(entry["ptd"]) == library.ptd  # a cold lowering's .ptd of tonight's weights
        assert entry["ptd"]["sha256"] != before["ptd"]["sha256"]
        assert entry["update"]["program"] == "unchanged"
        runtimes = {c["runtime"] for c in entry["verify"]["checks"] if c["ok"]}
        assert runtimes == {"lowerflow", "executorch"}, entry["verify"]


def retrain_in_a_new_process(tmp_path, monkeypatch, fresh_stages, manifest):
    """Night 1, then night 2 on new weights with nothing live (a new night's process), counting
    the programs whose graph night 2 reads back: (night 1's model summary, night 2's summary,
    the stages it ran, the refs read)."""
    from tasks.store import ArtifactStore

    first = lower_fleet(manifest)["models"]["m"]
    fresh_stages.LIVE.clear()
    (tmp_path / "seed.txt").write_text("2")
    graphs, read = [], ArtifactStore.get_program
    monkeypatch.setattr(ArtifactStore, "get_program", lambda store, ref: graphs.append(ref) or read(store, ref))
    summary, ran = executions_during(lower_fleet, manifest)
    return first, summary, ran, graphs


@pytest.mark.parametrize("factory, targets, recipe", [("cnn", ("portable", "xnnpack"), None),
                                                      ("mlp", ("xnnpack",), "8da4w"),
                                                      ("two_methods", ("xnnpack",), "8da4w")])
def test_a_retrain_in_a_new_process_binds_from_the_stored_tables(tmp_path, monkeypatch, fresh_stages, factory,
                                                                 targets, recipe):
    """Verify off, nothing live (what a new night's process has): bind_weights reads no graph, only
    the tables of the exported and quantized programs (lowering.rebind.stored_bindings: reading a
    graph back is most of a read), and writes the .ptd from the recipes emit recorded
    (lowering/ptd_recipes.py): no preprocess, no emit; same bytes as a cold lowering."""
    manifest = retrain_fleet(tmp_path, factory, targets, verify=False, **({"quantize": recipe} if recipe else {}))
    first, summary, ran, graphs = retrain_in_a_new_process(tmp_path, monkeypatch, fresh_stages, manifest)
    methods = 2 if factory == "two_methods" else 1
    assert dict(ran) == {"bind_weights" if methods == 1 else "bind_weights_methods": len(targets)}, dict(ran)
    assert graphs == []  # no program's graph read back
    for target in targets:
        entry, before = summary["models"]["m"]["targets"][target], first["targets"][target]
        assert entry["weights_only"] == {"bind_weights": "rebound", **({"quantized": "weights"} if recipe else {}),
                                         "ptd": "replayed"}
        assert entry["pte"]["sha256"] == before["pte"]["sha256"]
        library = cold(tmp_path, factory, target, recipe)
        assert published(entry["ptd"]) == library.ptd


@pytest.mark.parametrize("noted", [True, False])
@pytest.mark.parametrize("factory", ["mlp", "two_methods"])
def test_a_quantized_retrain_reads_no_weights_back_where_the_quantize_stage_noted_its_recipes_hold(
        tmp_path, monkeypatch, fresh_stages, factory, noted):
    """8da4w, nothing live: the quantize stage checked, on the live programs, that every quantized
    weight is what its recorded recipe makes of the exported weights (lowering.rebind.quantized_as_recorded)
    and noted it in the store (tasks.bind.note_as_recorded): a retrain's bind reads neither
    program's weights back.  Without the note (an older store) it reads and compares them.  Either
    way the .ptd is a cold lowering's of tonight's weights."""
    from tasks.store import ArtifactStore

    manifest = retrain_fleet(tmp_path, factory, ("xnnpack",), verify=False, quantize="8da4w")
    first = lower_fleet(manifest)["models"]["m"]
    notes = sorted((tmp_path / "store" / "memo").glob("as-recorded-*.json"))
    assert len(notes) == (2 if factory == "two_methods" else 1)
    if not noted:
        for note in notes:
            note.unlink()
    fresh_stages.LIVE.clear()
    (tmp_path / "seed.txt").write_text("2")
    read, original = [], ArtifactStore.read_object_buffer
    monkeypatch.setattr(ArtifactStore, "read_object_buffer",
                        lambda store, digest, **kw: read.append(len(data := original(store, digest, **kw))) or data)
    summary, ran = executions_during(lower_fleet, manifest)
    entry = summary["models"]["m"]["targets"]["xnnpack"]
    assert dict(ran) == {"bind_weights" if factory == "mlp" else "bind_weights_methods": 1}, dict(ran)
    assert entry["weights_only"] == {"bind_weights": "rebound", "quantized": "weights", "ptd": "replayed"}
    weights = first["targets"]["xnnpack"]["quantize"]["weight_bytes"]["fp32"]
    assert (sum(read) == 0) if noted else (sum(read) >= weights), (sum(read), weights)
    assert published(entry["ptd"]) == cold(tmp_path, factory, "xnnpack", "8da4w").ptd


def test_a_quantized_retrain_with_verify_on_writes_its_reference_from_the_tables(tmp_path, monkeypatch,
                                                                                 fresh_stages):
    """Verify on (the flow's default), 8da4w, nothing live: bind_weights reads no graph; verify's
    quantized reference (last night's quantized program with tonight's weights, written from its
    tables: lowering.serialize.with_new_tables) is a cold lowering's quantized program byte for
    byte, and the only graph night 2 reads is verify's, of it; the pair runs on both runtimes."""
    from tasks.artifacts import put_program
    from tasks.store import ArtifactStore

    manifest = retrain_fleet(tmp_path, "mlp", ("xnnpack",), quantize="8da4w")
    first, summary, ran, graphs = retrain_in_a_new_process(tmp_path, monkeypatch, fresh_stages, manifest)
    entry, before = summary["models"]["m"]["targets"]["xnnpack"], first["targets"]["xnnpack"]
    assert entry["ok"], entry["error"]
    assert dict(ran) == {"bind_weights": 1, "verify": 1}, dict(ran)
    assert entry["weights_only"] == {"bind_weights": "rebound", "quantized": "weights", "ptd": "replayed"}
    library = cold(tmp_path, "mlp", "xnnpack", "8da4w")
    assert entry["pte"]["sha256"] == before["pte"]["sha256"]
    assert published(entry["ptd"]) == library.ptd
    reference = put_program(ArtifactStore(str(tmp_path / "cold")), library.quantized_program)
    assert [ref.sha256 for ref in graphs] == [reference.sha256]  # verify's reference, and nothing else
    assert {c["runtime"] for c in entry["verify"]["checks"] if c["ok"]} == {"lowerflow", "executorch"}


def test_a_weight_two_partitions_share_is_bound_to_each(tmp_path, monkeypatch, fresh_stages):
    """A tied embedding and head (as SmolLM2's): the head's delegate holds a copy of the shared
    weight under another name (``head.weight_dup_…``), which a retrain binds to the new weight too:
    the .ptd from the recipes, a cold lowering's pair, verify on both runtimes."""
    from lowering.pte.flat_tensor import deserialize_ptd

    manifest = retrain_fleet(tmp_path, "tied", ("xnnpack",))
    first, summary, ran, graphs = retrain_in_a_new_process(tmp_path, monkeypatch, fresh_stages, manifest)
    entry, before = summary["models"]["m"]["targets"]["xnnpack"], first["targets"]["xnnpack"]
    assert entry["ok"], entry["error"]
    assert dict(ran) == {"bind_weights": 1, "verify": 1}, dict(ran)
    assert entry["weights_only"] == {"bind_weights": "rebound", "ptd": "replayed"}
    library = cold(tmp_path, "tied", "xnnpack")
    assert any("_dup_" in key for key in deserialize_ptd(library.ptd))  # the delegate's copy of the weight
    assert entry["pte"]["sha256"] == before["pte"]["sha256"]
    assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)
    assert {c["runtime"] for c in entry["verify"]["checks"] if c["ok"]} == {"lowerflow", "executorch"}


def test_what_the_recipes_cannot_replay_is_bound_the_slow_way(tmp_path, monkeypatch, fresh_stages):
    """A retrain that changes a weight the recipes' check pinned (an int64 buffer): bind_weights
    reads the emitted program and binds it again (its .pte emitted again and compared); the pair is
    a cold lowering's, and verify runs it on both runtimes."""
    manifest = retrain_fleet(tmp_path, "shifted", ("portable",))
    first, summary, ran, graphs = retrain_in_a_new_process(tmp_path, monkeypatch, fresh_stages, manifest)
    entry, before = summary["models"]["m"]["targets"]["portable"], first["targets"]["portable"]
    assert entry["ok"], entry["error"]
    assert dict(ran) == {"bind_weights": 1, "verify": 1}, dict(ran)
    assert entry["weights_only"] == {"bind_weights": "rebound", "ptd": "rebound"}
    assert len(graphs) == 1  # the emitted program, read to bind it again
    library = cold(tmp_path, "shifted", "portable")
    assert entry["pte"]["sha256"] == before["pte"]["sha256"]
    assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)
    assert {c["runtime"] for c in entry["verify"]["checks"] if c["ok"]} == {"lowerflow", "executorch"}


def test_int8_static_is_lowered_fully_and_says_why(tmp_path):
    manifest = retrain_fleet(tmp_path, "cnn", ("xnnpack",), quantize="int8",
                             calibration="examples/models.py:cnn_calibration")
    first, second, ran = two_nights(tmp_path, manifest)
    entry = second["targets"]["xnnpack"]
    assert entry["ok"], entry["error"]
    assert entry["weights_only"] == first["targets"]["xnnpack"]["weights_only"] == {"bytes": STATIC_INT8}
    assert ran["export"] == ran["quantize"] == ran["preprocess"] == ran["emit"] == 1 and not ran["bind_weights"]
    assert entry["pte"]["sha256"] != first["targets"]["xnnpack"]["pte"]["sha256"]  # recalibrated: a new program
    from flows.reports import target_section

    assert "lowered fully: recipe int8 (static)" in target_section("xnnpack", entry)


@pytest.mark.parametrize("targets, recipe", [(("portable", "xnnpack"), None), (("xnnpack",), "8da4w")])
def test_a_retrain_of_a_model_of_several_methods_binds_every_method(tmp_path, targets, recipe):
    """Two methods of one CNN: each method's export keyed on its structure, one
    ``bind_weights_methods`` per target over the one program; the .pte is last night's."""
    manifest = retrain_fleet(tmp_path, "two_methods", targets, **({"quantize": recipe} if recipe else {}))
    first, second, ran = two_nights(tmp_path, manifest)
    assert dict(ran) == {"bind_weights_methods": len(targets), "verify": 2 * len(targets)}, dict(ran)
    for target in targets:
        entry, before = second["targets"][target], first["targets"][target]
        assert entry["ok"], entry["error"]
        assert before["weights_only"] == {"bind_weights": "as exported"}
        assert entry["weights_only"] == {"bind_weights": "rebound", **({"quantized": "weights"} if recipe else {}),
                                         "ptd": "replayed"}
        library = cold(tmp_path, "two_methods", target, recipe)
        assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)
        assert entry["pte"]["sha256"] == before["pte"]["sha256"] and entry["ptd"]["sha256"] != before["ptd"]["sha256"]
        for method in ("small", "again"):
            runtimes = {c["runtime"] for c in entry["methods"][method]["verify"]["checks"] if c["ok"]}
            assert runtimes == {"lowerflow", "executorch"}, entry["methods"][method]["verify"]


def test_a_program_the_weights_cannot_be_bound_to_is_lowered_again(tmp_path):
    """Control flow: bind_weights says why, the target is lowered from the bytes-keyed export,
    and what it publishes is a cold lowering's pair."""
    manifest = retrain_fleet(tmp_path, "cond", ("portable",))
    first, second, ran = two_nights(tmp_path, manifest)
    entry = second["targets"]["portable"]
    assert entry["ok"], entry["error"]
    assert "control flow" in entry["weights_only"]["fallback"], entry["weights_only"]
    assert ran["bind_weights"] == 1 and ran["export"] == 1 and ran["emit"] == 1, dict(ran)
    library = cold(tmp_path, "cond", "portable")
    assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)


def test_the_structure_digest_leaves_out_the_weights_bytes_only(tmp_path):
    from tasks.model_spec import ModelSpec, load_model

    (tmp_path / "retrained.py").write_text(FACTORIES)
    digests = []
    for seed in ("1", "2"):
        (tmp_path / "seed.txt").write_text(seed)
        digests.append(load_model(ModelSpec.parse(f"{tmp_path / 'retrained.py'}:mlp"), {}).fingerprint)
    one, two = digests
    assert one.digest != two.digest and one.structure_digest == two.structure_digest
    assert one.structure_digest not in (one.digest, None)
    assert "layout" not in one.to_json()  # the manifest's fingerprint document is as it was
    other = load_model(ModelSpec.parse(f"{tmp_path / 'retrained.py'}:cnn"), {}).fingerprint
    assert other.structure_digest != one.structure_digest


@pytest.mark.parametrize("stage, inputs, expected", [
    ("export", {"model": "m.py:f", "fingerprint": "f" * 64, "options": {"version": None}},
     {"fingerprint": "f" * 64, "options": {"version": None}}),
    ("emit", {"program": "P", "plan": "Q"}, {"program": "P", "plan": "Q"}),
])
def test_without_external_weights_the_keys_are_as_they_were(tmp_path, stage, inputs, expected):
    """The key documents' inputs without the option: no new field (the option is in
    STAGE_OPTIONAL; a key moves only when it is on)."""
    from tasks.cache import CacheConfig
    from tasks.stages import STAGE_IGNORES, STAGE_OPTIONAL, STAGE_VERSIONS, stage_inputs

    policy = CacheConfig.for_store(str(tmp_path)).policy(stage, STAGE_VERSIONS[stage], STAGE_IGNORES[stage],
                                                          STAGE_OPTIONAL.get(stage, ()))
    assert policy.key_document(stage_inputs(stage, inputs))["inputs"] == expected
    on = policy.key_document(stage_inputs(stage, {**inputs, "external_weights": True}))["inputs"]
    assert on == {**expected, "external_weights": True}


def test_a_recipe_quantizes_only_the_weights_and_checks_its_recipes():
    """rebind_weights quantizes a retrain's weights by the recipes the quantize pass recorded
    (no graph pass), giving a cold lowering's bytes; a recipe whose digests do not match what
    the program holds is never used (the pass runs again)."""
    import dataclasses

    from examples.models import MLP
    from lowering.quantize.graph import DERIVED_META
    from lowering.rebind import rebind_weights

    def model(seed):
        torch.manual_seed(seed)
        return MLP().eval()

    x = (torch.randn(4, 64),)
    night1 = lower(model(1), x, partitioner=partitioner_for("xnnpack"), quantize="8da4w", external_weights=True)
    cold2 = lower(model(2), x, partitioner=partitioner_for("xnnpack"), quantize="8da4w", external_weights=True)
    update = rebind_weights(night1, model(2), quantize="8da4w")
    assert "quantize_weights" in update.timings and "quantize_pass" not in update.timings
    assert (update.pte, update.ptd) == (night1.pte, cold2.ptd)
    for name, tensor in cold2.quantized_program.constants.items():  # verify's reference: tonight's
        assert torch.equal(update.quantized_program.constants[name], tensor), name
    tampered = dataclasses.replace(night1, quantized_program=copy_with_meta(night1.quantized_program))
    recipes = tampered.quantized_program.graph_module.meta[DERIVED_META]
    first = sorted(recipes)[0]
    recipes[first] = {**recipes[first], "value": "0" * 64}
    again = rebind_weights(tampered, model(2), quantize="8da4w")
    assert "quantize_pass" in again.timings and again.ptd == cold2.ptd


def copy_with_meta(program):
    from lowering.program import copy_program
    from lowering.quantize.graph import DERIVED_META

    copied = copy_program(program)
    copied.graph_module.meta[DERIVED_META] = dict(program.graph_module.meta[DERIVED_META])
    return copied


def test_a_plan_lists_bind_weights(tmp_path):
    from flows.lower_model import plan_model

    (tmp_path / "retrained.py").write_text(FACTORIES)
    (tmp_path / "seed.txt").write_text("1")
    plan = plan_model(f"{tmp_path / 'retrained.py'}:mlp", ["portable"], str(tmp_path / "store"), external_weights=True)
    assert [r["stage"] for r in plan["targets"]["portable"]["stages"]] == [
        "export", "memory_plan", "emit", "bind_weights", "verify"]


def test_a_plan_lists_bind_weights_only_where_it_runs(tmp_path):
    """A target whose partitioner keeps ops whole (vulkan: its own export, keyed on the weights'
    bytes) does not bind weights: the plan says so before the run, and the run agrees, stage
    for stage (vulkan's two exports, the model's and its own, both listed)."""
    from flows.lower_model import lower_model, plan_model
    from flows.weights_only import KEPT_OPS

    options = dict(external_weights=True, verify=False)
    store = str(tmp_path / "store")
    plan = plan_model("examples/models.py:mlp", ["portable", "vulkan"], store, **options)
    ran = lower_model("examples/models.py:mlp", ["portable", "vulkan"], store, **options)
    for target in ("portable", "vulkan"):
        entry = ran["targets"][target]
        assert entry["ok"], entry["error"]
        planned = [r["stage"] for r in plan["targets"][target]["stages"]]
        assert [r["stage"] for r in entry["stages"]] == planned, (target, planned)
    assert planned_stages(plan, "vulkan").count("export") == 2
    assert "bind_weights" in planned_stages(plan, "portable") and "bind_weights" not in planned_stages(plan, "vulkan")
    assert ran["targets"]["vulkan"]["weights_only"] == {"bytes": KEPT_OPS}


def planned_stages(plan: dict, target: str) -> list[str]:
    return [r["stage"] for r in plan["targets"][target]["stages"]]
