"""The fleet flow: every model of a manifest, concurrently; one failure never stops the others.

    load + validate manifest (all errors before any work)
      └─► lower_model(model_1) ┐
      └─► lower_model(model_2) ├─► summary (outputs/fleet.json, a Prefect artifact)
      └─► …                    ┘
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.store import ArtifactStore

from .lower_model import ModelLoweringFailed, plan_model, run_model
from .manifest import FleetManifest, ModelEntry, load_manifest


class FleetFailed(RuntimeError):
    """Some models failed; ``summary`` has every model's manifest."""

    def __init__(self, summary: dict) -> None:
        super().__init__(f"{len(summary['failed'])} of {len(summary['models'])} models failed: {', '.join(summary['failed'])}")
        self.summary = summary


@task(name="lower-model", cache_policy=NO_CACHE, persist_result=False)
def lower_entry(entry: dict, store: str | None) -> dict:
    """One model of the fleet: its stage tasks run nested in this task."""
    return run_model(
        model=entry["model"], targets=list(entry["targets"]), store=store,
        options={k: dict(v) for k, v in entry["options"].items()},
        name=entry["name"], version=entry["version"], verify=entry["verify"],
    )


@flow(name="lower-fleet", task_runner=ThreadPoolTaskRunner(max_workers=4))
def lower_fleet(manifest: str | dict) -> dict:
    """Lower every model of ``manifest`` (a YAML/JSON path or dict); returns the fleet summary.

    Raises :class:`FleetFailed` (after writing the summary) if any model failed.
    """
    fleet = load_manifest(manifest)
    logger = get_run_logger()
    store = ArtifactStore(fleet.store)
    futures = {e.name: lower_entry.submit(dataclasses.asdict(e), fleet.store) for e in fleet.models}
    summary: dict[str, Any] = {"store": store.url, "models": {}, "failed": []}
    for entry in fleet.models:
        summary["models"][entry.name] = _outcome(futures[entry.name], entry, summary)
        logger.info("%s: %s", entry.name, "ok" if entry.name not in summary["failed"] else "FAILED")
    summary["ok"] = not summary["failed"]
    store.put_json("fleet.json", summary)
    _publish_report(summary)
    if summary["failed"]:
        raise FleetFailed(summary)
    return summary


def _outcome(future, entry: ModelEntry, summary: dict) -> dict:
    try:
        return future.result()
    except ModelLoweringFailed as exc:
        summary["failed"].append(entry.name)
        return exc.manifest
    except Exception as exc:  # the model's flow itself broke (e.g. a bad spec)
        summary["failed"].append(entry.name)
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return {"model": entry.model, "name": entry.name, "error": error,
                "targets": {t: {"ok": False, "error": error, "stages": [], "pte": None,
                                "memory_plan": None, "delegation": None, "verify": None}
                            for t in entry.targets}}


def plan_fleet(manifest: str | dict) -> list[dict]:
    """Dry run: one row per model × target × stage, ``cached`` or not (nothing runs).

    Stages after the first miss of a target are listed as would-run: their
    inputs (and so their keys) are only known once the miss has run.
    """
    fleet: FleetManifest = load_manifest(manifest)
    rows = []
    for entry in fleet.models:
        planned = plan_model(
            entry.model, list(entry.targets), fleet.store, {k: dict(v) for k, v in entry.options.items()},
            entry.name, entry.version, entry.verify,
        )
        for target, result in planned["targets"].items():
            for record in result["stages"]:
                rows.append({"model": entry.name, "target": target, "stage": record["stage"], "cached": record["cached"]})
    return rows


def _publish_report(summary: dict) -> None:
    try:
        from flows.reports import publish_fleet_report
    except ImportError:  # reports land separately
        return
    publish_fleet_report(summary)
