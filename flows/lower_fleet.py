"""The fleet flow: every model of a manifest, concurrently; one failure never stops the others.

    load + validate manifest (all errors before any work)
      └─► model_1's stages ┐
      └─► model_2's stages ├─► summary (outputs/fleet.json, a Prefect artifact)
      └─► …                ┘

Each model's DAG runs on a thread of its own with a copy of the flow's
context, so its stage tasks are top-level tasks of the fleet run.  (Inside a
wrapping task they would be nested transactions: their results would commit,
and their locks be released, only when the wrapper succeeded — a failed model
would lose its finished stages and leave their locks held.)
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import flow, get_run_logger

from tasks.store import ArtifactStore

from .lower_model import ModelLoweringFailed, plan_model, run_model
from .manifest import FleetManifest, ModelEntry, load_manifest


class FleetFailed(RuntimeError):
    """Some models failed; ``summary`` has every model's manifest."""

    def __init__(self, summary: dict) -> None:
        super().__init__(f"{len(summary['failed'])} of {len(summary['models'])} models failed: {', '.join(summary['failed'])}")
        self.summary = summary


#: Models lowered at once.  Stages are mostly Python (GIL-bound) and export is
#: serialized, so more threads mostly overlap I/O; processes or Dask scale further.
MAX_CONCURRENT_MODELS = 4


def lower_entry(entry: ModelEntry, store: str | None) -> dict:
    """One model of the fleet (see the module docstring for why not a task)."""
    return run_model(
        model=entry.model, targets=list(entry.targets), store=store,
        options={k: dict(v) for k, v in entry.options.items()},
        name=entry.name, version=entry.version, verify=entry.verify,
    )


@flow(name="lower-fleet")
def lower_fleet(manifest: str | dict) -> dict:
    """Lower every model of ``manifest`` (a YAML/JSON path or dict); returns the fleet summary.

    Raises :class:`FleetFailed` (after writing the summary) if any model failed.
    """
    fleet = load_manifest(manifest)
    logger = get_run_logger()
    store = ArtifactStore(fleet.store)
    summary: dict[str, Any] = {"store": store.url, "models": {}, "failed": []}
    with ThreadPoolExecutor(max_workers=MAX_CONCURRENT_MODELS, thread_name_prefix="lowerflow-model") as pool:
        futures = {
            e.name: pool.submit(contextvars.copy_context().run, lower_entry, e, fleet.store)
            for e in fleet.models
        }
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
