"""Orchestration on a real Prefect server and real fsspec stores: caching, resume,
concurrency, corruption, failures, S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from flows.lower_fleet import FleetFailed, lower_fleet, plan_fleet
from flows.lower_model import ModelLoweringFailed, lower_model
from flows.manifest import ManifestError
from lowering.backends.reference import ReferenceBackend
from tasks import stages
from tasks.store import ArtifactRef, ArtifactStore
from tests._lowering import executions_during

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"


pytestmark = pytest.mark.usefixtures("fresh_stages")




def records(manifest, target):
    return [(r["stage"], r["cached"]) for r in manifest["targets"][target]["stages"]]


def fleet_manifest(store, *models, targets=("portable", "reference")):
    return {
        "store": str(store),
        "defaults": {"targets": list(targets)},
        "models": [{"name": m, "model": f"{MODELS}:{m}"} for m in models],
    }


# --- caching across runs -----------------------------------------------------------------------


def test_warm_fleet_rerun_executes_no_stage(tmp_path):
    manifest = fleet_manifest(tmp_path / "store", "mlp", "buffer_mutation", "lifted_constant")
    cold, ran = executions_during(lower_fleet, manifest)
    assert cold["ok"] and not cold["failed"]
    assert ran["export"] == 3 and ran["emit"] == 6 and ran["preprocess"] >= 3
    for name, model in cold["models"].items():
        for target, result in model["targets"].items():
            assert result["ok"], (name, target, result["error"])
            assert result["verify"]["ok"]
            assert Path(result["pte"]["uri"].removeprefix("file://")).name == f"{target}.pte"

    warm, ran = executions_during(lower_fleet, manifest)
    assert sum(ran.values()) == 0, f"warm run executed {dict(ran)}"
    for model in warm["models"].values():
        for result in model["targets"].values():
            assert all(r["cached"] for r in result["stages"])
            assert result["pte"]["sha256"] == cold["models"][model["name"]]["targets"][
                next(iter(model["targets"]))]["pte"]["sha256"] or True
    assert {m: {t: r["pte"]["sha256"] for t, r in v["targets"].items()} for m, v in warm["models"].items()} == {
        m: {t: r["pte"]["sha256"] for t, r in v["targets"].items()} for m, v in cold["models"].items()
    }
    rows = plan_fleet(manifest)
    assert rows and all(r["cached"] for r in rows)
    store = ArtifactStore(str(tmp_path / "store"))
    assert store.get_json("fleet.json")["ok"] is True
    assert store.get_json("mlp/manifest.json")["targets"]["reference"]["delegation"]["partitions"] == 1


def test_plan_lists_stages_that_would_run(tmp_path):
    manifest = fleet_manifest(tmp_path / "store", "mlp", targets=("reference",))
    rows, ran = executions_during(plan_fleet, manifest)
    assert sum(ran.values()) == 0
    assert [r["stage"] for r in rows][:3] == ["export", "partition", "create_submodule"]
    assert not any(r["cached"] for r in rows)
    assert not (tmp_path / "store" / "objects").exists()


# --- resume -------------------------------------------------------------------------------------


def test_resume_after_emit_failure_runs_only_emit_and_after(tmp_path):
    store = str(tmp_path / "store")
    stages.FAULTS.add("emit")
    with pytest.raises(ModelLoweringFailed, match="emit: InjectedFault") as failure:
        lower_model(f"{MODELS}:cnn", ["reference"], store=store)
    assert failure.value.manifest["targets"]["reference"]["pte"] is None
    stages.LIVE.clear()
    stages.FAULTS.clear()

    resumed, ran = executions_during(lower_model, f"{MODELS}:cnn", ["reference"], store=store)
    assert dict(ran) == {"emit": 1, "verify": 1}
    done = records(resumed, "reference")
    assert all(cached for stage, cached in done if stage not in ("emit", "verify"))
    assert not dict(done)["emit"]

    clean, _ = executions_during(lower_model, f"{MODELS}:cnn", ["reference"], store=str(tmp_path / "clean"))
    assert resumed["targets"]["reference"]["pte"]["sha256"] == clean["targets"]["reference"]["pte"]["sha256"]


def test_fleet_resume_after_emit_failure_keeps_finished_stages(tmp_path):
    """A failed model's finished stages are committed (and unlocked) at once, not lost."""
    manifest = fleet_manifest(tmp_path / "store", "mlp", "buffer_mutation")
    stages.FAULTS.add("emit")
    with pytest.raises(FleetFailed, match="2 of 2 models failed"):
        executions_during(lower_fleet, manifest)
    stages.FAULTS.clear()
    assert not list((tmp_path / "store" / "prefect" / "locks").glob("*.lock")), "locks left held"
    resumed, ran = executions_during(lower_fleet, manifest)
    assert resumed["ok"]
    assert dict(ran) == {"emit": 4, "verify": 4}


class FlakyBackend(ReferenceBackend):
    """The reference backend, failing while the flag file exists (the injected fault)."""

    flag: Path | None = None

    @staticmethod
    def preprocess(edge_program, compile_specs):
        if FlakyBackend.flag is not None and FlakyBackend.flag.exists():
            raise RuntimeError("flaky backend is down")
        return ReferenceBackend.preprocess(edge_program, compile_specs)


@pytest.fixture
def flaky_runtime():
    from lowering.backends.reference import ReferenceRuntime
    from lowering.runtime import register_backend_runtime, unregister_backend_runtime

    register_backend_runtime("FlakyBackend", ReferenceRuntime())
    yield
    unregister_backend_runtime("FlakyBackend")


def test_resume_after_preprocess_failure(tmp_path, flaky_runtime):
    store = str(tmp_path / "store")
    FlakyBackend.flag = tmp_path / "down"
    FlakyBackend.flag.touch()
    with pytest.raises(ModelLoweringFailed, match="preprocess: BackendError.*FlakyBackend.*flaky backend is down"):
        lower_model(f"{MODELS}:mlp", ["FlakyBackend"], store=store)
    stages.LIVE.clear()
    FlakyBackend.flag.unlink()

    resumed, ran = executions_during(lower_model, f"{MODELS}:mlp", ["FlakyBackend"], store=store)
    assert resumed["targets"]["FlakyBackend"]["ok"]
    (ours, executorch) = resumed["targets"]["FlakyBackend"]["verify"]["checks"]
    assert ours["ok"] and executorch["skipped"]
    for stage in ("export", "partition", "create_submodule", "build_programs"):
        assert ran[stage] == 0, f"{stage} ran again"
        assert dict(records(resumed, "FlakyBackend"))[stage] is True
    assert ran["preprocess"] == 1 and ran["adjust"] == 1 and ran["emit"] == 1


# --- integrity and sharing ------------------------------------------------------------------------


def test_corrupted_artifact_is_recomputed(tmp_path, caplog):
    store_url = str(tmp_path / "store")
    first, _ = executions_during(lower_model, f"{MODELS}:mlp", ["portable"], store=store_url)
    sha = first["targets"]["portable"]["pte"]["sha256"]
    store = ArtifactStore(store_url)
    path = Path(store.object_path(sha).removeprefix("file://"))
    path.write_bytes(b"garbage" + path.read_bytes()[7:])

    again, ran = executions_during(lower_model, f"{MODELS}:mlp", ["portable"], store=store_url)
    assert ran["emit"] == 1 and ran["export"] == 0 and ran["memory_plan"] == 0
    assert again["targets"]["portable"]["pte"]["sha256"] == sha
    assert store.get_bytes(ArtifactRef(store.uri(store.object_path(sha)), sha, path.stat().st_size, "pte"))
    assert "unusable" in caplog.text


def test_identical_partitions_in_different_models_share_preprocess(tmp_path):
    store = str(tmp_path / "store")
    executions_during(lower_model, f"{MODELS}:mlp", ["reference"], store=store)
    head, ran = executions_during(
        lower_model, f"{ROOT / 'tests' / '_models.py'}:mlp_with_head", ["reference"], store=store
    )
    assert ran["preprocess"] == 0
    assert dict(records(head, "reference"))["preprocess"] is True
    assert head["targets"]["reference"]["ok"]


def test_pt2_model_spec(tmp_path):
    import torch

    from examples.models import mlp

    model, inputs = mlp()
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(model, inputs), str(path))
    result, _ = executions_during(lower_model, str(path), ["portable"], store=str(tmp_path / "store"))
    assert result["targets"]["portable"]["ok"]
    assert result["name"] == "mlp"


# --- failures and validation ------------------------------------------------------------------------


def test_bad_manifest_entry_is_rejected_before_any_work(tmp_path):
    manifest = fleet_manifest(tmp_path / "store", "mlp", "cnn")
    manifest["models"][1]["targets"] = ["portable", "no-such-backend"]
    with pytest.raises(ManifestError, match=r"models\[1\] \('cnn'\): unknown target 'no-such-backend'"):
        executions_during(lower_fleet, manifest)
    assert not (tmp_path / "store").exists()
    manifest["models"][1] = {"name": "cnn", "model": str(tmp_path / "missing.py") + ":cnn"}
    with pytest.raises(ManifestError, match=r"models\[1\] \('cnn'\): model file .* does not exist"):
        lower_fleet(manifest)


def test_failing_model_is_reported_while_others_complete(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def model():\n    raise RuntimeError('cannot build this model')\n")
    manifest = fleet_manifest(tmp_path / "store", "mlp", "lifted_constant", targets=("portable",))
    manifest["models"].insert(1, {"name": "broken", "model": f"{broken}:model"})
    with pytest.raises(FleetFailed, match="1 of 3 models failed: broken") as failure:
        lower_fleet(manifest)
    summary = failure.value.summary
    assert summary["failed"] == ["broken"]
    assert "cannot build this model" in summary["models"]["broken"]["targets"]["portable"]["error"]
    assert summary["models"]["mlp"]["targets"]["portable"]["ok"]
    assert summary["models"]["lifted_constant"]["targets"]["portable"]["ok"]


# --- concurrency -------------------------------------------------------------------------------------


def test_two_concurrent_runs_compute_each_stage_once(tmp_path, prefect_api):
    store = str(tmp_path / "store")
    script = textwrap.dedent(
        f"""
        import json
        from flows.lower_model import lower_model
        from tasks import stages
        lower_model({str(MODELS) + ':mlp'!r}, ["portable", "reference"], store={store!r})
        print("EXECUTIONS=" + json.dumps(dict(stages.EXECUTIONS)))
        """
    )
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    totals: dict[str, int] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        line = next(l for l in out.splitlines() if l.startswith("EXECUTIONS="))
        for stage, n in json.loads(line.split("=", 1)[1]).items():
            totals[stage] = totals.get(stage, 0) + n
    assert totals == {
        "export": 1, "memory_plan": 2, "emit": 2, "verify": 2, "partition": 1,
        "create_submodule": 1, "build_programs": 1, "preprocess": 1, "adjust": 1,
    }


# --- S3 ------------------------------------------------------------------------------------------------


def test_lower_model_on_an_s3_store(monkeypatch, s3_options):
    # What a worker would have in its environment: botocore reads these per client.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_options["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://lowerflow/{uuid.uuid4().hex}"
    first, ran = executions_during(lower_model, f"{MODELS}:lifted_constant", ["portable"], store=url)
    assert first["targets"]["portable"]["ok"] and ran["export"] == 1
    store = ArtifactStore(url)
    assert store.get_named("lifted_constant/portable.pte")[4:8] == b"ET12"
    second, ran = executions_during(lower_model, f"{MODELS}:lifted_constant", ["portable"], store=url)
    assert sum(ran.values()) == 0


def test_lower_model_on_a_memory_store():
    url = f"memory://lowerflow-{uuid.uuid4().hex}"
    first, ran = executions_during(lower_model, f"{MODELS}:buffer_mutation", ["reference"], store=url)
    assert first["targets"]["reference"]["ok"] and ran["preprocess"] == 1
    assert ArtifactStore(url).get_named("buffer_mutation/reference.pte")[4:8] == b"ET12"
    _, ran = executions_during(lower_model, f"{MODELS}:buffer_mutation", ["reference"], store=url)
    assert sum(ran.values()) == 0


def test_a_fleet_waits_for_the_state_types_prefect_calls_final():
    """The pool fleet asks the server only for its runs that ended (flows/lower_fleet.py)."""
    from prefect.client.schemas.objects import State, StateType

    from flows.lower_fleet import FINAL_STATE_TYPES

    assert sorted(FINAL_STATE_TYPES) == sorted(t.value for t in StateType if State(type=t).is_final())


def test_a_pool_fleet_submits_its_models_longest_first_by_their_last_run_time(prefect_api):
    """LPT: the latest completed run of each model on the fleet's deployment gives its run
    time; models with none go first, as listed.  Runs of another deployment, runs that
    did not complete, and older runs do not count."""
    import time as _time

    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    from flows.lower_fleet import longest_first

    pool = f"lpt-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("lower-model")
        ours = client.create_deployment(flow_id=flow_id, name=pool)
        other = client.create_deployment(flow_id=flow_id, name=f"{pool}-other")

        def ran(deployment_id, name: str, seconds: float, final=Completed) -> None:
            run = client.create_flow_run_from_deployment(deployment_id, name=name)
            client.set_flow_run_state(run.id, Running(), force=True)
            _time.sleep(seconds)
            client.set_flow_run_state(run.id, final(), force=True)

        ran(ours, "mobilenet", 0.1)  # an older run: the later one below counts
        ran(ours, "cnn", 0.6)
        ran(ours, "mlp", 0.1)
        ran(ours, "mobilenet", 1.2)
        ran(ours, "bert", 0.9, final=Failed)  # no completed run: unknown
        ran(other, "mlp", 2.0)  # another deployment's

    order, seconds = longest_first(["mlp", "cnn", "mobilenet", "bert", "new"], f"lower-model/{pool}")
    assert order == ["bert", "new", "mobilenet", "cnn", "mlp"], seconds
    # Lower bounds only (a loaded machine stretches a sleep, never shortens it); the order above
    # holds with 0.5 s between the runs' sleeps.
    assert set(seconds) == {"mobilenet", "cnn", "mlp"} and seconds["mobilenet"] >= 1.1 and seconds["cnn"] >= 0.55
    assert longest_first(["a", "b"], f"lower-model/{pool}-none") == (["a", "b"], {})


def test_stage_tasks_are_made_on_first_use(tmp_path):
    """A model run whose stages all hit the cache makes no Prefect task: each is made
    when the run first needs it, once, for every stage there is."""
    from tasks.cache import CacheConfig
    from tasks.stage_tasks import StageTasks

    made = StageTasks(CacheConfig.for_store(str(tmp_path)))
    assert not set(stages.STAGE_IGNORES) & set(vars(made))
    task = made.export
    assert made.export is task and task.name == "export" and task.cache_policy is not None
    assert set(stages.STAGE_IGNORES) == set(stages.STAGE_VERSIONS)
    assert all(getattr(made, stage).fn.__name__ == f"{stage}_stage" for stage in stages.STAGE_IGNORES)
    assert all(callable(getattr(stages, f"run_{stage}")) for stage in stages.STAGE_IGNORES)
    with pytest.raises(AttributeError, match="no attribute 'exportt'"):
        made.exportt


# --- issue 22: the export key and the published manifest ------------------------------------------


def test_the_export_key_does_not_depend_on_how_the_model_path_is_spelled(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    store = tmp_path / "store"
    relative = "examples/models.py:mlp"
    code, first, errors = cli("lower", relative, "-o", tmp_path / "a.pte", "--store", store)
    assert code == 0, errors
    assert first.split("\n")[0].split()[:3] == ["portable", "export", "ran"]
    before = dict(stages.EXECUTIONS)
    code, second, errors = cli("lower", f"{MODELS}:mlp", "-o", tmp_path / "b.pte", "--store", store)
    assert code == 0, errors
    assert second.split("\n")[0].split()[:3] == ["portable", "export", "cached"], second
    assert stages.EXECUTIONS == before  # nothing ran, verify neither
    assert (tmp_path / "a.pte").read_bytes() == (tmp_path / "b.pte").read_bytes()


def test_lower_after_a_fleet_keeps_the_fleets_other_targets_in_the_published_manifest(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    store = ArtifactStore(str(tmp_path / "store"))
    lower_fleet(fleet_manifest(tmp_path / "store", "mlp", targets=("portable", "reference")))
    fleet_record = store.get_json("mlp/manifest.json")["targets"]["reference"]
    code, _, errors = cli("lower", "examples/models.py:mlp", "-t", "portable", "-t", "xnnpack",
                          "-o", tmp_path / "out/", "--store", tmp_path / "store")
    assert code == 0, errors
    published = store.get_json("mlp/manifest.json")
    assert sorted(published["targets"]) == ["portable", "reference", "xnnpack"]
    kept = published["targets"]["reference"]
    assert {k: v for k, v in kept.items() if k != "kept_from"} == fleet_record and kept["kept_from"]
    listed = {Path(r["pte"]["uri"].removeprefix("file://")).name for r in published["targets"].values()}
    on_disk = {p.name for p in (tmp_path / "store" / "outputs" / "mlp").glob("*.pte")}
    assert listed == on_disk == {"portable.pte", "reference.pte", "xnnpack.pte"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mlp.portable.pte", "mlp.xnnpack.pte"]

    # The model changed (another version salt): reference.pte is of the old model, so it goes with its record.
    lower_model(f"{MODELS}:mlp", ["portable"], store=str(tmp_path / "store"), version="2")
    published = store.get_json("mlp/manifest.json")
    assert sorted(published["targets"]) == ["portable"]
    assert {p.name for p in (tmp_path / "store" / "outputs" / "mlp").glob("*.pte")} == {"portable.pte"}
