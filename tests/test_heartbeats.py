"""Flow-run heartbeats and the suspension observer (flows/heartbeats.py): installed in
Prefect's engine, still working, and stopped when the run ends."""

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
    observer = prefect.flow_engine.observe_flow_run_suspension
    assert observer.__qualname__ == "observe_flow_run_suspension"
    assert observer.__code__.co_filename == heartbeats.send_heartbeats.__code__.co_filename


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


def test_the_suspension_observer_marks_a_suspended_run_and_ends_with_the_block(prefect_api):
    """A deployment run's observer is watching when the run's body starts (a suspension
    set at once is seen), marks the run's suspension request, and its thread is gone as
    soon as the block ends."""
    import uuid

    from prefect._flow_run_suspension import FlowRunSuspensionRequest
    from prefect.client.orchestration import get_client
    from prefect.states import Running, Suspended

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("suspension-probe")
        deployment = client.create_deployment(flow_id=flow_id, name=f"s-{uuid.uuid4().hex[:8]}")
        runs = [client.create_flow_run_from_deployment(deployment) for _ in range(2)]
        for run in runs:
            client.set_flow_run_state(run.id, Running(), force=True)

        request = FlowRunSuspensionRequest()
        with heartbeats.observe_flow_run_suspension(runs[0].id, request):
            assert [t for t in threading.enumerate() if t.name == "flow-run-suspension-observer"]
            client.set_flow_run_state(runs[0].id, Suspended(), force=True)
            deadline = time.monotonic() + 30
            while not request.is_requested() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert request.is_requested() and request.get_state().name == "Suspended"
        assert not [t for t in threading.enumerate() if t.name == "flow-run-suspension-observer"]

        untouched = FlowRunSuspensionRequest()
        with heartbeats.observe_flow_run_suspension(runs[1].id, untouched):
            time.sleep(0.3)
            started = time.monotonic()
        ended = time.monotonic() - started
        assert not untouched.is_requested()
        assert not [t for t in threading.enumerate() if t.name == "flow-run-suspension-observer"]
        assert ended < 1.0, ended  # not the 2 s join timeout: the observer was woken
