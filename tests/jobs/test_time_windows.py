"""Time windows on the real path: maintenance windows, quiet hours in a device's own time
zone, urgent steps, a run's start-not-before and end-by (jobs/timewindows.py,
jobs/engine/holds.py, jobs/run_windows.py)."""

import uuid
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone

from devices.models import DeviceGroup
from devtools.simulator import DeviceBehaviour
from jobs.models import (
    ContinuousFanout,
    EndBehaviour,
    JobRun,
    MaintenanceWindow,
    RunEvent,
    RunStatus,
    StepRun,
    StepStatus,
)
from jobs.run_windows import RUN_END_BY
from jobs.services import run_start
from jobs.waiting import step_waiting
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# A window opens on a whole minute: a test waits for the next one, so at most this long.
MINUTE_WAIT_SECONDS = 90.0
# A hold ends this far ahead: room for the test to see it held before it ends.
HELD_SECONDS = 8


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def row_of(run: JobRun, index: int = 0) -> StepRun | None:
    return StepRun.objects.select_related("run", "device").filter(run=run, index=index).first()


def held(run: JobRun, index: int = 0) -> StepRun | None:
    """The run's row once the engine held it (its `step.held` event is written)."""
    row = row_of(run, index)
    return (
        row if row is not None and RunEvent.objects.filter(step_run=row, kind="step.held").exists() else None
    )


def next_whole_minute(now: datetime) -> datetime:
    """The next whole minute at least HELD_SECONDS away (the test sees the command held first)."""
    opening = (now + timedelta(minutes=1)).replace(second=0, microsecond=0)
    return opening if opening - now >= timedelta(seconds=HELD_SECONDS) else opening + timedelta(minutes=1)


def test_a_command_outside_its_groups_window_waits_until_the_window_opens(stack, simulator):
    # given a device of group `stores` and a window for that group opening at the next
    # whole minute (UTC) for 5 minutes
    device = DeviceFactory()
    stores = DeviceGroup.objects.create(name=f"stores-{device.name}")
    device.groups.add(stores)
    sim = simulator({device.name: DeviceBehaviour()})
    opening = next_whole_minute(timezone.now())
    MaintenanceWindow.objects.create(
        name=f"night-{device.name}",
        cron=f"{opening.minute} {opening.hour} * * *",
        duration_minutes=5,
        timezone="UTC",
        group=stores,
    )

    # when a run of one command to it starts
    run, _ = run_start(template=template_with_steps((device, "firmware/update", {})))

    # then its row is held, queued, and the reason names the window and when it opens
    row = wait_for(lambda: held(run), what="the command held")
    assert row.status == StepStatus.QUEUED
    waiting = step_waiting(row)
    assert waiting.reason == "window"
    assert waiting.until == opening
    assert f"night-{device.name}" in waiting.message
    assert "opens at" in waiting.message

    # and the command goes when the window opens, not before
    assert wait_for(lambda: finished(run), timeout=MINUTE_WAIT_SECONDS).status == RunStatus.SUCCEEDED
    row.refresh_from_db()
    assert row.dispatched_at >= opening
    assert len(sim.received(device.name)) == 1


def test_a_device_in_its_quiet_hours_waits_and_an_urgent_step_goes_through(stack, simulator):
    # given two devices in Tokyo whose quiet hours began an hour ago (local time) and end
    # shortly
    tokyo = ZoneInfo("Asia/Tokyo")
    local = timezone.now().astimezone(tokyo)
    quiet = {
        "timezone": "Asia/Tokyo",
        "quiet_hours_start": (local - timedelta(hours=1)).time().replace(microsecond=0),
        "quiet_hours_end": (local + timedelta(seconds=HELD_SECONDS)).time().replace(microsecond=0),
    }
    calm, urgent = DeviceFactory(**quiet), DeviceFactory(labels={"tz": "Asia/Tokyo"})
    # (the second has its time zone as a label)
    urgent.quiet_hours_start, urgent.quiet_hours_end = quiet["quiet_hours_start"], quiet["quiet_hours_end"]
    urgent.save()
    simulator({calm.name: DeviceBehaviour(), urgent.name: DeviceBehaviour()})
    urgent_template = template_with_steps((urgent, "reboot", {}))
    urgent_template.steps.update(urgent=True)

    # when a run to each starts
    waits, _ = run_start(template=template_with_steps((calm, "reboot", {})))
    goes, _ = run_start(template=urgent_template)

    # then the urgent step goes through at once, in the quiet hours
    assert wait_for(lambda: finished(goes)).status == RunStatus.SUCCEEDED
    assert not RunEvent.objects.filter(run=goes, kind="step.held").exists()
    # and the other waits for the end of the quiet hours, saying so, then goes
    row = wait_for(lambda: held(waits), what="the command held")
    waiting = step_waiting(row)
    assert waiting.reason == "quiet_hours"
    assert waiting.until is not None and waiting.until.astimezone(tokyo).time() == quiet["quiet_hours_end"]
    assert wait_for(lambda: finished(waits)).status == RunStatus.SUCCEEDED
    row.refresh_from_db()
    assert row.dispatched_at >= waiting.until


def test_a_run_starts_at_its_start_not_before(stack, simulator):
    # given a device and a run that may not start for 2 seconds
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    not_before = timezone.now() + timedelta(seconds=2)

    # when it is started
    run, _ = run_start(template=template_with_steps((device, "check", {})), not_before=not_before)

    # then it stays pending, and it starts (and succeeds) only once that time came
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.PENDING
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    assert run.started_at >= not_before


def test_at_its_end_by_a_run_that_cancels_stops_its_command_at_work(stack, manual_device):
    # given a run of two commands, the first sent to a device that does not answer, and an
    # end-by 2 seconds ahead that cancels
    device = DeviceFactory()
    hand = manual_device(device.name)
    end_by = timezone.now() + timedelta(seconds=2)
    template = template_with_steps((device, "first", {}), (device, "second", {}))
    run, _ = run_start(template=template, end_by=end_by, end_behaviour=EndBehaviour.CANCEL)
    first = hand.next_command()

    # then at its end-by the run is canceled, its command at work too (the device is told)
    assert wait_for(lambda: finished(run)).status == RunStatus.CANCELED
    assert "end by" in run.error
    assert hand.next_command()["args"] == {"id": first["id"]}
    assert row_of(run).status == StepStatus.CANCELED
    assert row_of(run, 1) is None


def test_at_its_end_by_a_run_that_finishes_lets_its_command_finish_and_starts_nothing_new(
    stack, manual_device
):
    # given the same run with an end-by that lets what started finish
    device = DeviceFactory()
    hand = manual_device(device.name)
    end_by = timezone.now() + timedelta(seconds=2)
    template = template_with_steps((device, "first", {}), (device, "second", {}))
    run, _ = run_start(template=template, end_by=end_by, end_behaviour=EndBehaviour.FINISH)
    first = hand.next_command()

    # when its end-by came (the run says it is ending) and the device then answers
    wait_for(lambda: RunEvent.objects.filter(run=run, kind="run.ending").exists(), what="run.ending")
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.RUNNING
    hand.done(first["id"])

    # then the first command succeeded, the second never started, and the run ended canceled
    assert wait_for(lambda: finished(run)).status == RunStatus.CANCELED
    assert "did not run" in run.error
    assert row_of(run).status == StepStatus.SUCCEEDED
    assert row_of(run, 1) is None


def test_a_fanout_holds_only_its_device_in_quiet_hours(stack, simulator):
    # given a labelled fleet of three, one of them in Tokyo in its quiet hours (its time zone
    # as a `tz` label) for a few more seconds
    label = f"shelf-{uuid.uuid4().hex[:6]}"
    local = timezone.now().astimezone(ZoneInfo("Asia/Tokyo"))
    end_at = (local + timedelta(seconds=HELD_SECONDS)).replace(microsecond=0)
    end = end_at.time()
    quiet = DeviceFactory(
        labels={"kind": label, "tz": "Asia/Tokyo"},
        quiet_hours_start=(local - timedelta(hours=1)).time().replace(microsecond=0),
        quiet_hours_end=end,
    )
    others = [DeviceFactory(labels={"kind": label}) for _ in range(2)]
    simulator({device.name: DeviceBehaviour() for device in [quiet, *others]})
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/flash")

    # when the fan-out runs
    run, _ = run_start(template=step.template)

    # then the other two are flashed while the Tokyo one waits for the end of its quiet hours
    def others_done():
        rows = StepRun.objects.filter(run=run, device__in=others, status=StepStatus.SUCCEEDED)
        return rows.count() == len(others)

    held_row = wait_for(
        lambda: StepRun.objects.filter(run=run, device=quiet, events__kind="step.held").first(),
        what="the Tokyo gateway held",
    )
    wait_for(others_done, what="the others flashed")
    # and then it goes too, after the end of its quiet hours
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    held_row.refresh_from_db()
    assert held_row.status == StepStatus.SUCCEEDED
    assert held_row.dispatched_at >= end_at


def test_a_command_handed_its_device_in_quiet_hours_hands_it_on_and_waits(stack, manual_device):
    # given a device whose quiet hours begin in a few seconds and last a few more, and two
    # runs on it: the first's command at work, the second's queued behind it
    local = timezone.now().astimezone(ZoneInfo("Asia/Tokyo"))
    begins = (local + timedelta(seconds=3)).replace(microsecond=0)
    ends = begins + timedelta(seconds=HELD_SECONDS)
    device = DeviceFactory(
        timezone="Asia/Tokyo", quiet_hours_start=begins.time(), quiet_hours_end=ends.time()
    )
    hand = manual_device(device.name)
    first, _ = run_start(template=template_with_steps((device, "first", {})))
    command = hand.next_command()
    second, _ = run_start(template=template_with_steps((device, "second", {})))
    wait_for(lambda: RunEvent.objects.filter(run=second, kind="step.waiting").exists(), what="queued behind")

    # when the first answers once the quiet hours began
    wait_for(lambda: timezone.now() >= begins, what="the quiet hours")
    hand.done(command["id"])

    # then the second, handed the device, gives it up and waits for their end, then goes
    assert wait_for(lambda: finished(first)).status == RunStatus.SUCCEEDED
    row = wait_for(lambda: held(second), what="the handed command held")
    assert step_waiting(row).reason == "quiet_hours" or row_of(second).status != StepStatus.QUEUED
    later = hand.next_command(timeout=30)
    assert later["run"] == str(second.pk)
    assert row_of(second).dispatched_at >= ends
    hand.done(later["id"])
    assert wait_for(lambda: finished(second)).status == RunStatus.SUCCEEDED


def test_at_a_finishing_end_by_a_continuous_fanout_closes_and_is_decided_when_its_command_ends(
    stack, manual_device
):
    # given a continuous fan-out over one device that does not answer yet, in a run whose
    # end-by, 2 seconds ahead, lets what started finish
    label = f"eb-{uuid.uuid4().hex[:6]}"
    device = DeviceFactory(labels={"kind": label})
    hand = manual_device(device.name)
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/flash", continuous=True)
    run, _ = run_start(
        template=step.template,
        end_by=timezone.now() + timedelta(seconds=2),
        end_behaviour=EndBehaviour.FINISH,
    )
    first = hand.next_command()

    # when its end-by came: the fan-out closed (no device joins it any more)
    wait_for(
        lambda: ContinuousFanout.objects.filter(run=run, closed_by=RUN_END_BY).exists(),
        what="the fan-out closed at the run's end-by",
    )
    DeviceFactory(labels={"kind": label})
    # and the device's command then ends
    hand.done(first["id"])

    # then the step is decided over its one device, and the run ends (nothing new started)
    assert wait_for(lambda: finished(run)).status != RunStatus.RUNNING
    assert RunEvent.objects.filter(run=run, kind="step.fanout_done").exists()
    assert StepRun.objects.filter(run=run).count() == 1


def test_at_a_finishing_end_by_a_fanout_in_waves_opens_no_wave_and_is_decided(stack, manual_device):
    # given a fan-out in two waves (the first behind an approval gate) over two devices, in
    # a run whose end-by, 2 seconds ahead, lets what started finish
    label = f"ebw-{uuid.uuid4().hex[:6]}"
    devices = [DeviceFactory(name=f"{label}-{n}", labels={"kind": label}) for n in range(2)]
    hands = {device.name: manual_device(device.name) for device in devices}
    step = JobStepFactory(
        device=None,
        labels={"kind": label},
        action="firmware/flash",
        waves=[{"count": 1, "gate": "approval"}, {"rest": True}],
    )
    run, _ = run_start(
        template=step.template,
        end_by=timezone.now() + timedelta(seconds=2),
        end_behaviour=EndBehaviour.FINISH,
    )
    first = wait_for(lambda: StepRun.objects.filter(run=run).exclude(status=StepStatus.PENDING).first())
    command = hands[first.device.name].next_command()

    # when its end-by came (the second wave's device is skipped) and the first command ends
    wait_for(lambda: RunEvent.objects.filter(run=run, kind="run.ending").exists(), what="run.ending")
    hands[first.device.name].done(command["id"])

    # then no gate waits for a decision: the step is decided and the run ends
    assert wait_for(lambda: finished(run)).status != RunStatus.RUNNING
    assert not RunEvent.objects.filter(run=run, kind="rollout.awaiting_approval").exists()
    assert StepRun.objects.get(
        run=run, device=devices[1] if first.device == devices[0] else devices[0]
    ).status == (StepStatus.SKIPPED)
