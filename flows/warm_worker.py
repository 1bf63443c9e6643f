"""``lowerflow worker``: a warm parent and a Prefect process worker whose flow runs start warm.

:func:`run_worker` starts the warm parent (``python -m flows.warm_start serve``), then a
:func:`warm_worker_class` worker polling the pool: Prefect's ProcessWorker whose job
command is the warm client (``python -m flows.warm_start run prefect.engine``), which
hands a deployment whose code is already here (:func:`local_entrypoint`) its flow's
entrypoint directly, and which polls only when it has a free slot (and as soon as
one frees).  How the runs are forked is :mod:`flows.warm_start`'s.
"""

from __future__ import annotations

import os
import sys
import threading

from flows.warm_start import ENTRYPOINT_ENV, SOCKET_ENV


#: The one pull step a deployment of code already on the worker has (``prefect deploy``
#: without ``pull``, or ``flow.from_source(<local directory>)``).
SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


def local_entrypoint(deployment) -> tuple[str, str] | None:
    """(directory, entrypoint) of a deployment whose code is already here: its only pull
    step is ``set_working_directory`` to an existing directory and its entrypoint is a
    ``path.py:flow``.  None for anything else (git clones, storage blocks, module paths).

    For such a deployment, a flow run started in ``directory`` with
    ``PREFECT__FLOW_ENTRYPOINT=entrypoint`` loads the same flow as the engine's
    ``load_flow_from_flow_run`` (read the deployment, run the step: ``chdir``, import the
    entrypoint), without reading the deployment again nor emitting the step's event:
    0.1-0.3 s of every flow run (issue 9).
    """
    steps = getattr(deployment, "pull_steps", None) or []
    entrypoint = getattr(deployment, "entrypoint", None) or ""
    if len(steps) != 1 or ":" not in entrypoint or getattr(deployment, "storage_document_id", None):
        return None
    if not isinstance(steps[0], dict) or len(steps[0]) != 1:
        return None
    (step, settings), = steps[0].items()
    if step not in (SET_WORKING_DIRECTORY, "prefect.deployments.steps.pull.set_working_directory"):
        return None
    directory = settings.get("directory") if isinstance(settings, dict) else None
    if not isinstance(directory, str) or "{{" in directory or not os.path.isdir(directory):
        return None  # templated ({{ ... }}) or not on this machine: let the engine run the step
    return directory, entrypoint


#: Set when SIGTERM stopped the worker (its exit is then a clean one).
TERMINATED = threading.Event()


def warm_worker_class():
    """Prefect's ProcessWorker whose flow runs start with ``flows.warm_start run
    prefect.engine`` (unless a deployment sets its own ``command``), loading a
    :func:`local_entrypoint` deployment's flow straight from its entrypoint."""
    from prefect.utilities.processutils import command_to_string
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    rendered: dict[str, tuple[object, dict[str, str]]] = {}  # settings object, its variables

    class WarmJobConfiguration(ProcessJobConfiguration):
        @classmethod
        def _base_environment(cls) -> dict[str, str]:
            """Prefect's: the worker's settings as environment variables, for every run.
            Rendering them walks every setting (~50 ms of the worker's CPU a run, py-spy);
            while the settings are the same object, they are the same variables."""
            from prefect.settings import get_current_settings

            settings = get_current_settings()
            if rendered.get("last", (None,))[0] is not settings:
                rendered["last"] = (settings, super()._base_environment())
            return dict(rendered["last"][1])

        def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None,
                                 worker_name=None, worker_id=None):
            super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
            local = local_entrypoint(deployment) if deployment is not None else None
            if local is not None and ENTRYPOINT_ENV not in self.env:
                self.working_dir = local[0]
                self.env[ENTRYPOINT_ENV] = local[1]  # a warm child imports it as a module

    class WarmProcessWorker(ProcessWorker):
        job_configuration = WarmJobConfiguration

        async def run(self, flow_run, configuration, task_status=None):
            if not configuration._command_configured:
                configuration.command = command_to_string(
                    [sys.executable, "-m", "flows.warm_start", "run", "prefect.engine"])
                configuration._command_configured = True
            try:
                return await super().run(flow_run, configuration, task_status)
            finally:
                self._poll_soon()

        async def get_and_submit_flow_runs(self):
            """Prefect's poll, skipped while every slot is taken (nothing could be submitted:
            a busy worker's polls only cost the server, ~15 ms of its CPU each, two a
            second per worker); :meth:`_poll_soon` polls as soon as a slot frees."""
            if self._limiter is not None and self._limiter.available_tokens < 1:
                import prefect.types._datetime

                self._last_polled_time = prefect.types._datetime.now("UTC")  # the health check's "still polling"
                return []
            return await super().get_and_submit_flow_runs()

        def _poll_soon(self):
            """Look for the next run as soon as this one's process has ended: a busy worker
            otherwise idles until its next poll (``PREFECT_WORKER_QUERY_SECONDS``; 0.25 s
            on average, a run).  The poll starts once the caller has released the run's
            limit slot, which it does before it next awaits."""
            if self._runs_task_group is not None:
                try:
                    self._runs_task_group.start_soon(self.get_and_submit_flow_runs)
                except RuntimeError:  # shutting down
                    pass

    return WarmProcessWorker


def run_worker(pool: str, work_queues: list[str], limit: int | None, query_seconds: float = 0.5,
               name: str | None = None, threads: int = 1, preload: list[str] = ()) -> None:
    """``lowerflow worker``: a warm parent and a :func:`warm_worker_class` worker polling
    ``pool`` (its ``work_queues``, at most ``limit`` runs at once), until interrupted.

    ``threads``: torch's intra-op threads per flow run (``OMP_NUM_THREADS``, unless set):
    one worker per core, each run on one thread, rather than every run spreading over
    every core and the workers of a machine fighting for them.

    ``preload``: more modules for the warm parent to import once (a fleet's model zoo,
    e.g. ``transformers.models.bert.modeling_bert``: 0.3-1 s a run otherwise)."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import time

    # SIGTERM before the worker polls (while the warm parent starts) ends it through the
    # cleanup below, too; once it polls, stop_on_sigterm takes over.
    signal.signal(signal.SIGTERM, _terminated)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # read when the warm parent imports torch
    directory = tempfile.mkdtemp(prefix="lowerflow-warm-")
    path = os.path.join(directory, "warm.sock")
    parent = subprocess.Popen([sys.executable, "-m", "flows.warm_start", "serve", path, *preload])
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            if parent.poll() is not None:
                raise RuntimeError(f"the warm parent exited with status {parent.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm parent was not ready after 300 s")
            time.sleep(0.05)
        os.environ[SOCKET_ENV] = path
        os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(query_seconds))
        _run_prefect_worker(pool, work_queues, limit, name)
    finally:
        parent.terminate()
        try:
            parent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            parent.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _run_prefect_worker(pool: str, work_queues: list[str], limit: int | None, name: str | None) -> None:
    import anyio
    from prefect.context import refresh_global_settings_context

    from flows.console import say
    from flows.warm_up import share_api_tls_context

    refresh_global_settings_context()  # PREFECT_WORKER_QUERY_SECONDS set above
    share_api_tls_context()  # the worker makes API clients for every run it submits, too
    worker_class = warm_worker_class()

    async def main() -> None:
        async with worker_class(work_pool_name=pool, work_queues=work_queues or None, limit=limit,
                                name=name) as worker:
            async with anyio.create_task_group() as group:
                group.start_soon(stop_on_sigterm, group.cancel_scope)
                # lowerflow's line in place of Prefect's ``Worker '…' started!`` (print()ed
                # unflushed: to a log file it came out at exit, after the stop line).
                await worker.start(printer=lambda _: say(f"lowerflow worker {worker.name}: polling"))
                group.cancel_scope.cancel()

    try:
        anyio.run(main)
    except BaseException:
        if not TERMINATED.is_set():
            raise
        # Prefect's teardown was cancelled with the worker (its runner would wait for the
        # runs still going, as `prefect worker start` does for 25 s and more): they are
        # left to end on their own, as at Ctrl-C.
    if TERMINATED.is_set():
        print(f"lowerflow worker {name or ''}: stopped (SIGTERM)".replace("  ", " "), file=sys.stderr)


async def stop_on_sigterm(scope) -> None:
    """Cancel ``scope`` (the worker's) at SIGTERM (systemd's stop, ``kill``): the worker
    stops polling and exits through its own teardown and :func:`run_worker`'s cleanup
    (the warm parent and its socket), instead of dying where it stands (Python's
    default) and leaving the socket behind.  A flow run still running is left to end on
    its own, as at Ctrl-C."""
    import signal

    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            TERMINATED.set()
            scope.cancel()
            return
