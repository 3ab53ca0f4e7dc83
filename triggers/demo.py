"""Demo data for the dev stack: SCENARIOS.md #1, two routines that share lamp-2; #5, a door
sensor whose MQTT message starts a run; and a nightly schedule.

The demo spans the apps (devices, jobs, triggers), so it lives in the top one, triggers,
and imports the others the way the layers allow.
"""

from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from devices.models import Device
from iotqueue.mqtt import publisher
from jobs.models import JobRun, JobStep, JobTemplate, StepStatus
from jobs.services import run_start

from .models import Schedule, TriggerRule
from .schedules import schedule_save

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
# SCENARIOS.md #5: the lab's door sensor publishes site/berlin/door/<n>/opened {"badge": ...}.
DOOR_TEMPLATE = "Door opened"
DOOR_STEPS = [
    ("cam-3", "snapshot", {"reason": "door {{ params.door }} opened by {{ params.badge }}"}),
    ("lamp-2", "on", {"level": 100}),
]
DOOR_RULE = "Lab door sensor"
DOOR_TOPIC_FILTER = "site/berlin/door/+/opened"
NIGHTLY_SCHEDULE = "Nightly cleaning"
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
    """Create the demo devices, templates and an admin/admin superuser; return its API token."""
    for name, description in DEVICES.items():
        Device.objects.get_or_create(name=name, defaults={"description": description})
    for template_name, steps in {**TEMPLATES, DOOR_TEMPLATE: DOOR_STEPS}.items():
        _template_seed(template_name, steps)
    _triggers_seed()
    user_model = get_user_model()
    admin = user_model.objects.filter(username="admin").first()
    if admin is None:
        admin = user_model.objects.create_superuser("admin", "admin@example.com", "admin")
    return Token.objects.get_or_create(user=admin)[0].key


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
    return started


def run_progress_line(run: JobRun) -> str:
    """One line saying where a run stands, step by step."""
    by_index = {s.index: s for s in run.step_runs.all()}
    parts = []
    for index, spec in enumerate(run.plan):
        step = by_index.get(index)
        mark = STATUS_MARK.get(step.status, step.status) if step else "-"
        parts.append(f"{spec['device']} {spec['action']}: {mark}")
    return f"{run.template.name:<11} {str(run.pk)[:8]}  {run.status:<10} " + " | ".join(parts)
