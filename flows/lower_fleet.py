"""The fleet flow: every model of a manifest, concurrently; one failure never stops the others.

    load + validate manifest (all errors before any work)
      └─► model_1's stages ┐
      └─► model_2's stages ├─► summary (outputs/fleet.json, a Prefect artifact)
      └─► …                ┘

Two ways to run the models' DAGs:

* **In process** (``pool=None``, the embedded default): each model is a
  ``lower-model`` subflow run named after the model, on a thread of its own with a
  copy of the fleet run's context, so the fleet run shows one child per model and
  each model run shows its stages (task runs named ``emit[cnn/xnnpack]``).  Not
  inside a wrapping task: there the stage tasks would be nested transactions whose
  results commit, and locks are released, only when the wrapper succeeded — a
  failed model would lose its finished stages and leave their locks held.
* **On a work pool** (``pool="P"``): each model is a ``lower-model`` flow run of
  the deployment ``lower-model/P``, submitted with ``run_deployment`` and run by
  whichever worker of the pool picks it up; the fleet run waits for them and
  reads each model's manifest from the store.  A retry of a failed fleet run
  (``prefect flow-run retry``) re-submits only the models whose run did not
  complete; a re-submitted model's finished stages are cache hits, so it resumes
  where it failed.  A try whose own worker was lost (Crashed, then scheduled again
  by flows/automations.py) waits for the model runs it left running.
"""

from __future__ import annotations

from .console import quiet_flow_run

quiet_flow_run()  # a worker's flow run: no library warnings on its console (before torch is imported)

import contextvars
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from prefect import Flow, flow, get_run_logger

from tasks.store import ArtifactStore

from .lower_model import ModelLoweringFailed, lower_model, one_line, plan_model
from .manifest import FleetManifest, ManifestError, ModelEntry, load_manifest
from .nights import emit_recovered, failure_message, lost_run_error, recovered_line
from .outages import outage, store_down
from .run_logs import failure_lines


class FleetFailed(RuntimeError):
    """Some models failed; ``summary`` has every model's manifest (and ``timed_out``:
    the models still out when the fleet timed out)."""

    explained = True  # its message says it all: no traceback at ERROR (flows/run_logs.py)
    logged = True  # and each failed model's line was logged: Prefect's repeat goes to DEBUG

    def __init__(self, summary: dict) -> None:
        super().__init__(failure_message(summary))  # the models, and why (flows/nights.py)
        self.summary = summary


#: Models lowered at once.  Stages are mostly Python (GIL-bound) and export is
#: serialized, so more threads mostly overlap I/O; processes or Dask scale further.
MAX_CONCURRENT_MODELS = 4


def member_parameters(entry: ModelEntry, store_url: str, locks: str | None) -> dict[str, Any]:
    """The parameters of one model's ``lower-model`` run (JSON: they travel to a worker)."""
    return {
        "model": entry.model, "targets": list(entry.targets), "store": store_url,
        "options": {k: dict(v) for k, v in entry.options.items()},
        "name": entry.name, "version": entry.version, "verify": entry.verify,
        **({"locks": locks} if locks is not None else {}),  # else each worker's LOWERFLOW_LOCKS
        **({"dynamic_shapes": entry.dynamic_shapes} if entry.dynamic_shapes is not None else {}),
        **quantize_parameters(entry),
        **load_parameters(entry),
        **benchmark_parameters(entry),
        **({"accept_regressions": True} if entry.accept_regressions else {}),
    }


def benchmark_parameters(entry: ModelEntry) -> dict[str, Any]:
    """The entry's ``benchmark`` and ``gates`` as ``lower_model`` (and ``plan_model``) parameters (only when set)."""
    return {**({"benchmark": entry.benchmark} if entry.benchmark is not None else {}),
            **({"gates": {k: dict(v) for k, v in entry.gates.items()}} if entry.gates else {})}


def load_parameters(entry: ModelEntry) -> dict[str, Any]:
    """The entry's ``strict``, ``trust_pickle``, hf:, ``runtime_ops`` and ``external_weights`` settings as ``lower_model``
    parameters (only when set)."""
    return {**({"strict": True} if entry.strict else {}), **({"trust_pickle": True} if entry.trust_pickle else {}),
            **({"hf": dict(entry.hf)} if entry.hf else {}),
            **({"runtime_ops": dict(entry.runtime_ops)} if entry.runtime_ops else {}),
            **({"external_weights": dict(entry.external_weights)} if entry.external_weights else {})}


def quantize_parameters(entry: ModelEntry) -> dict[str, Any]:
    """The entry's quantize settings as ``lower_model`` parameters (none: an fp32 model)."""
    values = {"quantize": entry.quantize, "calibration": entry.calibration,
              "min_sqnr": entry.min_sqnr, "max_error": entry.max_error}
    return {k: v for k, v in values.items() if v is not None}


#: Seconds a fleet on a pool waits for its model runs (``timeout_seconds``): less than a
#: day, so a hung night has failed long before the next nightly (concurrency limit 1) is due.
FLEET_TIMEOUT_SECONDS = 12 * 3600.0
#: Times a model run that ended Crashed (its worker or machine lost) is submitted again.
CRASH_RETRIES = 2


@flow(name="lower-fleet")
def lower_fleet(manifest: str | dict, pool: str | None = None, timeout_seconds: float | None = FLEET_TIMEOUT_SECONDS,
                crash_retries: int = CRASH_RETRIES, verify: str | None = None,
                accept_regressions: bool = False) -> dict:
    """Lower every model of ``manifest`` (a YAML/JSON path or dict); returns the fleet summary.

    ``pool``: lower each model as a flow run of deployment ``lower-model/<pool>`` on
    that work pool's workers (see the module docstring); None lowers them in this process.
    On a pool, a model run that ends Crashed (a lost worker: see flows/automations.py) is
    submitted again up to ``crash_retries`` times, resuming at its stage (cache hits), and
    after ``timeout_seconds`` (None: no limit) the models still out are cancelled and fail.
    ``verify``: a verify mode for every model, replacing each entry's (:mod:`flows.verify_mode`).
    ``accept_regressions``: publish programs their gates refuse (flows/gates.py), every model.
    Raises :class:`FleetFailed` (after writing the summary) if any model failed.
    """
    logger = get_run_logger()
    try:
        fleet = load_manifest(manifest)
    except ManifestError as exc:  # the fleet's one line (the run's state says it too)
        logger.error("%s", exc)
        exc.logged = True  # Prefect's repeat of it goes to DEBUG (flows/run_logs.py)
        raise
    store = ArtifactStore(fleet.store)
    members = {e.name: {**member_parameters(e, store.url, fleet.locks), **({"verify": verify} if verify else {}),
                        **({"accept_regressions": True} if accept_regressions else {})}
               for e in fleet.models}
    tried: dict[str, Any] = {}
    if pool is None:
        outcomes = lower_in_process(members)
    else:
        outcomes = lower_on_pool(members, pool, store, timeout_seconds, crash_retries, tried)
    summary: dict[str, Any] = {"store": store.url, "models": {}, "failed": [], **({"try": tried} if tried else {})}
    for entry in fleet.models:
        ok, summary["models"][entry.name] = outcomes[entry.name]
        if not ok:
            summary["failed"].append(entry.name)
        logger.info("%s: %s", entry.name, "ok" if ok else "FAILED")
    timed_out = [e.name for e in fleet.models if outcomes[e.name][1].get("timed_out")]
    if timed_out:
        summary["timed_out"] = timed_out
    summary["ok"] = not summary["failed"]
    try:
        store.put_json("fleet.json", summary)
    except Exception as exc:  # the store went away: the fleet fails saying so, in one line
        summary["ok"], summary["store_error"] = False, (
            store_down(str(exc), store.url) or f"cannot write fleet.json to {store.url}: {type(exc).__name__}: "
                                               f"{one_line(str(exc))}")
        logger.error("%s", summary["store_error"])
    _publish_report(summary)
    if not summary["ok"]:
        raise FleetFailed(summary)
    if (line := recovered_line(summary)) is not None:  # a later try completed: the night healed
        from prefect.runtime import flow_run

        logger.info("recovered: %s", line)
        emit_recovered(line, flow_run.get_id(), flow_run.get_name())
    return summary


# --------------------------------------------------------------------------- in process


def lower_in_process(members: dict[str, dict]) -> dict[str, tuple[bool, dict]]:
    """Each model as a ``lower-model`` subflow run named after it, on a thread of this
    process: name → (ok, model manifest).  The runs are made first, one at a time
    (:func:`create_member_runs`), then run concurrently."""
    runs = create_member_runs(members)
    with ThreadPoolExecutor(max_workers=MAX_CONCURRENT_MODELS, thread_name_prefix="lowerflow-model") as threads:
        futures = {}
        for name, params in members.items():
            context = contextvars.copy_context()
            context.run(_MEMBER_RUN.set, runs.get(name))
            futures[name] = threads.submit(context.run, lower_member, params)
        return {name: _outcome(future, members[name]) for name, future in futures.items()}


#: The (flow, flow run) :func:`create_member_runs` made for the model of this thread.
_MEMBER_RUN: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("lowerflow_member_run", default=None)


def lower_member(params: dict) -> dict:
    """One model of the fleet, in this process: its ``lower-model`` subflow run (the one
    :func:`create_member_runs` made, else Prefect makes one).  Raises what the flow raised."""
    from prefect.flow_engine import run_flow

    flow, flow_run = _MEMBER_RUN.get() or (member_flow(params["name"]), None)
    return run_flow(flow, flow_run=flow_run, parameters=params)


def member_flow(name: str) -> Flow:
    """The ``lower-model`` flow as model ``name``'s subflow.

    A subflow run hangs off a task run of the parent made for it (what the UI shows
    as the parent's child), keyed by the flow's function and a per-run call counter.
    A function of each model's own (``lower_model_<name>``) keys it by the model, so
    a model is the same child of the fleet run in every try of it, whatever order
    the models' threads start in.
    """

    @functools.wraps(lower_model.fn)
    def member(*args: Any, **kwargs: Any) -> dict:
        return lower_model.fn(*args, **kwargs)

    member.__qualname__ = member.__name__ = f"lower_model_{name}"
    return Flow(fn=member, name=lower_model.name, version=lower_model.version, description=lower_model.description)


def create_member_runs(members: dict[str, dict]) -> dict[str, Any]:
    """name → (the model's flow, its subflow run: named after the model, Pending), made
    one after the other before any model runs; empty outside a flow run.

    Made as Prefect makes a subflow's run — a task run of the parent standing for it
    (``lower-model[<name>]``), then the flow run under it — but not from the models'
    threads: on Prefect's SQLite database a task run created while another write is
    under way fails with 503 ("database is locked"), which Prefect's client retries
    after 2 s, then 4 s.  Measured on the demo fleet, subflows created from the
    threads made a warm run 6-7 s instead of 1 s.  Here each call is retried after
    50 ms, 100 ms, … instead (:func:`_retried`).
    """
    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, TagsContext
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
    from prefect.states import Pending

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return {}
    tags = TagsContext.get().current_tags
    runs = {}
    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
        for name, params in members.items():
            flow = member_flow(name)
            tracker = Task(name=flow.name, fn=flow.fn, version=flow.version)
            task_run = _retried(lambda: client.create_task_run(
                task=tracker, flow_run_id=context.flow_run.id, dynamic_key="0", name=f"{flow.name}[{name}]",
                extra_tags=tags, state=Pending()))
            runs[name] = flow, _retried(lambda: client.create_flow_run(
                flow=flow, name=name, parameters=flow.serialize_parameters(params), state=Pending(),
                parent_task_run_id=task_run.id, tags=tags))
    return runs


#: Seconds before the retries of an API call the server answered 503 (its database was busy).
RETRY_503_SECONDS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


def _retried(call):
    """``call()``, again after each of :data:`RETRY_503_SECONDS` while the server answers 503."""
    from prefect.exceptions import PrefectHTTPStatusError

    for delay in (*RETRY_503_SECONDS, None):
        try:
            return call()
        except PrefectHTTPStatusError as exc:
            if delay is None or exc.response.status_code != 503:
                raise
            time.sleep(delay)


def _outcome(future, params: dict) -> tuple[bool, dict]:
    try:
        return True, future.result()
    except ModelLoweringFailed as exc:
        return False, exc.manifest
    except Exception as exc:  # the model's flow itself broke (e.g. a bad spec)
        return False, failed_manifest(params, f"{type(exc).__name__}: {one_line(str(exc))}")


def failed_manifest(params: dict, error: str) -> dict:
    """The manifest of a model that failed before it could write its own."""
    return {"model": params["model"], "name": params["name"], "error": error,
            "targets": {t: {"ok": False, "error": error, "stages": [], "pte": None,
                            "memory_plan": None, "delegation": None, "verify": None}
                        for t in params["targets"]}}


# --------------------------------------------------------------------------- on a work pool

#: Seconds between two looks at the model runs a fleet waits for.
POLL_SECONDS = 0.25
#: The state types a model run ends in (``State.is_final``).
FINAL_STATE_TYPES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]
#: Seconds between two "still waiting" log lines (a pool with no worker waits forever).
WAITING_LOG_SECONDS = 60.0


def model_deployment(pool: str) -> str:
    """The per-model deployment a fleet on ``pool`` submits to: ``lower-model/<pool>``."""
    return f"lower-model/{pool}"


class PoolNotReady(RuntimeError):
    """The work pool (or the Prefect server it needs) is not there: what to do, in one line."""


def ensure_model_deployment(pool: str) -> str:
    """The deployment ``lower-model/<pool>``, created from this checkout if missing.

    An existing one (``prefect deploy`` of deployments/prefect.yaml) is used as it is.
    A created one runs ``flows/lower_model.py`` from this directory on the pool's
    workers (queue ``models``): workers on other machines need the same checkout at
    the same path.  Raises :class:`PoolNotReady` if the pool does not exist.
    """
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from .lower_model import lower_model

    name = model_deployment(pool)
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise PoolNotReady(f"no work pool {pool!r} on the Prefect server: create it with "
                               f"'prefect work-pool create {pool} --type process' and start its workers "
                               f"('prefect worker start --pool {pool} --work-queue models --limit 1')") from None
        try:
            client.read_deployment_by_name(name)
            return name
        except ObjectNotFound:
            pass
    root = Path(__file__).resolve().parent.parent
    lower_model.from_source(source=str(root), entrypoint="flows/lower_model.py:lower_model").to_deployment(
        name=pool, work_pool_name=pool, work_queue_name="models",
        job_variables={"env": {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}},
        description="One model of a lowerflow fleet (created by `lowerflow fleet --pool`).",
    ).apply(work_pool_name=pool)  # .deploy() would print tables and advice on the CLI's stdout
    return name


def lower_on_pool(members: dict[str, dict], pool: str, store: ArtifactStore, timeout_seconds: float | None = None,
                  crash_retries: int = 0, tried: dict | None = None) -> dict[str, tuple[bool, dict]]:
    """Each model as a flow run of ``lower-model/<pool>``: submit all, wait for all,
    read their manifests.  Models whose run of this fleet run already completed (a
    retried fleet run) are not submitted again.  ``tried`` (a later try of the fleet
    run) gets ``run_count`` and the models ``submitted``, ``waited_for`` (left running
    by the lost try) and ``done_before`` in this try."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    deployment = model_deployment(pool)
    lost_tries(crash_retries)
    done, out = earlier_members(members)
    if tried is not None and (flow_run.get_run_count() or 1) > 1:
        tried.update(run_count=flow_run.get_run_count(), done_before=sorted(done), waited_for=sorted(out),
                     submitted=[n for n in members if n not in done and n not in out])
    order, known = longest_first(list(members), deployment)
    runs = {}
    for name in order:
        if name in done:
            logger.info("%s: completed in an earlier try of this fleet run (%s)", name, done[name])
        elif name in out:  # submitted by a try whose worker was lost: waited for, not submitted again
            logger.info("%s: waiting for its run of an earlier try of this fleet run (%s)", name, out[name])
            runs[name] = out[name]
        else:
            runs[name] = submit_member(deployment, name, members[name])
    logger.info("submitted %d model runs to %s (%d done before), longest first (%d with a run time from an "
                "earlier run)", len(runs), deployment, len(done), len(known))
    final = wait_for_runs(runs, members, store, timeout_seconds=timeout_seconds, crash_retries=crash_retries,
                          resubmit=lambda name: submit_member(deployment, name, members[name]))
    outcomes = {name: (True, _read_manifest(store, name, run_id)) for name, run_id in done.items()}
    outcomes.update(final)
    return {name: outcomes[name] for name in members}


def submit_member(deployment: str, name: str, params: dict):
    """Submit one model's run of ``deployment`` (a child of this fleet run); its id."""
    from prefect.deployments import run_deployment

    return run_deployment(deployment, parameters=params, timeout=0, flow_run_name=name,
                          tags=["lowerflow", "fleet-member"]).id


#: How many earlier completed runs per model :func:`longest_first` reads at most.
HISTORY_RUNS_PER_MODEL = 5


def longest_first(names: list[str], deployment: str) -> tuple[list[str], dict[str, float]]:
    """The order to submit a fleet's models in, and the run times it is based on.

    The pool's workers take runs in the order they were submitted, so a long model
    submitted last keeps one worker busy while the others have nothing left
    (measured on a 12-model fleet on 2 workers: mobilenet_v2, 6 s, last to start
    cost about a tenth of the fleet's time).  Models are submitted longest first
    (the LPT rule) by the run time (``total_run_time``) of their latest completed
    run of ``deployment``, the models without one first of all, as they come.
    Run times are what the Prefect server already records; on a fleet's first
    run, or when it cannot be read, the order is the manifest's.

        manifest: mlp, cnn, mobilenet_v2, bert    last run times: 0.8, 1.2, 6.4, -
        order:    bert, mobilenet_v2, cnn, mlp
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter, DeploymentFilterName, FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName,
        FlowRunFilterState, FlowRunFilterStateType,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    flow_name, _, deployment_name = deployment.partition("/")
    seconds: dict[str, float] = {}
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=list(names)),
                                              state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["COMPLETED"]))),
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name])),
                sort=FlowRunSort.END_TIME_DESC, limit=HISTORY_RUNS_PER_MODEL * len(names))
    except Exception as exc:  # no history is no reason to fail a fleet
        get_run_logger().warning("submitting in manifest order: cannot read earlier run times: %s: %s",
                                 type(exc).__name__, one_line(str(exc)))
        return list(names), {}
    for run in runs:  # newest first: keep each model's latest
        if run.name in names and run.name not in seconds and run.total_run_time is not None:
            seconds[run.name] = run.total_run_time.total_seconds()
    unknown = [n for n in names if n not in seconds]
    return unknown + sorted(seconds, key=lambda n: (-seconds[n], names.index(n))), seconds


def earlier_members(members: dict[str, dict]) -> tuple[dict[str, str], dict[str, Any]]:
    """The child runs of this fleet run's earlier tries with the same parameters:
    (name → id of the one that completed, name → id of the latest still out: a try
    whose worker was lost left it running).  Empty on a first try or outside a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.runtime import flow_run

    if flow_run.get_run_count() <= 1 or flow_run.get_id() is None:
        return {}, {}
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.get_id()])))
    done, out = {}, {}
    for child in sorted(children, key=lambda r: r.created or 0):
        params = members.get(child.name)
        if params is None or child.state is None or any(child.parameters.get(k) != v for k, v in params.items()):
            continue
        if child.state.is_completed():
            done[child.name] = str(child.id)
        elif not child.state.is_final():
            out[child.name] = child.id
    return done, {name: run_id for name, run_id in out.items() if name not in done}


class FleetLost(RuntimeError):
    """This fleet run was lost (Crashed) more often than it may be retried."""

    explained = True  # its message says it all (flows/run_logs.py)


def lost_tries(crash_retries: int) -> int:
    """How often this fleet run ended Crashed before (its worker or machine lost, and
    then scheduled again by the "retry a lost fleet" automation).  Raises
    :class:`FleetLost` past ``crash_retries``: the retries end here."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.get_run_count() <= 1 or flow_run.get_id() is None:
        return 0
    with get_client(sync_client=True) as client:
        crashed = sum(state.is_crashed() for state in client.read_flow_run_states(flow_run.get_id()))
    if crashed > crash_retries:
        raise FleetLost(f"this fleet run was lost {crashed} times (its worker or machine; crash_retries="
                        f"{crash_retries}): not run again; see deployments/README.md, \"Unattended nights\"")
    return crashed


def wait_for_runs(runs: dict[str, Any], members: dict[str, dict], store: ArtifactStore, *,
                  timeout_seconds: float | None = None, crash_retries: int = 0,
                  resubmit: Callable[[str], Any] | None = None) -> dict[str, tuple[bool, dict]]:
    """Poll the submitted runs until each is final; name → (ok, manifest), logging each
    model's targets as ``"<name>/<target> ok|FAILED ..."`` when it finishes (what the
    CLI's progress lines listen to).

    A run that ends Crashed without a manifest of its own (its worker died; Prefect's
    zombie automation or the worker marked it) is submitted again with ``resubmit(name)``,
    at most ``crash_retries`` times per model.  After ``timeout_seconds`` the runs still
    out are cancelled (:func:`cancel_runs`) and their models fail, marked ``timed_out``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType

    logger = get_run_logger()
    pending = {run_id: name for name, run_id in runs.items()}
    crashes = {name: 0 for name in runs}
    outcomes: dict[str, tuple[bool, dict]] = {}
    last_log = time.monotonic()
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    # Only the runs that ended: most polls find none, and an empty answer is the
    # cheapest one the server gives (it polls four times a second for the whole fleet).
    ended = FlowRunFilterState(type=FlowRunFilterStateType(any_=FINAL_STATE_TYPES))
    with get_client(sync_client=True) as client:
        while pending:
            for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(pending)),
                                                                            state=ended)):
                if run.state is None or not run.state.is_final() or run.id not in pending:
                    continue
                name = pending.pop(run.id)
                if run.state.is_crashed():  # its worker died with it: its task runs never ended
                    crash_task_runs(client, run.id, run.state.message)
                if run.state.is_crashed() and resubmit is not None and crashes[name] < crash_retries \
                        and _read_manifest(store, name, str(run.id)) is None:
                    crashes[name] += 1
                    new = resubmit(name)
                    pending[new] = name
                    logger.warning("%s: model run %s ended Crashed (%s); submitted again as %s (%d of %d)", name,
                                   run.id, one_line(run.state.message or ""), new, crashes[name], crash_retries)
                    continue
                outcomes[name] = _finished(run, members[name], store, crashes[name] + 1)
                for target, result in outcomes[name][1]["targets"].items():
                    if result.get("ok"):
                        logger.info("%s/%s ok", name, target)
                for line in failure_lines(name, outcomes[name][1]):  # a line per cause
                    logger.error("%s", line)
            if pending and deadline is not None and time.monotonic() > deadline:
                outcomes.update(timed_out(client, pending, members, timeout_seconds))
                break
            if pending:
                if time.monotonic() - last_log > WAITING_LOG_SECONDS:
                    last_log = time.monotonic()
                    logger.info("waiting for %d model runs: %s", len(pending), ", ".join(sorted(pending.values())))
                time.sleep(POLL_SECONDS)
    return outcomes


def crash_task_runs(client, run_id, message: str | None) -> int:
    """Mark the task runs of a Crashed flow run that still read Running (or Pending)
    Crashed too, as its engine would have, had it lived (the zombie automation changes
    the flow run only).  Returns how many; never raises (the fleet goes on)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                                TaskRunFilterStateType)
    from prefect.states import Crashed

    try:
        stuck = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(
                any_=["RUNNING", "PENDING"]))))
        for task_run in stuck:
            client.set_task_run_state(task_run.id, Crashed(message=f"its flow run crashed: {message or 'lost'}"),
                                      force=True)
        return len(stuck)
    except Exception as exc:
        get_run_logger().warning("could not mark the task runs of crashed flow run %s: %s: %s", run_id,
                                 type(exc).__name__, one_line(str(exc)))
        return 0


def timed_out(client, pending: dict[Any, str], members: dict[str, dict], seconds: float) -> dict[str, tuple[bool, dict]]:
    """The outcomes of the runs still out when the fleet timed out: cancelled, failed."""
    logger = get_run_logger()
    logger.error("timed out after %g s waiting for %d model runs: %s", seconds, len(pending),
                 ", ".join(sorted(pending.values())))
    states = cancel_runs(client, list(pending))
    outcomes = {}
    for run_id, name in pending.items():
        manifest = failed_manifest(members[name], f"timed out: the fleet waited {seconds:g} s and flow run "
                                                  f"{run_id} was still {states.get(run_id, 'out')}; cancelled")
        outcomes[name] = (False, {**manifest, "timed_out": True})
        logger.info("%s/%s FAILED timed out", name, ",".join(members[name]["targets"]))
    return outcomes


def cancel_runs(client, run_ids: list) -> dict[Any, str]:
    """Cancel flow runs: Cancelling for a running one (its worker stops it), Cancelled for
    one no worker took yet.  Returns each run's state name before; never raises."""
    from prefect.states import Cancelled, Cancelling

    before = {}
    for run_id in run_ids:
        try:
            state = client.read_flow_run(run_id).state
            before[run_id] = state.name if state else "?"
            running = state is not None and (state.is_running() or state.is_pending())
            client.set_flow_run_state(run_id, (Cancelling if running else Cancelled)(message="the fleet timed out"),
                                      force=True)
        except Exception as exc:  # the fleet still fails, naming the model
            get_run_logger().warning("could not cancel flow run %s: %s: %s", run_id, type(exc).__name__,
                                     one_line(str(exc)))
    return before


def _finished(run, params: dict, store: ArtifactStore, tries: int = 1) -> tuple[bool, dict]:
    """(ok, manifest) of a final model run (the ``tries``-th of its model): its own
    manifest from the store when the run wrote one, else a failed manifest carrying
    the run's state message."""
    manifest = _read_manifest(store, params["name"], str(run.id))
    if run.state.is_completed() and manifest is not None:
        return True, manifest
    if manifest is not None:
        return False, manifest
    message = one_line(run.state.message or "") or f"the model run ended {run.state.name}"
    # Its store (or Redis) unreachable, the model's manifest unread: the model's own line.
    down = outage(message, store.url)
    if down:
        return False, failed_manifest(params, down[0])
    if run.state.is_crashed():  # the same words for every model a lost machine took
        return False, failed_manifest(params, lost_run_error(tries, message))
    return False, failed_manifest(params, f"flow run {run.name} ({run.id}) {run.state.name}: {message}")


def _read_manifest(store: ArtifactStore, name: str, run_id: str) -> dict | None:
    """The model's manifest in the store if run ``run_id`` wrote it (not an older run's)."""
    try:
        manifest = store.get_json(f"{name}/manifest.json")
    except Exception:
        return None
    return manifest if manifest.get("flow_run") == run_id else None


def plan_models(manifest: str | dict | FleetManifest) -> dict:
    """Dry run of a fleet (nothing runs): ``{"store", "models": {name: planned model
    manifest}, "failed": [names]}``, shaped like :func:`lower_fleet`'s summary.

    The manifest is validated as :func:`lower_fleet` validates it (:func:`load_manifest`),
    and every model is loaded as a run would load it, so a model whose factory raises
    or whose ``dynamic_shapes`` do not fit its forward is ``failed`` here too, with the
    error the run would record.  In a planned manifest each target's ``ok`` is None
    (would run / cached) or False (cannot run), and its stage records say ``cached``.
    """
    fleet = manifest if isinstance(manifest, FleetManifest) else load_manifest(manifest)
    summary: dict[str, Any] = {"store": fleet.store, "models": {}, "failed": []}
    for entry in fleet.models:
        planned = plan_model(
            entry.model, list(entry.targets), fleet.store, {k: dict(v) for k, v in entry.options.items()},
            entry.name, entry.version, entry.verify, dynamic_shapes=entry.dynamic_shapes,
            **quantize_parameters(entry), **load_parameters(entry), **benchmark_parameters(entry),
        )
        summary["models"][entry.name] = planned
        if any(result.get("ok") is False for result in planned["targets"].values()):
            summary["failed"].append(entry.name)
    return summary


def plan_fleet(manifest: str | dict | FleetManifest) -> list[dict]:
    """Dry run: one row per model × target × stage, ``cached`` or not (nothing runs).

    Stages after the first miss of a target are listed as would-run: their
    inputs (and so their keys) are only known once the miss has run.
    """
    rows = []
    for name, planned in plan_models(manifest)["models"].items():
        for target, result in planned["targets"].items():
            for record in result["stages"]:
                rows.append({"model": name, "target": target, "stage": record["stage"], "cached": record["cached"],
                             **({"method": record["method"]} if record.get("method") else {})})
    return rows


def _publish_report(summary: dict) -> None:
    try:
        from flows.reports import publish_fleet_report
    except ImportError:  # reports land separately
        return
    publish_fleet_report(summary)
