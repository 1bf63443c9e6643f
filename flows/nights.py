"""What a night says about itself: the cause of a failed fleet in its state message,
the follow-up of a night its retry recovered, and ``lowerflow nights``.

A failed fleet's state message (what ``--watch``, the UI, the failure notification and
``lowerflow nights`` show) names the models and why they failed.  Failures that share
a cause (the store or Redis down, a lost machine) say it once::

    before  5 of 6 models failed: mlp, cnn, lstm, transformer, buffer_mutation
    after   5 of 6 models failed: mlp, cnn, lstm, transformer, buffer_mutation; cannot reach the
            stage locks' Redis redis://:***@redis:6379/0: ConnectionError: …; check that it is up …

and different causes each with their models, the first :data:`MAX_CAUSES` of them::

    2 of 3 models failed: sensor, cnn | sensor: verify: RuntimeError: sensor offline | cnn: export: …

A fleet run that completes on a later try (a lost fleet worker's run, Crashed and then
retried by flows/automations.py, or ``prefect flow-run retry``) emits the event
:data:`RECOVERED_EVENT`; the "fleet recovered" automation turns it into a notification
``… recovered: completed by retry 1, 2 models re-run``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

#: Distinct causes a failed fleet's state message names (the rest: fleet.json).
MAX_CAUSES = 3
#: What separates two causes in the message (a cause may itself hold "; ").
CAUSE_SEPARATOR = " | "
#: The event a fleet run completed by a retry emits (the "fleet recovered" automation's trigger).
RECOVERED_EVENT = "lowerflow.fleet.recovered"
#: A lost worker's model run, in the fleet's words (the zombie automation marked it Crashed).
LOST = "its worker or machine was lost"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def model_cause(manifest: dict) -> str:
    """Why a failed model failed, in one line: its manifest's ``error`` (one cause for
    every target: an outage, a lost run, a load error), else its first failed target's
    error, else the error writing its manifest."""
    if manifest.get("error"):
        return str(manifest["error"])
    for result in (manifest.get("targets") or {}).values():
        if not result.get("ok") and result.get("error"):
            return str(result["error"])
    return str(manifest.get("store_error") or "failed")


def grouped_causes(summary: dict) -> list[tuple[str, list[str]]]:
    """(cause, the models it hit) for the failed models of a fleet summary, in the order
    of their first model; the models that timed out are left out (the message says so
    already), and the fleet's own ``store_error`` comes last unless a model said it."""
    groups: dict[str, list[str]] = {}
    timed_out = set(summary.get("timed_out") or ())
    for name in summary.get("failed") or ():
        if name not in timed_out:
            groups.setdefault(model_cause(summary["models"].get(name) or {}), []).append(name)
    if summary.get("store_error") and summary["store_error"] not in groups:
        groups[summary["store_error"]] = []
    return list(groups.items())


def failure_message(summary: dict) -> str:
    """A failed fleet's state message: how many and which models failed, then why (see above)."""
    failed, total = summary.get("failed") or [], len(summary.get("models") or {})
    message = f"{len(failed)} of {total} models failed: {', '.join(failed)}"
    if summary.get("timed_out"):
        message += f" (timed out waiting for {', '.join(summary['timed_out'])})"
    causes = grouped_causes(summary)
    if len(causes) == 1 and (set(causes[0][1]) == set(failed) - set(summary.get("timed_out") or ())
                             or not causes[0][1]):
        return f"{message}; {causes[0][0]}"  # one cause for all: said once
    parts = [f"{', '.join(models) if models else 'fleet.json'}: {cause}" for cause, models in causes[:MAX_CAUSES]]
    if len(causes) > MAX_CAUSES:
        parts.append(f"{len(causes) - MAX_CAUSES} more causes in outputs/fleet.json")
    return CAUSE_SEPARATOR.join([message, *parts])


def lost_run_error(run_count: int, message: str) -> str:
    """A model's error when its run ended Crashed on its last try: the same for every
    model a lost machine took (no run ids), so the fleet says it once."""
    times = "once" if run_count == 1 else f"{run_count} times"
    return f"{LOST} ({times}; the model run ended Crashed: {_UUID.sub('…', message) or 'no reason given'})"


def recovered_line(summary: dict) -> str | None:
    """``completed by retry N, K models re-run`` for a fleet summary of a later try
    (its ``try`` record), None for a first try."""
    tried = summary.get("try") or {}
    if int(tried.get("run_count") or 1) <= 1:
        return None
    rerun, waited = tried.get("submitted") or [], tried.get("waited_for") or []
    line = f"completed by retry {tried['run_count'] - 1}, {len(rerun)} models re-run"
    if rerun:
        line += f" ({', '.join(rerun)})"
    if waited:
        line += f"; waited for {len(waited)} left running by the lost try ({', '.join(waited)})"
    return line


def emit_recovered(line: str, flow_run_id: Any, flow_run_name: str) -> None:
    """The :data:`RECOVERED_EVENT` of this fleet run, its resource the flow run (so the
    notification's template knows ``flow_run``)."""
    from prefect.events import emit_event

    emit_event(RECOVERED_EVENT, resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                                          "prefect.resource.name": flow_run_name},
               payload={"recovered": line})  # Prefect relates it to the run's flow and deployment


# --------------------------------------------------------------------------- lowerflow nights


#: What Prefect puts before the message of the exception that failed a flow run.
PREFECT_PREFIX = "Flow run encountered an exception: "


def cause_of(message: str) -> str:
    """A fleet run's state message without Prefect's prefix (``Flow run encountered an
    exception: FleetFailed: ``), on one line: what failed and why."""
    message = message.strip().replace("\n", " ")
    if message.startswith(PREFECT_PREFIX):
        message = message[len(PREFECT_PREFIX):]
        for explained in ("FleetFailed: ", "FleetLost: ", "ManifestError: "):
            message = message.removeprefix(explained)
    return message


def retry_command(run_id: Any) -> str:
    return f"prefect flow-run retry {run_id}"


def night_lines(runs: Iterable[tuple[Any, str | None]], now: Any = None) -> list[str]:
    """Two lines per fleet run, newest first: when it started, its state (and try),
    how long it ran, its deployment and cause (its state message); then what to run
    next (the retry command with the whole id) or its id::

        2026-11-27 02:00  Failed     35 s  nightly-fleet  5 of 6 models failed: mlp, …; cannot reach …
          next: prefect flow-run retry 3f0c2f9e-3a0e-4b9c-9d9a-1f0d5f2f6b1e
    """
    lines = []
    for run, deployment in runs:
        state = run.state.name if run.state else "?"
        if run.run_count and run.run_count > 1:
            state += f" (try {run.run_count})"
        started = run.start_time or run.expected_start_time
        seconds = run.total_run_time.total_seconds() if run.total_run_time else 0.0
        if run.state is not None and run.state.is_running() and run.start_time is not None and now is not None:
            seconds = (now - run.start_time).total_seconds()
        name = run.name + (f" ({deployment})" if deployment else "")
        message = cause_of(run.state.message or "") if run.state else ""
        lines.append(f"{started:%Y-%m-%d %H:%M}  {state:<18} {_duration(seconds):>7}  {name}"
                     + (f"  {message}" if message else ""))
        final_bad = run.state is not None and run.state.is_final() and not run.state.is_completed()
        if run.state is not None and run.state.is_scheduled():  # a crashed try, scheduled again
            lines.append(f"  id: {run.id} (a retry is scheduled: a fleet worker takes it)")
        else:
            lines.append(f"  next: {retry_command(run.id)}" if final_bad else f"  id: {run.id}")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def last_nights(limit: int = 5) -> list[tuple[Any, str | None]]:
    """(run, its deployment's name) of the latest ``lower-fleet`` runs that started, newest
    first, whatever their state now (a crashed one scheduled for its retry included); the
    scheduled nights to come are left out."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["lower-fleet"])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
            sort=FlowRunSort.START_TIME_DESC, limit=limit)
        names = {}
        for run in runs:
            if run.deployment_id is not None and run.deployment_id not in names:
                try:
                    names[run.deployment_id] = client.read_deployment(run.deployment_id).name
                except Exception:  # deleted since: the run still shows
                    names[run.deployment_id] = None
    return [(run, names.get(run.deployment_id)) for run in runs]
