"""Flow-run heartbeats that stop the moment the run ends.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Iterator

#: The Prefect version whose engine :func:`send_heartbeats` stands in for.
PREFECT_VERSION = "3.8.8"


@contextlib.contextmanager
def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Emit the engine's flow-run heartbeat every ``engine.heartbeat_seconds``
    while the block runs; on exit, stop at once.

    Same contract as Prefect's ``_send_heartbeats``: nothing when heartbeats
    are off (``heartbeat_seconds`` is None), no event once the run's state is
    final, a failed emit never fails the run, and the thread sees the caller's
    context (its settings and API URL).
    """
    seconds = engine.heartbeat_seconds
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


def install() -> bool:
    """Put :func:`send_heartbeats` in Prefect's flow engine; True if it is there."""
    import prefect
    import prefect.flow_engine as flow_engine

    if prefect.__version__ != PREFECT_VERSION or not hasattr(flow_engine, "_send_heartbeats"):
        return False
    flow_engine._send_heartbeats = send_heartbeats
    return True
