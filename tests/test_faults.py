"""The fault suite (in-process cases): every way a fleet member can be wrong.

Each case asserts a clear one-line error naming the model and the cause, the
other fleet members finishing, nothing partial or wrong under ``outputs/``, and
a rerun completing once the fault is gone.  Process-level faults (SIGKILL,
concurrent fleets, the store going away, an unwritable ``-o``) are in
``tests/test_faults_processes.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from flows.lower_fleet import FleetFailed, lower_fleet
from flows.manifest import ManifestError
from lowering import BackendDetails, Partitioner, PartitionResult, lower
from lowering.backends.reference import ReferenceBackend
from lowering.partition import DelegationSpec
from tasks import stages
from tasks.store import ArtifactStore

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"


pytestmark = pytest.mark.usefixtures("fresh_stages")


def run_fleet(store: Path, entries: list[dict], targets=("portable",)) -> dict:
    """lower_fleet on a manifest dict; the summary whether or not a model failed."""
    manifest = {"store": str(store), "defaults": {"targets": list(targets)}, "models": entries}
    try:
        return lower_fleet(manifest)
    except FleetFailed as exc:
        return exc.summary
    finally:
        stages.LIVE.clear()  # a rerun reads what the store has


def error_of(summary: dict, name: str, target: str = "portable") -> str:
    return summary["models"][name]["targets"][target]["error"]


def outputs(store: Path) -> dict[str, bytes]:
    root = store / "outputs"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.pte"))}


def assert_fault(summary: dict, name: str, *phrases: str, target: str = "portable") -> str:
    """The model failed with a one-line error naming it and every phrase; mlp (the
    healthy member) finished; the failed target published nothing."""
    assert summary["failed"] == [name], summary["failed"]
    assert summary["models"]["mlp"]["targets"]["portable"]["ok"]
    error = error_of(summary, name, target)
    assert "\n" not in error and name in error, error
    for phrase in phrases:
        assert phrase in error, error
    store = ArtifactStore(summary["store"])
    assert not store.fs.exists(store.named_path(f"{name}/{target}.pte"))
    return error


def write_model(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("import torch\n\n" + textwrap.dedent(body))
    return str(path)


MLP = {"name": "mlp", "model": f"{MODELS}:mlp"}


# --- the model itself is wrong -------------------------------------------------------------------


def test_unexportable_model_data_dependent_branch(tmp_path):
    model = write_model(tmp_path / "branchy.py", """
        class Branchy(torch.nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x * 2
                return x - 1

        def branchy():
            return Branchy(), (torch.ones(3),)
        """)
    summary = run_fleet(tmp_path / "store", [{"name": "branchy", "model": f"{model}:branchy"}, MLP])
    assert_fault(summary, "branchy", "export:", "data-dependent control flow", "torch.cond")
    write_model(tmp_path / "branchy.py", """
        class Branchy(torch.nn.Module):
            def forward(self, x):
                return torch.where(x.sum() > 0, x * 2, x - 1)

        def branchy():
            return Branchy(), (torch.ones(3),)
        """)
    again = run_fleet(tmp_path / "store", [{"name": "branchy", "model": f"{model}:branchy"}, MLP])
    assert again["ok"] and set(outputs(tmp_path / "store")) == {"branchy/portable.pte", "mlp/portable.pte"}


def test_wrong_example_input_shape_names_the_inputs(tmp_path):
    body = """
        def wrong():
            torch.manual_seed(0)
            return torch.nn.Linear(4, 3), (torch.randn(2, {n}),)
        """
    model = write_model(tmp_path / "wrong.py", body.format(n=5))
    summary = run_fleet(tmp_path / "store", [{"name": "wrong", "model": f"{model}:wrong"}, MLP])
    assert_fault(summary, "wrong", "fails on its example inputs ((2, 5) float32)", "2x5 and 4x3")
    write_model(tmp_path / "wrong.py", body.format(n=4))
    assert run_fleet(tmp_path / "store", [{"name": "wrong", "model": f"{model}:wrong"}, MLP])["ok"]


def test_factory_raising(tmp_path):
    model = write_model(tmp_path / "raising.py", """
        def raising():
            raise FileNotFoundError("checkpoint w.pt is missing")
        """)
    summary = run_fleet(tmp_path / "store", [{"name": "raising", "model": f"{model}:raising"}, MLP])
    assert_fault(summary, "raising", "load:", "factory raised FileNotFoundError: checkpoint w.pt is missing")
    write_model(tmp_path / "raising.py", """
        def raising():
            return torch.nn.ReLU(), (torch.ones(2),)
        """)
    assert run_fleet(tmp_path / "store", [{"name": "raising", "model": f"{model}:raising"}, MLP])["ok"]


def test_corrupt_pt2(tmp_path):
    program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),))
    good = tmp_path / "good.pt2"
    torch.export.save(program, str(good))
    corrupt = tmp_path / "corrupt.pt2"
    corrupt.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    summary = run_fleet(tmp_path / "store", [{"name": "corrupt", "model": str(corrupt)}, MLP])
    assert_fault(summary, "corrupt", "export:", "cannot load .pt2")
    corrupt.write_bytes(good.read_bytes())
    assert run_fleet(tmp_path / "store", [{"name": "corrupt", "model": str(corrupt)}, MLP])["ok"]


# --- the manifest is wrong: rejected before any work -------------------------------------------


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"name": "mlp"}], "models[0] ('mlp')"),
        ([MLP, {"model": f"{MODELS}:cnn", "targets": "nope"}], "target 'nope'"),
        ([MLP, {"model": f"{MODELS}:cnn", "targets": ["portable", "no_such_backend"]}],
         "unknown target 'no_such_backend'"),
        ([MLP, {"model": f"{MODELS}:cnn", "verify": "yes"}], "'verify': 'yes' is not true, false or one of ['full', 'quick', 'off', 'auto']"),
    ],
)
def test_malformed_manifest_or_unknown_backend_is_rejected_before_any_work(tmp_path, entries, message):
    before = stages.EXECUTIONS.copy()
    with pytest.raises(ManifestError) as failure:
        lower_fleet({"store": str(tmp_path / "store"), "models": entries})
    assert message in str(failure.value) and "\n" not in str(failure.value)
    assert stages.EXECUTIONS == before
    assert not (tmp_path / "store" / "outputs").exists()


def test_manifest_that_is_not_yaml(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("models: [ {name: mlp, model: x.py:mlp\n")
    with pytest.raises(ManifestError, match="fleet.yaml"):
        lower_fleet(str(path))


# --- a backend's partitioner is wrong -------------------------------------------------------------


class TagsOutputPartitioner(Partitioner):
    """Tags every op and (wrongly) the output node."""

    def partition(self, program):
        for node in program.graph.nodes:
            if node.op in ("call_function", "output"):
                node.meta["delegation_tag"] = "T0"
        return PartitionResult(program, {"T0": DelegationSpec("TagsOutputBackend")})


class TagsOutputBackend(BackendDetails):
    partitioner = classmethod(lambda cls, **options: TagsOutputPartitioner())
    preprocess = staticmethod(ReferenceBackend.preprocess)


class CyclePartitioner(Partitioner):
    """Tags both adds of ``add -> sin -> add_1`` but not the sin between them: a cycle."""

    def partition(self, program):
        for node in program.graph.nodes:
            if node.op == "call_function" and "add" in node.name:
                node.meta["delegation_tag"] = "T0"
        return PartitionResult(program, {"T0": DelegationSpec("CycleBackend")})


class CycleBackend(BackendDetails):
    partitioner = classmethod(lambda cls, **options: CyclePartitioner())
    preprocess = staticmethod(ReferenceBackend.preprocess)


DIAMOND = """
    class Diamond(torch.nn.Module):
        def forward(self, x):
            a = x + 1
            b = torch.sin(a)
            return b + a

    def diamond():
        return Diamond(), (torch.randn(3),)
    """


@pytest.mark.parametrize(
    "backend, phrases",
    [
        ("TagsOutputBackend", ("partition:", "PartitionError", "tagged the output node")),
        ("CycleBackend", ("create_submodule:", "SubmoduleError", "cycle: add -> sin -> add_1")),
    ],
)
def test_a_wrong_partitioner_fails_its_model_only(tmp_path, backend, phrases):
    model = write_model(tmp_path / "diamond.py", DIAMOND)
    summary = run_fleet(
        tmp_path / "store",
        [{"name": "diamond", "model": f"{model}:diamond", "targets": [backend, "portable"]}, MLP],
    )
    assert summary["failed"] == ["diamond"]
    error = error_of(summary, "diamond", backend)
    assert "\n" not in error and all(p in error for p in phrases), error
    # The model's other target is unaffected, and nothing is published for the failed one.
    assert summary["models"]["diamond"]["targets"]["portable"]["ok"]
    assert set(outputs(tmp_path / "store")) == {"diamond/portable.pte", "mlp/portable.pte"}
    rerun = run_fleet(tmp_path / "store", [{"name": "diamond", "model": f"{model}:diamond", "targets": ["reference"]}])
    assert rerun["ok"]


# --- the store is damaged between runs ------------------------------------------------------------


def test_a_stored_object_corrupted_between_runs_is_recomputed(tmp_path, caplog):
    store_path = tmp_path / "store"
    first = run_fleet(store_path, [MLP], targets=("portable", "reference"))
    published = outputs(store_path)
    store = ArtifactStore(str(store_path))
    # Corrupt the stored .pte object of each target (the objects the published files came from).
    for target in ("portable", "reference"):
        path = Path(store.object_path(first["models"]["mlp"]["targets"][target]["pte"]["sha256"]))
        path.write_bytes(b"garbage" + path.read_bytes()[7:])
    before = stages.EXECUTIONS.copy()
    again = run_fleet(store_path, [MLP], targets=("portable", "reference"))
    ran = stages.EXECUTIONS - before
    assert again["ok"] and outputs(store_path) == published
    assert ran["emit"] == 2 and ran["export"] == 0 and ran["memory_plan"] == 0
    assert "unusable" in caplog.text
    assert store.fs.exists(f"{store.root}/quarantine")


# --- the model changed: never a stale .pte ----------------------------------------------------------

ARCH = """
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))
"""

FACTORY = """
import pathlib
import arch

def net():
    torch.manual_seed(0)
    m = arch.Net()
    m.load_state_dict(torch.load(pathlib.Path(__file__).with_name("w.pt"), weights_only=True))
    return m.eval(), (torch.linspace(-2, 2, 8).reshape(2, 4),)
"""


def library_pte(model_dir: Path) -> bytes:
    """What lowering.lower gives for the model as it is on disk now (in a fresh import)."""
    from tasks.model_spec import ModelSpec, load_model

    loaded = load_model(ModelSpec.parse(f"{model_dir}/factory.py:net"), {"version": None})
    return lower(loaded.module, loaded.inputs).pte


@pytest.fixture
def checkpointed_model(tmp_path):
    model_dir = tmp_path / "net"
    write_model(model_dir / "arch.py", ARCH)
    write_model(model_dir / "factory.py", FACTORY)
    torch.manual_seed(1)
    torch.save({"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}, model_dir / "w.pt")
    return model_dir


def test_new_weights_are_always_relowered(tmp_path, checkpointed_model):
    entry = {"name": "net", "model": f"{checkpointed_model}/factory.py:net"}
    store_path = tmp_path / "store"
    first = run_fleet(store_path, [entry, MLP])
    assert first["ok"] and first["models"]["net"]["changed"] is None
    old = outputs(store_path)["net/portable.pte"]
    assert old == library_pte(checkpointed_model)

    torch.manual_seed(2)  # retrained during the day
    torch.save({"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}, checkpointed_model / "w.pt")
    before = stages.EXECUTIONS.copy()
    second = run_fleet(store_path, [entry, MLP])
    ran = stages.EXECUTIONS - before
    new = outputs(store_path)["net/portable.pte"]
    assert second["ok"] and new != old and new == library_pte(checkpointed_model)
    assert second["models"]["net"]["changed"] == ["weights"]
    assert ran["export"] == 1  # net only: mlp is unchanged and cached
    manifest = ArtifactStore(str(store_path)).get_json("net/manifest.json")
    assert manifest["changed"] == ["weights"] and manifest["fingerprint"]["weights"]["tensors"] == 2

    before = stages.EXECUTIONS.copy()
    third = run_fleet(store_path, [entry, MLP])  # nothing changed: all cached
    assert third["models"]["net"]["changed"] == [] and sum((stages.EXECUTIONS - before).values()) == 0


def test_an_edited_helper_module_is_always_relowered(tmp_path, checkpointed_model):
    entry = {"name": "net", "model": f"{checkpointed_model}/factory.py:net"}
    store_path = tmp_path / "store"
    assert run_fleet(store_path, [entry])["ok"]
    old = outputs(store_path)["net/portable.pte"]
    write_model(checkpointed_model / "arch.py", ARCH.replace("torch.relu", "torch.tanh"))
    second = run_fleet(store_path, [entry])
    new = outputs(store_path)["net/portable.pte"]
    assert second["ok"] and second["models"]["net"]["changed"] == ["code"]
    assert new != old and new == library_pte(checkpointed_model)
    assert second["models"]["net"]["targets"]["portable"]["verify"]["ok"]


def test_a_model_that_breaks_unpublishes_its_old_pte(tmp_path, checkpointed_model):
    entry = {"name": "net", "model": f"{checkpointed_model}/factory.py:net"}
    store_path = tmp_path / "store"
    assert run_fleet(store_path, [entry, MLP])["ok"]
    assert "net/portable.pte" in outputs(store_path)
    # New weights of the wrong shape: the old program must not stay published as if current.
    torch.save({"fc.weight": torch.randn(5, 4), "fc.bias": torch.randn(5)}, checkpointed_model / "w.pt")
    summary = run_fleet(store_path, [entry, MLP])
    assert_fault(summary, "net", "load:", "size mismatch")
    assert set(outputs(store_path)) == {"mlp/portable.pte"}
