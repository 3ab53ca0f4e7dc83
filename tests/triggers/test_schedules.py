"""Schedules: a real DatabaseScheduler beat fires them; the overlap policy decides each fire."""

from datetime import timedelta

import pytest
from django.utils import timezone

from devtools.processes import Supervisor, beat_argv
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, Trigger
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps
from triggers import schedules
from triggers.models import Overlap, Schedule, ScheduledRun
from triggers.schedules import schedule_fire, schedule_save

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# The production scheduler: django-celery-beat's, behind the beat lease.
DATABASE_SCHEDULER = "iotqueue.beat_lease:LeasedDatabaseScheduler"
# After disabling, beat must stay quiet while it sends another every-second schedule this
# many times (each send is a tick in which the disabled one would have been due too).
SETTLE_PERIODS = 3


@pytest.fixture
def database_beat(stack, tmp_path):
    """A beat on the django-celery-beat DatabaseScheduler (the stack's beat reads a file).

    --max-interval 1 makes it look at the schedule table at least every second. Its lease
    has a key of its own, or it would stand by behind the stack's beat. The stack's monitor
    interval (0.5 s) is rounded up to a whole second in the table.
    """
    env = {**stack.supervisor.env, "IOTQUEUE_REDIS_KEY_PREFIX": f"{stack.services.namespace}-database-beat"}
    supervisor = Supervisor(tmp_path, env)
    supervisor.start("beat", [*beat_argv(tmp_path, scheduler=DATABASE_SCHEDULER), "--max-interval=1"])
    try:
        supervisor.wait_for_log("beat", r"beat: Starting")
        yield supervisor
    finally:
        supervisor.stop_all()


def scheduled_runs(name: str):
    return JobRun.objects.filter(trigger=Trigger.SCHEDULE, triggered_by=f"schedule {name}")


def sends(beat: Supervisor, schedule: str, *, since: int) -> int:
    """How many times beat sent the schedule's task after log offset `since`."""
    return beat.children["beat"].log_text()[since:].count(f"Sending due task iotqueue schedule {schedule} ")


def test_schedule_from_rest_fires_through_beat_until_disabled(database_beat, simulator, admin_api):
    # given a pump with a firmware-check template, and beat already firing another schedule
    # every second (on a lamp), whose sends show beat ticking
    pump, lamp = DeviceFactory(), DeviceFactory()
    simulator({pump.name: DeviceBehaviour(), lamp.name: DeviceBehaviour()})
    template = template_with_steps((pump, "firmware/check", {"channel": "{{ params.channel }}"}))
    schedule_save(
        schedule=Schedule(
            name="lamp ping", template=template_with_steps((lamp, "ping", {})), interval_seconds=1
        )
    )

    # when a schedule firing every second is created over REST
    response = admin_api.post(
        "/api/schedules/",
        {
            "name": "pump check",
            "template": template.name,
            "parameters": {"channel": "stable"},
            "interval_seconds": 1,
        },
        format="json",
    )
    assert response.status_code == 201, response.content

    # then beat fires it and its runs succeed
    wait_for(
        lambda: scheduled_runs("pump check").filter(status=RunStatus.SUCCEEDED).count() >= 2,
        what="two successful scheduled runs",
    )
    assert scheduled_runs("pump check").first().parameters == {"channel": "stable"}
    assert (
        ScheduledRun.objects.filter(schedule__name="pump check").count()
        == scheduled_runs("pump check").count()
    )

    assert "Sending due task iotqueue schedule pump check" in database_beat.children["beat"].log_text()

    # when it is disabled over REST
    log_offset = database_beat.log_size("beat")
    assert admin_api.patch("/api/schedules/pump check/", {"enabled": False}, format="json").status_code == 200
    runs_when_disabled = scheduled_runs("pump check").count()

    # then beat notices, stops sending it, and no run starts any more
    database_beat.wait_for_log("beat", r"DatabaseScheduler: Schedule changed", since=log_offset)
    noticed = database_beat.log_size("beat")
    # What proves it: beat sends the lamp's schedule SETTLE_PERIODS more times; in each of
    # those ticks the pump's, due every second as well, would have been sent too.
    wait_for(
        lambda: sends(database_beat, "lamp ping", since=noticed) >= SETTLE_PERIODS,
        what=f"beat to send the other schedule {SETTLE_PERIODS} times",
    )
    assert sends(database_beat, "pump check", since=noticed) == 0
    assert scheduled_runs("pump check").count() == runs_when_disabled


def schedule_make(template, overlap: str, **fields) -> Schedule:
    return schedule_save(
        schedule=Schedule(
            name=f"every minute {overlap}", template=template, interval_seconds=60, overlap=overlap, **fields
        )
    )


def fire_next(schedule: Schedule) -> JobRun | None:
    """Fire as beat would one period after the previous fire."""
    Schedule.objects.filter(pk=schedule.pk).update(last_fired_at=timezone.now() - timedelta(seconds=60))
    return schedule_fire(schedule_id=schedule.pk)


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def test_skip_policy_skips_fires_while_the_previous_run_is_active(stack, manual_device):
    # given a run of the schedule that its device is still working on
    device = DeviceFactory()
    terminal = manual_device(device.name)
    schedule = schedule_make(template_with_steps((device, "firmware/check", {})), Overlap.SKIP)
    first = fire_next(schedule)
    command = terminal.next_command()

    # when the schedule fires again
    assert fire_next(schedule) is None

    # then the fire is skipped and recorded on the active run's timeline
    skipped = RunEvent.objects.get(kind="schedule.skipped")
    assert skipped.run_id == first.pk and "fire 2 skipped" in skipped.message
    assert scheduled_runs(schedule.name).count() == 1

    # when the run ends, the next fire starts a run again
    terminal.done(command["id"])
    wait_for(lambda: finished(first), what="the first run to end")
    second = fire_next(schedule)
    assert second is not None and second.idempotency_key == f"schedule:{schedule.pk}:3"


def test_queue_policy_starts_one_waiting_fire_when_the_run_ends(stack, manual_device):
    # given a run of the schedule that its device is still working on
    device = DeviceFactory()
    terminal = manual_device(device.name)
    schedule = schedule_make(template_with_steps((device, "firmware/check", {})), Overlap.QUEUE)
    first = fire_next(schedule)
    command = terminal.next_command()

    # when it fires twice more while the run is active
    assert fire_next(schedule) is None
    assert fire_next(schedule) is None

    # then one fire waits and the other is skipped
    assert RunEvent.objects.get(kind="schedule.queued", run=first).data["fire"] == 2
    assert "fire 2 is already waiting" in RunEvent.objects.get(kind="schedule.skipped").message

    # when the run ends, the worker starts the waiting fire at once, and only that one
    terminal.done(command["id"])
    second_command = terminal.next_command()
    assert second_command["run"] != str(first.pk)
    links = list(
        ScheduledRun.objects.filter(schedule=schedule).order_by("fire").values_list("fire", flat=True)
    )
    assert links == [1, 2]
    assert Schedule.objects.get(pk=schedule.pk).queued_fire is None


def test_allow_policy_starts_runs_side_by_side(stack, manual_device):
    device = DeviceFactory()
    terminal = manual_device(device.name)
    schedule = schedule_make(template_with_steps((device, "firmware/check", {})), Overlap.ALLOW)
    first = fire_next(schedule)
    terminal.next_command()

    second = fire_next(schedule)

    assert second is not None and second.pk != first.pk
    assert not RunEvent.objects.filter(kind__startswith="schedule.").exists()


def test_a_duplicate_or_disabled_fire_starts_nothing(stack):
    schedule = schedule_make(template_with_steps((DeviceFactory(), "firmware/check", {})), Overlap.ALLOW)

    # a second fire within half a period (two beats, or one slot fired twice) is a duplicate
    assert fire_next(schedule) is not None
    assert schedule_fire(schedule_id=schedule.pk) is None

    # a fire beat sent before it noticed the schedule was disabled
    schedule.enabled = False
    schedule_save(schedule=schedule)
    assert fire_next(schedule) is None
    assert scheduled_runs(schedule.name).count() == 1


def test_a_template_without_steps_records_the_failed_fire(stack):
    schedule = schedule_make(JobTemplateFactory(), Overlap.SKIP)

    assert fire_next(schedule) is None

    event = RunEvent.objects.get(kind="schedule.failed")
    assert "no steps" in event.message and event.data == {"schedule": schedule.name, "fire": 1}


@pytest.mark.parametrize("trigger", [Trigger.REST, Trigger.CANVAS])
def test_the_end_of_a_run_no_schedule_started_reads_no_schedule(trigger, django_assert_num_queries):
    # given the end event of a run started otherwise than by a schedule, its run at hand
    # (as the engine's batch has it)
    run = JobRun.objects.create(template=JobTemplateFactory(), plan=[], trigger=trigger)
    event = RunEvent(run=run, kind="run.succeeded")

    # when the schedules' receiver sees it, inside the engine's transaction
    # then it asks the database nothing
    with django_assert_num_queries(0):
        schedules.run_ended(sender=RunEvent, event=event)


def test_the_end_of_a_scheduled_run_looks_for_its_schedule(django_assert_num_queries):
    run = JobRun.objects.create(template=JobTemplateFactory(), plan=[], trigger=Trigger.SCHEDULE)
    with django_assert_num_queries(1):
        schedules.run_ended(sender=RunEvent, event=RunEvent(run=run, kind="run.succeeded"))
    # and so does one whose run is not at hand
    with django_assert_num_queries(1):
        schedules.run_ended(sender=RunEvent, event=RunEvent(run_id=run.pk, kind="run.succeeded"))
