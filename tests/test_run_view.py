"""The runs as Prefect records them: a fleet run's children, task run names, log lines.

An in-process fleet runs each model as a ``lower-model`` subflow run named after
the model; each stage task run is named ``stage[model/target]`` (``#i`` for the
partition of a preprocess); Prefect's ``Finished in state Completed()`` lines of
the stage tasks stay out of the logs at the default level, and one line per model
and target says what ran and what came from the cache.  (The browser view of the
same: tests/test_ui_render.py.)
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


class Records(logging.Handler):
    """Every record of Prefect's run loggers (``prefect.flow_runs``, ``prefect.task_runs``:
    what the console and the UI's log tab get), at their own levels."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "Records":
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def fleet_manifest(store: Path, tmp_path: Path) -> dict:
    (tmp_path / "broken.py").write_text("def broken():\n    raise RuntimeError('no model today')\n")
    return {
        "store": str(store),
        "defaults": {"targets": ["portable", "reference"], "verify": False},
        "models": [
            {"name": "mlp", "model": f"{REPO}/examples/models.py:mlp"},
            {"name": "buffer_mutation", "model": f"{REPO}/examples/models.py:buffer_mutation", "targets": ["reference"]},
            {"name": "broken", "model": f"{tmp_path / 'broken.py'}:broken", "targets": ["portable"]},
        ],
    }


def children_of(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))


def task_run_names(flow_run_id: str) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted(r.name for r in runs)


def wait_for_task_runs(flow_run_id: str, count: int) -> list[str]:
    """The task run names of a flow run once the server has recorded ``count`` of them
    (task runs reach it as events, a moment after the run)."""
    import time

    deadline = time.monotonic() + 60
    while True:
        names = task_run_names(flow_run_id)
        if len(names) >= count or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


def test_fleet_in_process_runs_a_named_subflow_per_model_with_named_stage_tasks(prefect_api, fresh_stages, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.lower_fleet import FleetFailed, lower_fleet

    manifest = fleet_manifest(tmp_path / "store", tmp_path)
    with Records() as logs:
        with pytest.raises(FleetFailed) as failed:
            lower_fleet(manifest)
    summary = failed.value.summary
    assert summary["failed"] == ["broken"]
    mlp_run = summary["models"]["mlp"]["flow_run"]
    with get_client(sync_client=True) as client:
        fleet_run = client.read_flow_run(uuid.UUID(mlp_run)).parent_task_run_id
        fleet_run_id = client.read_task_run(fleet_run).flow_run_id

    # One child per model, named after it, a lower-model run; the failed model's run failed.
    children = {run.name: run for run in children_of(str(fleet_run_id))}
    assert sorted(children) == ["broken", "buffer_mutation", "mlp"]
    assert {str(children[name].id) for name in ("mlp", "buffer_mutation")} == {
        summary["models"][name]["flow_run"] for name in ("mlp", "buffer_mutation")}
    assert children["mlp"].state.is_completed() and children["broken"].state.is_failed()
    # The fleet run's own task runs are the subflows' stand-ins, one per model.
    assert task_run_names(str(fleet_run_id)) == ["lower-model[broken]", "lower-model[buffer_mutation]",
                                                 "lower-model[mlp]"]

    # Each model run shows its stages, named after stage, model and target.
    mlp_stages = [r["stage"] for t in summary["models"]["mlp"]["targets"].values() for r in t["stages"]]
    names = wait_for_task_runs(str(children["mlp"].id), len(mlp_stages) - 1)  # export: one task for both targets
    assert names == sorted(["export[mlp]", "memory_plan[mlp/portable]", "emit[mlp/portable]",
                            "partition[mlp/reference]", "create_submodule[mlp/reference]",
                            "build_programs[mlp/reference]", "preprocess[mlp/reference#0]",
                            "adjust[mlp/reference]", "memory_plan[mlp/reference]", "emit[mlp/reference]"])

    # The logs: no per-task "Finished in state" line; one line per model and target.
    messages = logs.messages()
    stage_finished = [r for r in logs.records if r.getMessage().startswith("Finished in state")
                      and getattr(r, "task_name", None) is not None]
    assert stage_finished == []
    assert [m for m in messages if m.startswith("mlp/")] == [
        m for m in messages if m.startswith(("mlp/portable ok", "mlp/reference ok"))]
    assert len([m for m in messages if m.startswith("mlp/")]) == 2
    portable = next(m for m in messages if m.startswith("mlp/portable ok"))
    assert "3 ran (export " in portable and "memory_plan " in portable and "emit " in portable
    (broken,) = [m for m in messages if m.startswith("broken/")]
    assert broken.startswith("broken/portable FAILED load: ModelSpecError") and "no model today" in broken

    # A cached rerun: the same children, no stage task runs, and the lines say what came from the cache.
    with Records() as logs:
        with pytest.raises(FleetFailed) as again:
            lower_fleet(manifest)
    rerun = again.value.summary["models"]["mlp"]["flow_run"]
    assert task_run_names(rerun) == []
    lines = [m for m in logs.messages() if m.startswith("mlp/")]
    assert len(lines) == 2
    assert lines[0].startswith("mlp/portable ok") and lines[0].endswith("3 cached (export, memory_plan, emit)")
    assert "8 cached (export, partition, create_submodule, build_programs, preprocess, adjust, memory_plan, emit)" \
        in lines[1]


def test_a_failed_stage_task_is_still_logged(prefect_api, fresh_stages, tmp_path):
    from flows.lower_model import ModelLoweringFailed, lower_model

    fresh_stages.FAULTS.add("emit")
    with Records() as logs:
        with pytest.raises(ModelLoweringFailed):
            lower_model(f"{REPO}/examples/models.py:mlp", ["portable"], str(tmp_path / "store"), verify=False)
    failed = [r for r in logs.records if r.getMessage().startswith("Finished in state Failed")
              and getattr(r, "task_name", None)]
    assert [r.task_run_name for r in failed] == ["emit[mlp/portable]"] and failed[0].levelno == logging.ERROR
    assert not [r for r in logs.records if r.getMessage().startswith("Finished in state Completed")
                and getattr(r, "task_name", None)]
    (line,) = [m for m in logs.messages() if m.startswith("mlp/portable ")]
    assert line.startswith("mlp/portable FAILED emit: InjectedFault")
    assert "3 ran (export " in line and "memory_plan " in line and "emit Failed " in line


def test_stage_finished_lines_come_back_at_debug(prefect_api, fresh_stages, tmp_path):
    from flows.lower_model import lower_model

    task_runs = logging.getLogger("prefect.task_runs")
    level = task_runs.level
    task_runs.setLevel(logging.DEBUG)
    try:
        with Records() as logs:
            lower_model(f"{REPO}/examples/models.py:mlp", ["portable"], str(tmp_path / "store"), verify=False)
    finally:
        task_runs.setLevel(level)
    finished = [r for r in logs.records if r.getMessage().startswith("Finished in state Completed")
                and getattr(r, "task_name", None)]
    assert sorted(r.task_run_name for r in finished) == ["emit[mlp/portable]", "export[mlp]",
                                                        "memory_plan[mlp/portable]"]
    assert {r.levelno for r in finished} == {logging.DEBUG}


# --------------------------------------------------------------------------- the line per target


def test_target_line_counts_stages_run_and_cached():
    from flows.run_logs import target_line

    def record(stage, cached, seconds=0.5, state=None):
        return {"stage": stage, "cached": cached, "seconds": seconds, "state": state or ("Cached" if cached else "Completed")}

    ok = {"ok": True, "stages": [record("export", True, 0.01), record("partition", True, 0.01),
                                 record("preprocess", False, 0.25), record("preprocess", False, 0.5),
                                 record("emit", False, 1.0)]}
    assert target_line("cnn", "xnnpack", ok) == (
        "cnn/xnnpack ok 1.77 s: 3 ran (preprocess×2 0.75 s, emit 1.00 s), 2 cached (export, partition)")
    cached = {"ok": True, "stages": [record("export", True, 0.001), record("memory_plan", True, 0.002)]}
    assert target_line("mlp", "portable", cached) == "mlp/portable ok 0.00 s: 2 cached (export, memory_plan)"
    failed = {"ok": False, "error": "emit: ValueError: no", "stages": [
        record("export", True, 0.01), record("emit", False, 0.2, "Failed")]}
    assert target_line("mlp", "portable", failed) == (
        "mlp/portable FAILED emit: ValueError: no | 0.21 s: 1 ran (emit Failed 0.20 s), 1 cached (export)")
    methods = {"ok": True, "stages": [{**record("export", True), "method": "decode"}]}
    assert target_line("lm", "portable", methods).endswith("1 cached (export[decode])")


def test_task_run_names_follow_the_label():
    from tasks.run_names import labelled, task_run_name

    name = task_run_name("preprocess")
    assert name() == "preprocess"
    with labelled(model="cnn"):
        assert name() == "preprocess[cnn]"
        with labelled(target="xnnpack"), labelled(partition=2):
            assert name() == "preprocess[cnn/xnnpack#2]"
        with labelled(method="decode", target="portable"):
            assert name() == "preprocess[cnn.decode/portable]"
        assert name() == "preprocess[cnn]"
