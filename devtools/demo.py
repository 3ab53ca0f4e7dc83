"""Demo data for the dev stack: two routines that share lamp-2; a door sensor whose MQTT
message starts a run; a nightly schedule; a firmware update whose first step is a Celery task
(devtools/demo_tasks.py) that tells the lamp what to flash; and a Celery chain of two device
commands (jobs/canvas.py), the camera's snapshot handed to the lamp; and a firmware rollout to
twelve bulbs chosen by a label selector, in three waves, whose rate ramps up as bulbs succeed. The morning
routine is edited once after it is created, so it has two versions (jobs/services.py
template_version_record) and its runs execute version 2.

Its devices are played by the device agent library (devtools/demo_devices.py, run by
`manage.py demo_devices`), not by the simulator.

The demo spans the apps (devices, jobs, triggers), so it lives in devtools, above all of them;
no product app imports it.
"""

from __future__ import annotations

import json

from celery import chain
from celery.result import AsyncResult
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from rest_framework.authtoken.models import Token

from devices.models import Device
from iotqueue.mqtt import publisher
from jobs.canvas import device_command
from jobs.models import JobRun, JobStep, JobTemplate, StepKind, StepStatus
from jobs.services import run_start, template_version_record
from triggers.models import Schedule, TriggerRule
from triggers.schedules import schedule_save

DEVICES = {
    "gate-1": "Entrance gate",
    "lamp-2": "Lab lamp, shared by both routines",
    "cam-3": "Lab camera",
    "vac-4": "Cleaning robot",
}
TEMPLATES = {
    "Morning": [("gate-1", "unlock", {}), ("lamp-2", "on", {"level": 80}), ("cam-3", "snapshot", {})],
    "Cleaning": [("lamp-2", "on", {"level": 100}), ("vac-4", "start", {"zone": "B"})],
}
# The edit made to the morning routine after it was first saved: its version 2 dims the lamp.
MORNING_EDIT = {"position": 1, "args": {"level": 60}}
# The lab's door sensor publishes site/berlin/door/<n>/opened {"badge": ...}.
DOOR_TEMPLATE = "Door opened"
DOOR_STEPS = [
    ("cam-3", "snapshot", {"reason": "door {{ params.door }} opened by {{ params.badge }}"}),
    ("lamp-2", "on", {"level": 100}),
]
DOOR_RULE = "Lab door sensor"
DOOR_TOPIC_FILTER = "site/berlin/door/+/opened"
NIGHTLY_SCHEDULE = "Nightly cleaning"
# A task step (the catalogue lookup in devtools/demo_tasks.py) feeds a device step's args.
FIRMWARE_TEMPLATE = "Lamp firmware"
FIRMWARE_STEPS = [
    {
        "name": "fetch",
        "kind": StepKind.TASK,
        "action": "demo.firmware_url",
        "args": {"model": "lamp", "channel": "{{ params.channel }}"},
    },
    {
        "name": "flash",
        "device": "lamp-2",
        "action": "firmware/update",
        "args": {"url": "{{ steps.fetch.result.url }}", "version": "{{ steps.fetch.result.version }}"},
    },
]
# A fleet of bulbs and a fan-out step over them: a label selector picks the lab's bulbs when
# the step starts, and the rollout starts at 60 a minute and doubles after every 3 bulbs that
# succeeded, up to 600 a minute (AWS IoT Jobs' exponential rate), in three waves.
BULBS = {f"bulb-{n:02d}": {"site": "lab", "kind": "bulb"} for n in range(1, 13)}
BULBS_TEMPLATE = "Bulb rollout"
BULBS_STEP = {
    "name": "flash",
    "selector": "kind=bulb,site in (lab)",
    "action": "firmware/update",
    "args": {"version": "2.1"},
    "rollout_per_minute": 60,
    "rollout_increment_factor": 2.0,
    "rollout_increment_every": 3,
    "rollout_max_per_minute": 600,
    # In waves, as a fleet rollout is steered: a canary bulb, then a quarter, then the rest;
    # their gates are automatic so the demo never waits for a person (docs/orchestration.md).
    "waves": [{"count": 1}, {"percent": 25}, {"rest": True}],
}
# The demo's devices are played by the device agent library (`manage.py demo_devices`,
# devtools/demo_devices.py); this config keeps the simulator away from them.
AGENT_PLAYED = {"simulator": False}
STATUS_MARK = {
    StepStatus.SUCCEEDED: "ok",
    StepStatus.FAILED: "FAILED",
    StepStatus.TIMED_OUT: "TIMED OUT",
    StepStatus.CANCELED: "canceled",
    StepStatus.DISPATCHED: "sent",
    StepStatus.IN_PROGRESS: "working",
    StepStatus.QUEUED: "waiting",
    StepStatus.RETRYING: "retrying",
}


def demo_seed() -> str:
    """Create the demo devices, templates and an admin/admin superuser; return its API token.

    Refused outside DEBUG: a superuser whose password is in the README must never exist on
    a deployed instance.
    """
    if not settings.DEBUG:
        raise ImproperlyConfigured(
            "the demo creates an admin/admin superuser and runs only with DEBUG=true (development); "
            "on a deployment create users with `manage.py createsuperuser`"
        )
    for name, description in DEVICES.items():
        Device.objects.get_or_create(name=name, defaults={"description": description, "config": AGENT_PLAYED})
    for template_name, steps in {**TEMPLATES, DOOR_TEMPLATE: DOOR_STEPS}.items():
        _template_seed(template_name, steps)
    for name, labels in BULBS.items():
        Device.objects.get_or_create(
            name=name, defaults={"description": "Lab bulb", "labels": labels, "config": AGENT_PLAYED}
        )
    _agents_play()
    _firmware_template_seed()
    _bulbs_template_seed()
    _triggers_seed()
    user_model = get_user_model()
    admin = user_model.objects.filter(username="admin").first()
    if admin is None:
        admin = user_model.objects.create_superuser("admin", "admin@example.com", "admin")
    return Token.objects.get_or_create(user=admin)[0].key


def _agents_play() -> None:
    """Hand demo devices seeded before they were played by agents over to them (a dev database
    from an earlier `make run`): otherwise the simulator would answer their commands too."""
    for device in Device.objects.filter(name__in=[*DEVICES, *BULBS]):
        if device.config.get("simulator") is not False:
            device.config = {**device.config, **AGENT_PLAYED}
            device.save(update_fields=["config", "updated_at"])


@transaction.atomic
def _template_seed(name: str, steps: list[tuple[str, str, dict]]) -> None:
    template, created = JobTemplate.objects.get_or_create(name=name)
    if created:
        for position, (device, action, args) in enumerate(steps):
            JobStep.objects.create(
                template=template,
                position=position,
                device=Device.objects.get(name=device),
                action=action,
                args=args,
                timeout_seconds=30,
            )
        template_version_record(template=template)
        if name == "Morning":
            _morning_edit(template)


def _morning_edit(template: JobTemplate) -> None:
    """Edit the morning routine once, as an operator would, recording its version 2."""
    template.steps.filter(position=MORNING_EDIT["position"]).update(args=MORNING_EDIT["args"])
    template_version_record(template=template)


@transaction.atomic
def _firmware_template_seed() -> None:
    template, created = JobTemplate.objects.get_or_create(name=FIRMWARE_TEMPLATE)
    if created:
        for position, step in enumerate(FIRMWARE_STEPS):
            device = Device.objects.get(name=step["device"]) if step.get("device") else None
            fields = {key: value for key, value in step.items() if key != "device"}
            JobStep.objects.create(
                template=template, position=position, device=device, timeout_seconds=30, **fields
            )
        template_version_record(template=template)


def _triggers_seed() -> None:
    """The door sensor's trigger rule, and the cleaning routine every night at 02:00 Berlin."""
    TriggerRule.objects.get_or_create(
        name=DOOR_RULE,
        defaults={
            "topic_filter": DOOR_TOPIC_FILTER,
            "template": JobTemplate.objects.get(name=DOOR_TEMPLATE),
            "parameters": {"door": "{{ topic.3 }}", "badge": "{{ message.badge }}"},
        },
    )
    if not Schedule.objects.filter(name=NIGHTLY_SCHEDULE).exists():
        schedule_save(
            schedule=Schedule(
                name=NIGHTLY_SCHEDULE,
                template=JobTemplate.objects.get(name="Cleaning"),
                crontab="0 2 * * *",
                timezone="Europe/Berlin",
            )
        )


@transaction.atomic
def _bulbs_template_seed() -> None:
    template, created = JobTemplate.objects.get_or_create(name=BULBS_TEMPLATE)
    if created:
        JobStep.objects.create(template=template, position=0, timeout_seconds=30, **BULBS_STEP)
        template_version_record(template=template)


def demo_versions_line() -> str:
    """Where each demo template's history stands, for the demo's output."""
    latest = {
        template.name: template.versions.order_by("-number").values_list("number", flat=True).first()
        for template in JobTemplate.objects.filter(
            name__in=[*TEMPLATES, DOOR_TEMPLATE, FIRMWARE_TEMPLATE, BULBS_TEMPLATE]
        )
    }
    listed = ", ".join(f"{name} v{number}" for name, number in sorted(latest.items()) if number)
    return f"template versions: {listed} (admin: a template's page → Versions, with a diff)"


def demo_door_open(*, door: int = 7, badge: str = "B-1042") -> str:
    """Publish what the door sensor sends (and one malformed message, which is dropped)."""
    topic = DOOR_TOPIC_FILTER.replace("+", str(door))
    publisher.publish(topic, b"badge=" + badge.encode())  # not JSON: recorded as message.dropped
    publisher.publish(topic, json.dumps({"badge": badge}).encode())
    return topic


def demo_trigger(*, runs_per_template: int) -> list[JobRun]:
    """Start the demo runs, alternating templates so both contend for lamp-2."""
    started = []
    for _ in range(runs_per_template):
        for template in JobTemplate.objects.filter(name__in=TEMPLATES).order_by("-name"):
            started.append(run_start(template=template, trigger="cli", triggered_by="demo")[0])
    firmware = JobTemplate.objects.get(name=FIRMWARE_TEMPLATE)
    started.append(
        run_start(template=firmware, parameters={"channel": "stable"}, trigger="cli", triggered_by="demo")[0]
    )
    bulbs = JobTemplate.objects.get(name=BULBS_TEMPLATE)
    started.append(run_start(template=bulbs, trigger="cli", triggered_by="demo")[0])
    return started


def demo_runs_line(runs: list[JobRun]) -> str:
    """How many runs of which templates, e.g. "6 runs: 2 Morning, 2 Cleaning, 1 Lamp firmware"."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.template.name] = counts.get(run.template.name, 0) + 1
    listed = ", ".join(f"{count} {name}" for name, count in counts.items())
    return f"{len(runs)} runs: {listed}"


def demo_outcome_line(runs: list[JobRun]) -> str:
    """How the followed runs ended, counting the same runs: "8 demo runs finished: 8 succeeded"."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    listed = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    return f"{len(runs)} demo runs finished: {listed}"


def demo_ramp_line(run: JobRun) -> str:
    """When the rollout commanded each bulb, from its first command: the gaps shrink as it ramps."""
    sent = sorted(s.dispatched_at for s in run.step_runs.all() if s.dispatched_at)
    if not sent:
        return f"{BULBS_TEMPLATE}: no bulb commanded"
    offsets = " ".join(f"+{(when - sent[0]).total_seconds():.1f}s" for when in sent)
    return (
        f"{BULBS_TEMPLATE}: {len(sent)} bulbs commanded at {offsets} "
        "(60/min, doubling every 3 successes; waves: 1 bulb, 25 %, the rest)"
    )


def demo_canvas() -> AsyncResult:
    """A Celery chain of two device commands: cam-3's snapshot result goes into lamp-2's args.

    Returns the chain's result (the lamp's); its first link is `result.parent`.
    """
    snapshot = device_command("cam-3", "snapshot")
    flash = device_command("lamp-2", "on", {"level": 40, "because": "{{ params.previous.action }}"})
    return chain(snapshot, flash).apply_async()


def run_progress_line(run: JobRun) -> str:
    """One line saying where a run stands, step by step."""
    by_index: dict[int, list] = {}
    for step in run.step_runs.all():
        by_index.setdefault(step.index, []).append(step)
    parts = []
    for index, spec in enumerate(run.plan):
        steps = by_index.get(index, [])
        if len(steps) > 1:  # a fan-out: how many of its devices succeeded
            done = sum(step.status == StepStatus.SUCCEEDED for step in steps)
            mark = f"{done}/{len(steps)} ok"
        else:
            mark = STATUS_MARK.get(steps[0].status, steps[0].status) if steps else "-"
        parts.append(f"{spec['device'] or spec.get('selector') or spec['kind']} {spec['action']}: {mark}")
    version = f"v{run.template_version.number}" if run.template_version_id else "-"
    return f"{run.template.name:<13} {version:<3} {str(run.pk)[:8]}  {run.status:<10} " + " | ".join(parts)
