"""The per-model flow: the lowering DAG of one model for one or more targets.

    export ──┬─► memory_plan ─► emit ─► verify                                   (portable)
             └─► partition ─► create_submodule ─► build_programs ─► preprocess×N
                           ─► adjust ─► memory_plan ─► emit ─► verify          (a backend target)

Every stage is a cached task (tasks.stages), so a re-run executes only stages
whose inputs changed, and a run that failed resumes at the stage that failed.
Outputs, at predictable names in the store: ``outputs/<name>/<target>.pte`` and
``outputs/<name>/manifest.json`` (what was produced, stage by stage).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from lowering.targets import PORTABLE
from tasks.cache import CacheConfig
from tasks.model_spec import ModelSpec, source_digest
from tasks.stages import StageTasks, call_stage


class ModelLoweringFailed(RuntimeError):
    """Some target of a model failed; ``manifest`` says which stage and why."""

    def __init__(self, manifest: dict) -> None:
        failed = {t: r["error"] for t, r in manifest["targets"].items() if not r["ok"]}
        super().__init__(f"model {manifest['name']!r}: " + "; ".join(f"{t}: {e}" for t, e in failed.items()))
        self.manifest = manifest


@flow(name="lower-model")
def lower_model(
    model: str,
    targets: list[str] = [PORTABLE],  # noqa: B006 - Prefect parameters are copied per run
    store: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    name: str | None = None,
    version: str | None = None,
    verify: bool = True,
) -> dict:
    """Lower ``model`` (a model spec) for every target; returns the model manifest."""
    stages = StageTasks(CacheConfig(store_url=store))
    spec = ModelSpec.parse(model)
    name = name or spec.name
    options = options or {}
    manifest: dict[str, Any] = {"model": model, "name": name, "store": stages.store.url, "targets": {}}

    export_records: list[dict] = []
    try:
        exported = call_stage(
            stages.export, export_records,
            model=model, source=source_digest(spec), options={"version": version},
        )
    except Exception as exc:
        for target in targets:
            manifest["targets"][target] = _failed(export_records, exc)
    else:
        for target in targets:
            manifest["targets"][target] = lower_target(
                stages, name, model, exported["program"], target, options.get(target, {}),
                list(export_records), verify,
            )
    _log(name, manifest)
    stages.store.put_json(f"{name}/manifest.json", manifest)
    _publish_report(manifest, stages)
    if not all(t["ok"] for t in manifest["targets"].values()):
        raise ModelLoweringFailed(manifest)
    return manifest


def lower_target(stages, name, model, program, target, options, records, verify) -> dict:
    """The stages after export for one target; a failure is recorded, not raised."""
    result: dict[str, Any] = {
        "ok": False, "pte": None, "error": None, "stages": records,
        "memory_plan": None, "delegation": None, "verify": None,
    }
    try:
        if target != PORTABLE:
            program, result["delegation"] = delegate(stages, name, program, target, options, records)
        planned = call_stage(stages.memory_plan, records, program=program)
        result["memory_plan"] = {k: planned[k] for k in ("arena_bytes", "lower_bound", "algorithm")}
        emitted = call_stage(stages.emit, records, program=program, plan=planned["plan"])
        result["pte"] = publish_pte(stages.store, name, target, emitted["pte"])
        if verify:
            report = call_stage(stages.verify, records, pte=emitted["pte"], model=model, source=source_digest(ModelSpec.parse(model)))
            result["verify"] = report
            if report.get("ok") is False:
                raise RuntimeError(f"verify: the .pte does not match eager: {_verify_errors(report)}")
        result["ok"] = True
    except Exception as exc:
        result.update(_failed(records, exc), stages=records, pte=result["pte"])
    return result


def delegate(stages, name, program, target, options, records):
    """Stages 2–6: returns (delegated program ref, delegation summary)."""
    tagged = call_stage(stages.partition, records, program=program, target=target, options=options)
    if not tagged["partitions"]:
        return tagged["program"], {"partitions": 0, "delegated_nodes": 0, "total_nodes": tagged["total_nodes"]}
    plan = call_stage(stages.create_submodule, records, tagged=tagged["tagged"])["plan"]
    built = call_stage(stages.build_programs, records, tagged=tagged["tagged"], plan=plan)
    partitions = []
    for part in built["partitions"]:
        done = call_stage(
            stages.preprocess, records,
            program=part["program"], backend_id=part["backend_id"],
            compile_specs=part["compile_specs"], label=f"{name}/{part['tag']}",
        )
        partitions.append({**part, **done})
    adjusted = call_stage(stages.adjust, records, tagged=tagged["tagged"], plan=plan, partitions=partitions)
    summary = {
        "partitions": len(partitions),
        "delegated_nodes": adjusted["delegated_nodes"],
        "total_nodes": tagged["total_nodes"],
    }
    return adjusted["program"], summary


def publish_pte(store, name: str, target: str, pte_ref) -> dict:
    """Copy the .pte to its predictable name, ``outputs/<name>/<target>.pte``."""
    ref = store.put_named(f"{name}/{target}.pte", store.get_bytes(pte_ref), "pte")
    return {"uri": ref.uri, "sha256": ref.sha256, "size": ref.size}


def _failed(records: list[dict], exc: BaseException) -> dict:
    stage = next((r["stage"] for r in reversed(records) if r["state"] not in ("Completed", "Cached")), None)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {
        "ok": False, "pte": None, "stages": records,
        "error": f"{stage or 'lowering'}: {type(exc).__name__}: {message}",
        "memory_plan": None, "delegation": None, "verify": None,
    }


def _verify_errors(report: dict) -> str:
    return "; ".join(f"{c['runtime']}: {c.get('error')}" for c in report.get("checks", []) if not c["ok"])


def _log(name: str, manifest: dict) -> None:
    logger = get_run_logger()
    for target, result in manifest["targets"].items():
        for r in result["stages"]:
            logger.info("%s/%s %-16s %-9s %.3fs", name, target, r["stage"], "cached" if r["cached"] else r["state"].lower(), r["seconds"])
        logger.info("%s/%s %s", name, target, "ok" if result["ok"] else f"FAILED {result['error']}")


def _publish_report(manifest: dict, stages) -> None:
    try:
        from flows.reports import publish_model_report
    except ImportError:  # reports land separately
        return
    publish_model_report(manifest, stages.store)
