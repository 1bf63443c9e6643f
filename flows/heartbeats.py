"""Flow-run heartbeats (and the suspension observer) that stop the moment the run ends.

Prefect 3.8.8's flow engine sends a ``prefect.flow-run.heartbeat`` event every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (default 180) from a thread that
sleeps in 1 s steps, and joins that thread when the run ends.  So every flow
run lasts up to a second longer than its work: an empty ``lower-model`` run took
1.10 s, 0.96 s of it in that join (cProfile).  A fleet of 200 models pays it
200 times, and heartbeats cannot be turned off by configuration (the setting
must be an integer >= 30).

:func:`install` replaces the engine's ``_send_heartbeats`` with
:func:`send_heartbeats`: the same events at the same interval, from a thread
that waits on its stop event instead of sleeping, so it ends as soon as the run
does.  It is installed only on the Prefect version it was written against; any
other version keeps its own.  ``flows/lower_model.py`` installs it on import, so
it is in place in every process that runs lowerflow's flows: the CLI, in-process
fleets, ``lowerflow worker``'s children and a plain ``prefect worker start``'s
runs (the engine imports the flow before it runs it).

The same holds for a deployment's flow run's suspension observer (Prefect 3.8.8's
``prefect._flow_run_suspension.observe_flow_run_suspension``, which lets the API
suspend a running deployment run): its thread checks a stop flag every 0.2 s and
is joined when the run ends, 0-0.2 s more for every run (measured: 20-200 ms
between the flow's last state and its engine's end).  :func:`install` puts
:func:`observe_flow_run_suspension` in its place: the same observer, subscribed
before the run begins as Prefect's, woken at once when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
from typing import Any, Iterator

#: Seconds between a run's heartbeats when set below ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
#: (whose minimum is 30): the nightly fleet's deployment sets 10, so a lost fleet run is
#: Crashed, and retried, after a shorter window (flows/automations.py, fleet_zombie_automation).
HEARTBEAT_ENV = "LOWERFLOW_HEARTBEAT_SECONDS"
#: The Prefect version whose engine :func:`send_heartbeats` stands in for.
PREFECT_VERSION = "3.8.8"


@contextlib.contextmanager
def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Emit the engine's flow-run heartbeat every ``engine.heartbeat_seconds``
    while the block runs; on exit, stop at once.

    ``$LOWERFLOW_HEARTBEAT_SECONDS`` (:data:`HEARTBEAT_ENV`) makes them more frequent.
    Same contract as Prefect's ``_send_heartbeats``: nothing when heartbeats
    are off (``heartbeat_seconds`` is None), no event once the run's state is
    final, a failed emit never fails the run, and the thread sees the caller's
    context (its settings and API URL).
    """
    seconds = engine.heartbeat_seconds
    if seconds is not None and os.environ.get(HEARTBEAT_ENV):  # more often than Prefect allows (>= 30 s)
        seconds = min(seconds, float(os.environ[HEARTBEAT_ENV]))
    if seconds is None:
        yield
        return
    resource, related = engine._build_heartbeat_event_template()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            state = engine.flow_run.state if engine.flow_run else None
            if state is not None and state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            stop.wait(seconds)

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(beat,), daemon=True, name="flow-run-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=2)


@contextlib.contextmanager
def observe_flow_run_suspension(flow_run_id: Any, suspension_request: Any, polling_interval: float = 10) -> Iterator[None]:
    """Watch for the API suspending flow run ``flow_run_id`` while the block runs, and
    mark ``suspension_request`` when it does; on exit, stop at once.

    Same contract as Prefect's ``observe_flow_run_suspension``: Prefect's
    ``FlowRunSuspendingObserver`` (events, with polling every ``polling_interval``
    seconds as the fallback) on a thread of its own with the caller's context, the
    block starting only once it watches the run (or failed to start: then the run
    goes on unobserved), and an observer failure never failing the run.
    """
    from prefect._flow_run_suspension import mark_flow_run_suspension_requested
    from prefect._internal.observers import FlowRunSuspendingObserver
    from prefect.logging.loggers import get_logger

    logger = get_logger("flow_run_suspension")
    ready = threading.Event()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    lock = threading.Lock()

    def mark_suspended(flow_run_id: Any, state: Any) -> None:
        if not mark_flow_run_suspension_requested(flow_run_id, state):
            suspension_request.mark_requested(state)

    async def run_observer() -> None:
        stop = asyncio.Event()
        with lock:
            running.append((asyncio.get_running_loop(), stop))
        async with FlowRunSuspendingObserver(on_suspended=mark_suspended, polling_interval=polling_interval) as observer:
            await observer.watch_flow_run_id(flow_run_id)
            ready.set()
            await stop.wait()

    def observer_thread() -> None:
        try:
            asyncio.run(run_observer())
        except Exception:
            logger.debug("Flow run suspension observer exited with an exception", exc_info=True)
        finally:
            ready.set()

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(observer_thread,), daemon=True,
                              name="flow-run-suspension-observer")
    thread.start()
    ready.wait()
    try:
        yield
    finally:
        with lock:
            for loop, stop in running:
                try:
                    loop.call_soon_threadsafe(stop.set)
                except RuntimeError:  # its loop already ended (the observer failed)
                    pass
        thread.join(timeout=2)


def install() -> bool:
    """Put :func:`send_heartbeats` and :func:`observe_flow_run_suspension` in Prefect's
    flow engine; True if they are there."""
    import prefect
    import prefect.flow_engine as flow_engine

    if prefect.__version__ != PREFECT_VERSION or not hasattr(flow_engine, "_send_heartbeats") \
            or not hasattr(flow_engine, "observe_flow_run_suspension"):
        return False
    flow_engine._send_heartbeats = send_heartbeats
    flow_engine.observe_flow_run_suspension = observe_flow_run_suspension
    return True
