"""Events are bounded: one device's progress cannot write a row per message, the run's API
answer pages its timeline, and events of no run have their own, shorter retention. Before,
10,000 progress messages in 6 s made 10,000 rows and `GET /api/runs/<id>/` answered 11.5 MB."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from devices.protocol import Reply
from jobs.engine.batch import transition_apply
from jobs.engine.progress import PROGRESS_EVENTS_PER_ATTEMPT
from jobs.events import EVENTS_SAMPLED_FIRST
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.retention import runs_prune
from jobs.serializers import RUN_DETAIL_EVENTS
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]

# Within the bridge's per-device burst, so every message reaches the engine.
PROGRESS_SENT = 300


def test_a_progress_flood_is_kept_on_the_step_not_as_a_row_per_message(stack, manual_device, admin_api):
    # given a command in flight on a device the test drives
    device = DeviceFactory()
    hand = manual_device(device.name)
    run, _ = run_start(template=template_with_steps((device, "flash", {})))
    command = hand.next_command()

    # when it reports progress 300 times, each with a detail, then ends
    for n in range(PROGRESS_SENT):
        hand.reply(
            "progress", {"id": command["id"], "progress": n * 100 // PROGRESS_SENT, "detail": f"block {n}"}
        )
    wait_for(
        lambda: StepRun.objects.filter(run=run, progress_messages__gte=PROGRESS_SENT).exists(),
        what="every progress counted",
    )
    hand.done(command["id"])
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, what="the run to end")

    # then the timeline has the first few and one note that the rest is coalesced
    events = RunEvent.objects.filter(run=run, kind="step.progress").order_by("id")
    assert events.count() == PROGRESS_EVENTS_PER_ATTEMPT + 1
    assert events.last().data.get("coalesced") is True
    # and the step keeps the latest detail and the count
    step = StepRun.objects.get(run=run)
    assert step.status == StepStatus.SUCCEEDED
    assert step.progress_messages == PROGRESS_SENT
    assert step.progress_detail == f"block {PROGRESS_SENT - 1}"
    body = admin_api.get(f"/api/runs/{run.pk}/").json()
    assert body["steps"][0]["progress_messages"] == PROGRESS_SENT


def test_the_run_detail_shows_its_latest_events_and_pages_the_rest(admin_api):
    # given a run with more events than its detail shows
    run = JobRun.objects.create(template=JobTemplateFactory(), status=RunStatus.SUCCEEDED)
    RunEvent.objects.bulk_create(
        RunEvent(run=run, kind="step.progress", message=f"event {n}") for n in range(RUN_DETAIL_EVENTS + 150)
    )
    total = RunEvent.objects.filter(run=run).count()

    # when its detail is read
    detail = admin_api.get(f"/api/runs/{run.pk}/").json()

    # then it has the latest RUN_DETAIL_EVENTS, oldest first, the total and where the rest is
    assert len(detail["events"]) == RUN_DETAIL_EVENTS
    assert detail["events"][-1]["message"] == f"event {RUN_DETAIL_EVENTS + 149}"
    assert detail["events_total"] == total
    # and the whole timeline is paged there, oldest first
    first = admin_api.get(detail["events_url"], {"page_size": 100}).json()
    assert first["count"] == total and len(first["results"]) == 100 and first["next"]
    last = admin_api.get(detail["events_url"], {"page_size": 100, "page": (total + 99) // 100}).json()
    assert last["results"][-1]["message"] == f"event {RUN_DETAIL_EVENTS + 149}"
    assert admin_api.get(f"/api/runs/{run.pk}/events/", {"page_size": 0}).status_code == 400


def test_events_of_no_run_are_pruned_sooner_than_runs(settings):
    # given a device's dropped messages of 5 days ago and of today
    old = RunEvent.objects.create(kind="message.dropped", device="noisy", message="old")
    RunEvent.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=5))
    new = RunEvent.objects.create(kind="message.dropped", device="noisy", message="new")

    # when retention runs with its defaults (runs: 30 days, events of no run: 3)
    runs_prune()

    # then only the old orphan is gone
    assert list(RunEvent.objects.filter(device="noisy")) == [new]
    assert settings.IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS < settings.IOTQUEUE_RETENTION_DAYS


def test_replies_that_answer_nothing_are_sampled_per_device_not_a_row_each():
    # given a device that sends 150 replies for commands nobody issued
    device = f"noisy-{uuid.uuid4().hex[:8]}"
    transition_apply(
        replies=[(device, Reply(kind="done", command_id=f"nope-{n}", ok=True)) for n in range(150)]
    )

    # then the first ten and the hundredth are events, the last saying how many came
    events = list(RunEvent.objects.filter(kind="reply.unknown", device=device).order_by("id"))
    assert len(events) == EVENTS_SAMPLED_FIRST + 1
    assert events[-1].data["sampled_count"] == 100 and "the 100th reply.unknown" in events[-1].message
