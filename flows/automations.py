"""The Prefect automations an unattended night needs (``lowerflow automations install``).

    worker machine lost ──► its flow run sends no heartbeat ──► "crash zombie flow runs"
        (PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30,                    marks it Crashed after
         deployments/prefect.yaml sets it for every run)          ZOMBIE_WINDOW seconds
                                                                  │
    lower-fleet sees the model run Crashed ◄──────────────────────┘
        └─► resubmits it (crash_retries, flows/lower_fleet.py); it resumes at its stage

    the fleet run itself Crashed (its worker machine lost) ──► "retry a lost fleet"
        └─► Scheduled again (AwaitingRetry) for any fleet worker; the new try waits for
            the model runs still out, skips the completed ones, and fails at once after
            crash_retries lost tries (flows/lower_fleet.py)

    lower-fleet run ends Failed / Crashed / TimedOut ──► "fleet failed" automation
        └─► SendNotification through a notification block (a webhook made here from
            --notify-url, or any block the user saved: Slack, e-mail, ...): the cause
            (the state message, flows/nights.py), and a retry scheduled (Crashed) or the
            `prefect flow-run retry <id>` to run once it is fixed

    a later try of a lower-fleet run completes ──► lowerflow.fleet.recovered event
        └─► "fleet recovered" automation: "… recovered: completed by retry N, K models re-run"

The automations are Prefect's own (the server's triggers and actions services run
them); this room only builds them.  :func:`install` is idempotent: an automation of
the same name is replaced, so re-running it after an upgrade changes nothing else;
``deployments/server.sh start`` runs it at every start (LOWERFLOW_ZOMBIE_WINDOW,
LOWERFLOW_NOTIFY_URL / LOWERFLOW_NOTIFY_BLOCK).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

#: Names of the automations :func:`install` creates (and replaces).
ZOMBIE_AUTOMATION = "lowerflow: crash zombie flow runs"
LOST_FLEET_AUTOMATION = "lowerflow: retry a lost fleet"
FAILED_FLEET_AUTOMATION = "lowerflow: fleet failed"
RECOVERED_FLEET_AUTOMATION = "lowerflow: fleet recovered"
#: The webhook block :func:`install` saves for ``--notify-url``.
WEBHOOK_BLOCK = "lowerflow-nightly"
#: Seconds between two heartbeats of a flow run (Prefect's minimum; the deployments set it).
HEARTBEAT_SECONDS = 30
#: Seconds without a heartbeat after which a running flow run is marked Crashed:
#: three heartbeats (Prefect's recommendation), so a slow event never crashes a live run.
ZOMBIE_WINDOW = 90
#: Seconds between two heartbeats of a fleet run (``LOWERFLOW_HEARTBEAT_SECONDS`` of the
#: nightly deployment, flows/heartbeats.py): it only waits, so its heartbeats come on time.
FLEET_HEARTBEAT_SECONDS = 10
#: Seconds without a heartbeat after which a running fleet run is Crashed (then retried):
#: three of its heartbeats.  A lost fleet machine costs the night 20-30 s, not 60-90 s.
FLEET_ZOMBIE_WINDOW = 30
FLEET_ZOMBIE_AUTOMATION = "lowerflow: crash lost fleet runs"
#: The flow whose failures notify.
FLEET_FLOW = "lower-fleet"
#: Terminal states of a flow run that mean "the night failed".
FAILED_STATES = ("Failed", "Crashed", "TimedOut")

NOTIFICATION_SUBJECT = ("lowerflow: nightly fleet {{ flow_run.name }} {{ flow_run.state.name }}"
                        "{% if flow_run.state.name == 'Crashed' %} (a retry is scheduled){% endif %}")
#: The state message carries the cause (flows/nights.py); then what happens or what to run next.
NOTIFICATION_BODY = (
    "lowerflow fleet run {{ flow_run.name }} ({{ flow_run.id }}) of deployment "
    "{{ deployment.name }} ended {{ flow_run.state.name }}: "
    "{{ flow_run.state.message | replace('Flow run encountered an exception: ', '') "
    "| replace('FleetFailed: ', '') | replace('FleetLost: ', '') | replace('ManifestError: ', '') }}\n"
    "{% if flow_run.state.name == 'Crashed' %}"
    "a retry is scheduled (automation '" + LOST_FLEET_AUTOMATION + "'): a fleet worker takes it, it waits for "
    "the model runs still out and submits the rest; a message follows when it completes\n"
    "{% else %}"
    "next: fix the cause, then: prefect flow-run retry {{ flow_run.id }}   (only the failed models run again)\n"
    "{% endif %}"
    "manifest: {{ flow_run.parameters.manifest }}\n"
    "{{ flow_run|ui_url }}"
)
RECOVERED_SUBJECT = "lowerflow: nightly fleet {{ flow_run.name }} recovered"
RECOVERED_BODY = (
    "lowerflow fleet run {{ flow_run.name }} ({{ flow_run.id }}) recovered: {{ event.payload.recovered }}\n"
    "manifest: {{ flow_run.parameters.manifest }}\n"
    "{{ flow_run|ui_url }}"
)


class AutomationError(ValueError):
    """What is wrong with the options of ``lowerflow automations install``, in one line."""


def zombie_automation(window: float = ZOMBIE_WINDOW):
    """Prefect's zombie-flow-run automation: a flow run that sent a heartbeat and then,
    for ``window`` seconds, neither another heartbeat nor a final state, is Crashed."""
    from prefect.automations import AutomationCore
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    if window <= HEARTBEAT_SECONDS:
        raise AutomationError(f"--zombie-window {window:g}: must be more than the heartbeat interval "
                              f"({HEARTBEAT_SECONDS} s), or every live run would be crashed")
    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=f"Marks a flow run Crashed when it sent no heartbeat for {window:g} s (its machine or "
                    f"worker died); lower-fleet then resubmits a crashed model run.  Installed by lowerflow.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive, threshold=1, within=timedelta(seconds=window),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {window:g} s: its worker or machine was lost")],
    )


def fleet_zombie_automation(window: float = FLEET_ZOMBIE_WINDOW):
    """:func:`zombie_automation` for ``lower-fleet`` runs, whose heartbeats come every
    :data:`FLEET_HEARTBEAT_SECONDS`: a lost fleet run is Crashed after ``window`` seconds."""
    from prefect.events.schemas.events import ResourceSpecification

    if window <= FLEET_HEARTBEAT_SECONDS:
        raise AutomationError(f"--fleet-window {window:g}: must be more than a fleet run's heartbeat interval "
                              f"({FLEET_HEARTBEAT_SECONDS} s), or every live fleet would be crashed")
    automation = zombie_automation(max(window, HEARTBEAT_SECONDS + 1))
    automation.name = FLEET_ZOMBIE_AUTOMATION
    automation.description = (f"Marks a lower-fleet run Crashed when it sent no heartbeat for {window:g} s (its "
                              f"fleet worker or machine died); 'retry a lost fleet' then schedules it again.  "
                              f"Installed by lowerflow.")
    automation.trigger.within = timedelta(seconds=window)
    automation.trigger.match_related = ResourceSpecification({"prefect.resource.role": "flow",
                                                              "prefect.resource.name": FLEET_FLOW})
    automation.actions[0].message = f"no heartbeat for {window:g} s: its fleet worker or machine was lost"
    return automation


def lost_fleet_automation():
    """A ``lower-fleet`` run that ends Crashed (its worker or machine lost; the zombie
    automation's doing) is scheduled again at once, as ``prefect flow-run retry`` would:
    any fleet worker picks it up and it carries on from the model runs of its lost try
    (:func:`flows.lower_fleet.lower_on_pool`).  Bounded by the fleet itself, which fails
    instead of running once it was lost more than ``crash_retries`` times."""
    from prefect.automations import AutomationCore
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=LOST_FLEET_AUTOMATION,
        description="Schedules a lower-fleet run that crashed (its worker or machine was lost) again, for "
                    "any fleet worker; it waits for its model runs still out.  Installed by lowerflow.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow",
                                                 "prefect.resource.name": FLEET_FLOW}),
            posture=Posture.Reactive, threshold=1, within=timedelta(0),
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                    message="its worker or machine was lost: scheduled again by lowerflow")],
    )


def failed_fleet_automation(block_document_id):
    """A notification through block ``block_document_id`` whenever a ``lower-fleet`` run
    ends Failed (a model failed, or the fleet timed out), Crashed or TimedOut."""
    from prefect.automations import AutomationCore
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=FAILED_FLEET_AUTOMATION,
        description="Notifies when a lower-fleet run fails (a model failed or was lost, or the fleet "
                    "timed out).  Installed by lowerflow.",
        trigger=EventTrigger(
            expect={f"prefect.flow-run.{state}" for state in FAILED_STATES},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow",
                                                 "prefect.resource.name": FLEET_FLOW}),
            posture=Posture.Reactive, threshold=1, within=timedelta(0),
        ),
        actions=[SendNotification(block_document_id=block_document_id, subject=NOTIFICATION_SUBJECT,
                                  body=NOTIFICATION_BODY)],
    )


def recovered_fleet_automation(block_document_id):
    """A notification through block ``block_document_id`` when a ``lower-fleet`` run is
    completed by a later try (the event :data:`flows.nights.RECOVERED_EVENT` it emits):
    the follow-up of a night that was notified Crashed or Failed."""
    from prefect.automations import AutomationCore
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    from flows.nights import RECOVERED_EVENT

    return AutomationCore(
        name=RECOVERED_FLEET_AUTOMATION,
        description="Notifies when a lower-fleet run that crashed or failed is completed by its retry.  "
                    "Installed by lowerflow.",
        trigger=EventTrigger(
            expect={RECOVERED_EVENT},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            posture=Posture.Reactive, threshold=1, within=timedelta(0),
        ),
        actions=[SendNotification(block_document_id=block_document_id, subject=RECOVERED_SUBJECT,
                                  body=RECOVERED_BODY)],
    )


def notification_block_id(client, notify_url: str | None, notify_block: str | None):
    """The id of the block to notify through: a webhook POSTing ``{"subject", "body"}``
    as JSON to ``notify_url`` (saved as ``custom-webhook/lowerflow-nightly``), or the
    saved block ``notify_block`` (``<block type slug>/<name>``, e.g. ``slack-webhook/night``)."""
    from prefect.exceptions import ObjectNotFound

    if notify_url:
        from prefect.blocks.notifications import CustomWebhookNotificationBlock

        if not notify_url.startswith(("http://", "https://")):
            raise AutomationError(f"--notify-url {notify_url!r}: not an http(s) URL")
        block = CustomWebhookNotificationBlock(
            name="lowerflow", url=notify_url, method="POST",
            json_data={"subject": "{{subject}}", "body": "{{body}}"})
        return block.save(WEBHOOK_BLOCK, overwrite=True)
    slug, _, name = (notify_block or "").partition("/")
    if not slug or not name:
        raise AutomationError(f"--notify-block {notify_block!r}: give it as <block type slug>/<name>, "
                              "e.g. slack-webhook/night-owl (`prefect block ls` lists them)")
    try:
        return client.read_block_document_by_name(name=name, block_type_slug=slug).id
    except ObjectNotFound:
        raise AutomationError(f"--notify-block {notify_block}: no such block on the Prefect server "
                              "(`prefect block ls` lists them)") from None


def install(zombie_window: float = ZOMBIE_WINDOW, notify_url: str | None = None,
            notify_block: str | None = None, fleet_window: float = FLEET_ZOMBIE_WINDOW) -> dict[str, Any]:
    """Create (or replace) the automations on the server of ``PREFECT_API_URL``: the
    zombie ones (every run; fleet runs) and the lost-fleet retry always, the failed- and
    recovered-fleet notifications when a URL or block is given.
    Returns ``{automation name: id}``."""
    from prefect.client.orchestration import get_client

    automations = [zombie_automation(zombie_window), fleet_zombie_automation(fleet_window), lost_fleet_automation()]
    with get_client(sync_client=True) as client:
        if notify_url or notify_block:
            if notify_url and notify_block:
                raise AutomationError("give --notify-url or --notify-block, not both")
            block = notification_block_id(client, notify_url, notify_block)
            automations += [failed_fleet_automation(block), recovered_fleet_automation(block)]
        created = {}
        for automation in automations:
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            created[automation.name] = client.create_automation(automation)
    return created


def installed() -> list[str]:
    """Lines describing lowerflow's automations on the server (``lowerflow automations ls``)."""
    from prefect.client.orchestration import get_client

    lines = []
    with get_client(sync_client=True) as client:
        for name in (ZOMBIE_AUTOMATION, FLEET_ZOMBIE_AUTOMATION, LOST_FLEET_AUTOMATION, FAILED_FLEET_AUTOMATION,
                     RECOVERED_FLEET_AUTOMATION):
            found = client.read_automations_by_name(name)
            lines.append(f"{name}: " + (", ".join(f"{'enabled' if a.enabled else 'disabled'} ({a.id})" for a in found)
                                        or "not installed"))
    return lines
