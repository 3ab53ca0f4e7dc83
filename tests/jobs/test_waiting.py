"""Why a run waits (jobs/waiting.py): reasons read from the rows and the real lock Redis."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, StepKind, StepRun, StepStatus
from jobs.services import run_start
from jobs.waiting import runs_stuck, runs_waiting, step_waiting, steps_waiting
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def waiting_row(run: JobRun, status: str = StepStatus.QUEUED) -> StepRun:
    """The run's row once it reached `status` and its wait was recorded."""
    row = wait_for(
        lambda: StepRun.objects.select_related("run", "device").filter(run=run, status=status).first(),
        what=f"a {status} row of run {run.pk}",
    )
    if status == StepStatus.QUEUED:
        wait_for(lambda: RunEvent.objects.filter(run=run, kind="step.waiting").exists(), what="step.waiting")
    return row


def offline_run() -> tuple[JobRun, StepRun]:
    """A run whose only device went offline a minute ago."""
    went = (timezone.now() - timedelta(minutes=1)).replace(microsecond=0)
    device = DeviceFactory(online=False, last_seen=went)
    run, _ = run_start(template=template_with_steps((device, "on", {})))
    return run, waiting_row(run)


def test_a_run_on_an_offline_device_waits_for_it_since_it_went_offline(stack):
    # given a run whose device is offline since a known time
    run, row = offline_run()

    # when asked why the run and its step wait
    waiting = runs_waiting([JobRun.objects.get(pk=run.pk)])[run.pk]

    # then both say: device offline, since it went offline
    assert waiting.reason == "device_offline"
    assert waiting.device == row.device.name
    assert waiting.since == row.device.last_seen
    assert row.device.name in waiting.message and "offline" in waiting.message
    assert step_waiting(row) == waiting
    assert waiting.as_dict()["since"] == row.device.last_seen.isoformat()


def test_a_run_queued_behind_another_names_the_blocking_run_and_step(stack, manual_device):
    # given a device working on run A's step (it never answers) and run B waiting for it
    device = DeviceFactory()
    hand = manual_device(device.name)
    first, _ = run_start(template=template_with_steps((device, "long", {})))
    hand.next_command()
    second, _ = run_start(template=template_with_steps((device, "after", {})))
    waiting_row(second)

    # when asked why both runs wait, in one call
    runs = list(JobRun.objects.filter(pk__in=[first.pk, second.pk]))
    waiting = runs_waiting(runs)

    # then B waits for the device busy with A's step 0, first in its queue; A for the device's done
    assert waiting[second.pk].reason == "device_busy"
    assert (waiting[second.pk].blocking_run, waiting[second.pk].blocking_step) == (first.pk, 0)
    assert waiting[second.pk].queue_position == 1
    assert str(first.pk)[:8] in waiting[second.pk].message
    assert waiting[first.pk].reason == "device_working"
    assert waiting[first.pk].until is not None


def test_a_delay_step_waits_until_its_end(stack):
    # given a run whose first step is a ten-minute delay
    template = JobTemplateFactory()
    JobStepFactory(template=template, position=0, device=None, kind=StepKind.DELAY, delay_seconds=600)
    run, _ = run_start(template=template)
    row = waiting_row(run, StepStatus.IN_PROGRESS)

    # when asked why it waits
    waiting = step_waiting(row)

    # then: a delay, until the row's end
    assert waiting.reason == "delay"
    assert waiting.until == row.deadline
    assert waiting.until > timezone.now() + timedelta(minutes=9)


def test_finished_rows_and_runs_wait_for_nothing(stack, simulator):
    # given a run that succeeded
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    run, _ = run_start(template=template_with_steps((device, "on", {})))
    wait_for(lambda: JobRun.objects.get(pk=run.pk).is_terminal, what="the run to end")

    # then neither the run nor its row waits
    assert runs_waiting([JobRun.objects.get(pk=run.pk)]) == {}
    assert steps_waiting(StepRun.objects.select_related("run", "device").filter(run=run)) == {}


def test_an_offline_run_is_stuck_only_past_the_threshold(stack, settings):
    # given a run waiting for an offline device
    run, row = offline_run()

    # when the threshold is an hour, it is not stuck yet
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 3600
    assert run.pk not in {stuck.run.pk for stuck in runs_stuck()}

    # when the threshold is past, it is stuck, with its reason and how long it waited
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 0
    stuck = {entry.run.pk: entry for entry in runs_stuck(limit=1000)}
    assert stuck[run.pk].waiting.reason == "device_offline"
    assert stuck[run.pk].waited >= timedelta(0)
    later = runs_stuck(older_than=timedelta(seconds=30), now=row.queued_at + timedelta(seconds=31))
    assert run.pk in {entry.run.pk for entry in later}


def run_list_queries(admin_api, template) -> tuple[int, list[dict]]:
    with CaptureQueriesContext(connection) as queries:
        answer = admin_api.get("/api/runs/", {"template": template.name})
    assert answer.status_code == 200, answer.content
    return len(queries), answer.json()["results"]


def test_rest_shows_why_runs_and_steps_wait_at_a_fixed_number_of_queries(stack, admin_api):
    # given one run waiting for an offline device
    run, row = offline_run()
    template = run.template

    # when the run list and the run are read
    one, listed = run_list_queries(admin_api, template)
    detail = admin_api.get(f"/api/runs/{run.pk}/").json()

    # then the run and its step carry the reason, with the device and since
    assert listed[0]["waiting"]["reason"] == "device_offline"
    assert listed[0]["waiting"]["device"] == row.device.name
    assert detail["waiting"]["reason"] == "device_offline"
    assert detail["waiting"]["since"] is not None
    assert detail["steps"][0]["waiting"]["reason"] == "device_offline"

    # when two more runs of the template wait, the page costs the same queries
    run_start(template=template)
    run_start(template=template)
    wait_for(
        lambda: StepRun.objects.filter(run__template=template, status=StepStatus.QUEUED).count() == 3,
        what="three queued rows",
    )
    three, listed = run_list_queries(admin_api, template)
    assert len(listed) == 3
    assert three == one
    assert all(item["waiting"]["reason"] == "device_offline" for item in listed)


def test_rest_shows_null_waiting_for_a_finished_run(stack, admin_api, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    run, _ = run_start(template=template_with_steps((device, "on", {})))
    wait_for(lambda: JobRun.objects.get(pk=run.pk).is_terminal, what="the run to end")

    detail = admin_api.get(f"/api/runs/{run.pk}/").json()

    assert detail["waiting"] is None
    assert detail["steps"][0]["waiting"] is None


def test_the_attention_filter_shows_steps_waiting_for_an_offline_device(stack, admin_client, manual_device):
    # given a run waiting for an offline device, and one waiting behind a busy device
    offline, _row = offline_run()
    device = DeviceFactory()
    hand = manual_device(device.name)
    run_start(template=template_with_steps((device, "long", {})))
    hand.next_command()
    behind, _ = run_start(template=template_with_steps((device, "after", {})))
    waiting_row(behind)

    # when the events are filtered for attention
    page = admin_client.get("/admin/jobs/runevent/", {"tone": "attention"})

    # then the offline wait is listed, the routine busy wait is not
    assert page.status_code == 200
    shown = {event.pk for event in page.context["cl"].result_list}
    offline_wait = RunEvent.objects.get(run=offline, kind="step.waiting")
    busy_wait = RunEvent.objects.get(run=behind, kind="step.waiting")
    assert "is offline" in offline_wait.message
    assert offline_wait.pk in shown
    assert busy_wait.pk not in shown
