"""Flow-run heartbeats (flows/heartbeats.py): installed in Prefect's engine, still sent,
and stopped when the run ends."""

from __future__ import annotations

import threading
import time

import prefect
import prefect.flow_engine
import pytest
from prefect import flow

from flows import heartbeats
import flows.lower_model  # noqa: F401  (installs the heartbeats)


@flow
def beating() -> str:
    from prefect.runtime import flow_run

    return flow_run.id


def heartbeat_events(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(
            filter=EventFilter(
                event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
            ),
            limit=50,
        )
    return page.events


def test_installed_in_the_engine_of_the_pinned_prefect():
    assert prefect.__version__ == heartbeats.PREFECT_VERSION, "re-check flows/heartbeats.py against this Prefect"
    installed = prefect.flow_engine._send_heartbeats
    # By source: Prefect loading flows/lower_model.py from a deployment's entrypoint imports
    # another copy of the module (named after the file), which installs its own function.
    assert installed.__qualname__ == "send_heartbeats"
    assert installed.__code__.co_filename == heartbeats.send_heartbeats.__code__.co_filename


def test_a_flow_run_still_sends_its_heartbeat_and_the_thread_ends_with_the_run(prefect_api):
    run_id = beating()
    assert not [t for t in threading.enumerate() if t.name == "flow-run-heartbeat"]
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + 30
    while not (events := heartbeat_events(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(events) == 1
    assert events[0].resource["prefect.resource.name"]
