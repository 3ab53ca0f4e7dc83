"""A fan-out's pump starts its rows as batched transitions (jobs/engine/batch.py rows_start):
one lock call for the rows, the granted ones dispatched in one transaction, their commands
published together; rows whose device is busy, offline or flow-controlled wait their turn
as any step does."""

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from devtools.simulator import DeviceBehaviour
from jobs.engine import fanout
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.monitor import fanouts_unpumped
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def test_a_pump_dispatches_its_free_devices_in_one_transition_and_the_others_wait_their_turn(
    stack, simulator
):
    label = f"batch-{uuid.uuid4().hex[:6]}"
    fleet = [DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}) for i in range(12)]
    busy, offline, spaced, free = fleet[0], fleet[1], fleet[2], fleet[3:]
    offline.online = False
    offline.save(update_fields=["online"])
    spaced.min_interval_seconds = 0.2
    spaced.save(update_fields=["min_interval_seconds"])
    slow = DeviceBehaviour(latency_min_ms=1500, latency_max_ms=1500)
    sim = simulator({d.name: slow if d == busy else DeviceBehaviour() for d in fleet if d != offline})
    # The busy device holds another run's command while the fan-out starts.
    holding, _ = run_start(template=template_with_steps((busy, "hold", {})))
    wait_for(
        lambda: StepRun.objects.filter(run=holding, status__in=["dispatched", "in_progress"]).exists(),
        what="the busy device's own command",
    )
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check")

    run, _ = run_start(template=step.template)

    rows = StepRun.objects.filter(run=run)
    wait_for(
        lambda: rows.filter(device__in=free).exclude(dispatched_at=None).count() == len(free),
        what="the free devices' rows dispatched",
    )
    # One transition dispatched them all: one `now` for every row (the general path takes
    # one per row).
    assert len(set(rows.filter(device__in=free).values_list("dispatched_at", flat=True))) == 1
    waiting = RunEvent.objects.filter(run=run, kind="step.waiting").values_list("message", flat=True)
    assert any("busy" in message for message in waiting), list(waiting)
    assert any("offline" in message for message in waiting), list(waiting)

    simulator({offline.name: DeviceBehaviour()})
    assert wait_for(lambda: finished(run), timeout=60).status == RunStatus.SUCCEEDED
    assert finished(holding).status == RunStatus.SUCCEEDED
    assert set(rows.values_list("status", flat=True)) == {StepStatus.SUCCEEDED}
    fanned = [c for d in fleet if d != offline for c in sim.received(d.name) if c["action"] != "hold"]
    assert len(fanned) == len(fleet) - 1  # each once; the offline device's came to its own simulator
    assert sim.stats()["totals"]["overlaps"] == 0
    assert RunEvent.objects.filter(run=run, kind="step.spaced").count() <= 1


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's planner statistics")
def test_a_large_fanout_has_its_rows_table_analyzed_at_once():
    # Where autovacuum is late (or off, as on some CI machines) the planner would walk a
    # 100,000-row step at every row end; the fan-out refreshes the statistics itself.
    def last_analyze():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT last_analyze FROM pg_stat_user_tables WHERE relname = %s", [StepRun._meta.db_table]
            )
            return cursor.fetchone()[0]

    before = last_analyze()
    fanout._statistics_refresh(fanout.FANOUT_ANALYZE_ROWS)
    wait_for(lambda: last_analyze() is not None and last_analyze() != before, what="the table analyzed")


def test_a_running_fanout_whose_rows_all_wait_pending_is_pumped_by_the_monitors_sweep(stack, simulator):
    # given a running fan-out whose rows were made but never pumped (its start was cut right
    # after they committed: no pump, no `pump` deadline), nothing at work
    label = f"unpumped-{uuid.uuid4().hex[:6]}"
    fleet = [DeviceFactory(name=f"{label}-{i}", labels={"kind": label}) for i in range(3)]
    sim = simulator({d.name: DeviceBehaviour() for d in fleet})
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check")
    later = timezone.now() + timedelta(hours=1)
    run, _ = run_start(template=step.template, not_before=later)
    an_hour_ago = timezone.now() - timedelta(hours=1)
    JobRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=an_hour_ago)
    StepRun.objects.bulk_create(
        [StepRun(run=run, index=0, device=d, action="firmware/check", args={}) for d in fleet]
    )

    # when the monitor's database sweep runs
    pumped = fanouts_unpumped(started_before=timezone.now())

    # then it set the fan-out's pump due, and the pump started every row: the run succeeds
    assert pumped >= 1
    assert wait_for(lambda: finished(run), timeout=60).status == RunStatus.SUCCEEDED
    assert sorted(c["action"] for d in fleet for c in sim.received(d.name)) == ["firmware/check"] * 3


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks (SQLite has one writer at a time)")
def test_a_second_start_of_a_fanout_while_the_first_works_does_nothing_and_holds_no_worker(stack):
    # given a running run at a fan-out step whose start holds the run's row lock (the first
    # start, still expanding the step), in another connection
    label = f"second-{uuid.uuid4().hex[:6]}"
    for i in range(3):
        DeviceFactory(name=f"{label}-{i}", labels={"kind": label})
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check")
    run, _ = run_start(template=step.template, not_before=timezone.now() + timedelta(hours=1))
    JobRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=timezone.now())
    locked, second_done = threading.Event(), threading.Event()

    def first_start() -> None:
        try:
            with transaction.atomic():
                JobRun.objects.select_for_update().get(pk=run.pk)
                locked.set()
                second_done.wait(timeout=30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=first_start)
    holder.start()
    assert locked.wait(timeout=30)

    # when a second start comes meanwhile (the monitor's sweep saw no row yet)
    fanout.fanout_expand(run_id=str(run.pk), index=0)
    second_done.set()
    holder.join(timeout=30)

    # then it returned at once, with the lock still held elsewhere, and made nothing
    assert not StepRun.objects.filter(run=run).exists()
    # and a start once the first is gone makes the rows
    fanout.fanout_expand(run_id=str(run.pk), index=0)
    assert StepRun.objects.filter(run=run).count() == 3
