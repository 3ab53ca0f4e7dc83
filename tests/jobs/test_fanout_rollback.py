"""Rollback on abort: an aborted fan-out's compensation reaches exactly the devices that
succeeded, paced by compensation_per_minute, on the real stack (SCENARIOS §6)."""

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from devtools.simulator import DeviceBehaviour
from iotqueue.redis_conn import lock_redis_connection
from jobs.cancel import run_cancel
from jobs.cli import run_load, step_lines
from jobs.deadlines import Deadline, deadline_score, deadlines_key, deadlines_set
from jobs.engine.rollout_pace import RATE_WINDOW
from jobs.models import JobRun, OnFailure, Phase, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from jobs.timeline import run_timeline
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

FLASH = "firmware/flash"
UNDO = "firmware/rollback"
HEALTHY = DeviceBehaviour()
BRICKED = DeviceBehaviour(failing_actions=frozenset({FLASH}))
# Trips once 2 of the first 5 devices failed (1 of 4 is 25 %, 2 of 5 is 40 %).
ABORT = [{"cause": "failed", "threshold_percent": 30, "min_executed": 4}]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def gateways(label: str, kinds: str, behaviours: dict[str, DeviceBehaviour] | None = None) -> dict:
    """One device per letter of `kinds`, in name order ("o": healthy, "x": fails the flash)."""
    behaviours = behaviours or {}
    fleet = {}
    for i, kind in enumerate(kinds):
        name = DeviceFactory(name=f"{label}-{i:02d}", labels={"site": label}).name
        fleet[name] = behaviours.get(name, HEALTHY if kind == "o" else BRICKED)
    return fleet


def rollout(label: str, *, hub=None, max_in_flight: int = 1, **fields) -> JobRun:
    """A template: (a hub announcing the rollout, undone by a retraction), then the flash to
    the site, one device at a time, undone by firmware/rollback under policy rollback."""
    template = JobTemplateFactory()
    if hub is not None:
        JobStepFactory(
            template=template,
            position=0,
            device=hub,
            action="rollout/announce",
            compensation_action="retract",
        )
    JobStepFactory(
        template=template,
        position=1,
        device=None,
        labels={"site": label},
        action=FLASH,
        args={"image": "v2"},
        compensation_action=UNDO,
        compensation_args={"image": "v1", "device": "{{ device.name }}"},
        on_failure=OnFailure.ROLLBACK,
        max_in_flight=max_in_flight,
        abort_criteria=ABORT,
        **fields,
    )
    run, _ = run_start(template=template)
    return run


def undo_rows(run: JobRun):
    return StepRun.objects.filter(run=run, phase=Phase.COMPENSATION, device__isnull=False).exclude(
        device__name__endswith="hub"
    )


def flashed(run: JobRun) -> set[str]:
    rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, status=StepStatus.SUCCEEDED, action=FLASH)
    return set(rows.values_list("device__name", flat=True))


def test_an_aborted_rollout_is_rolled_back_on_exactly_the_devices_that_succeeded(stack, simulator):
    # given a site of 3 healthy gateways, then 3 that fail the flash, then 3 healthy ones
    label = f"rb-{uuid.uuid4().hex[:6]}"
    hub = DeviceFactory(name=f"{label}-hub")
    fleet = gateways(label, "oooxxxooo")
    sim = simulator({**fleet, hub.name: HEALTHY})

    run = rollout(label, hub=hub)

    # then the rollout aborts after the second failure and the run ends compensated
    assert wait_for(lambda: finished(run)).status == RunStatus.COMPENSATED
    assert RunEvent.objects.filter(run=run, kind="step.aborted").exists()
    succeeded = flashed(run)
    names = sorted(fleet)
    assert succeeded == set(names[:3])
    # the compensation rows are the succeeded devices, each succeeded
    rows = undo_rows(run)
    assert set(rows.values_list("device__name", flat=True)) == succeeded
    assert set(rows.values_list("status", "index").distinct()) == {(StepStatus.SUCCEEDED, 1)}
    # each succeeded device received the rollback exactly once, with its own args; the others none
    for name in names:
        undone = [c for c in sim.received(name) if c["action"] == UNDO]
        assert len(undone) == (1 if name in succeeded else 0), name
        if undone:
            assert undone[0]["args"] == {"image": "v1", "device": name}
    # and the earlier step's compensation ran after the fan-out's rollback was over
    retract = [c["at"] for c in sim.received(hub.name) if c["action"] == "retract"]
    last_undo = max(c["at"] for name in succeeded for c in sim.received(name) if c["action"] == UNDO)
    assert len(retract) == 1 and retract[0] > last_undo
    done = RunEvent.objects.get(run=run, kind="step.compensation_done")
    assert done.data["by_status"] == {StepStatus.SUCCEEDED: 3}
    assert RunEvent.objects.filter(run=run, kind="step.compensating").count() == 1
    assert sim.stats()["totals"]["overlaps"] == 0


def test_a_device_whose_rollback_fails_is_named_and_the_run_ends_failed(stack, simulator, client):
    # given a site whose first gateway cannot roll back
    label = f"rbf-{uuid.uuid4().hex[:6]}"
    stubborn = f"{label}-00"
    hub = DeviceFactory(name=f"{label}-hub")
    fleet = gateways(label, "oooxxx", {stubborn: DeviceBehaviour(failing_actions=frozenset({UNDO}))})
    sim = simulator({**fleet, hub.name: HEALTHY})

    run = rollout(label, hub=hub)

    # then the run fails naming that gateway and why; the others are rolled back
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert f"1 of 3 devices not rolled back: {stubborn} failed" in run.error
    failed_event = RunEvent.objects.get(run=run, kind="run.failed")
    assert stubborn in failed_event.message
    done = RunEvent.objects.get(run=run, kind="step.compensation_done")
    assert [d["device"] for d in done.data["not_rolled_back"]] == [stubborn]
    rows = dict(undo_rows(run).values_list("device__name", "status"))
    assert rows == {name: StepStatus.SUCCEEDED for name in sorted(fleet)[1:3]} | {stubborn: StepStatus.FAILED}
    # and the rollback went on with the earlier step all the same
    assert [c["action"] for c in sim.received(hub.name)] == ["rollout/announce", "retract"]
    # the run page counts the fan-out's compensation rows by status, under "rollback:"
    (line,) = [line for line in run_timeline(run).plan if line.index == 1]
    assert {(status, n) for status, _label, n in line.undo} == {
        (StepStatus.SUCCEEDED, 2),
        (StepStatus.FAILED, 1),
    }
    # and the CLI's run view shows it as one line with its counts, the hub's undo as its own
    lines = step_lines(run_load(run.pk))
    assert "3/3" in lines["undo/#1"] and "failed 1, succeeded 2" in lines["undo/#1"]
    assert UNDO in lines["undo/#1"]
    assert any(key.startswith("undo/") and "retract" in line for key, line in lines.items())
    client.force_login(User.objects.create_superuser("rb-boss", "rb@example.com", "pw"))
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    assert "rollback:" in page and "step.compensation_done" in page


def test_a_device_still_at_work_when_the_rollout_aborts_is_rolled_back_once_it_succeeded(stack, simulator):
    # given a slow healthy gateway and 4 that fail the flash at once, all started together
    label = f"rbw-{uuid.uuid4().hex[:6]}"
    slow = f"{label}-00"
    fleet = gateways(label, "oxxxx", {slow: DeviceBehaviour(latency_min_ms=1500, latency_max_ms=1500)})
    sim = simulator(fleet)

    run = rollout(label, max_in_flight=0)

    # then the rollout aborts while the slow one works, the rollback waits for it, and it is
    # rolled back once it has succeeded
    assert wait_for(lambda: finished(run)).status == RunStatus.COMPENSATED
    waited = RunEvent.objects.get(run=run, kind="step.compensation_waiting")
    aborted = RunEvent.objects.get(run=run, kind="step.aborted")
    assert waited.pk > aborted.pk and waited.data["at_work"] >= 1
    assert flashed(run) == {slow}
    assert list(undo_rows(run).values_list("device__name", "status")) == [(slow, StepStatus.SUCCEEDED)]
    assert [c["action"] for c in sim.received(slow)] == [FLASH, UNDO]


def test_a_rollback_is_paced_by_its_own_rate(stack, simulator):
    # given 4 gateways that take the image, then 2 that fail it; the rollback: 2 a minute
    label = f"rbp-{uuid.uuid4().hex[:6]}"
    fleet = gateways(label, "ooooxx")
    simulator(fleet)

    run = rollout(label, compensation_per_minute=2)

    # then the rollback starts 2 devices and leaves the others pending until the pump's
    # deadline, one RATE_WINDOW after the first of them started
    rows = undo_rows(run)
    wait_for(
        lambda: rows.filter(status=StepStatus.SUCCEEDED).count() == 2 and rows.count() == 4,
        what="the first minute's 2 rollbacks",
    )
    assert rows.filter(status=StepStatus.PENDING).count() == 2
    started = rows.filter(status=StepStatus.SUCCEEDED)
    first_pending = rows.filter(status=StepStatus.PENDING).order_by("pk").first()
    pump = Deadline("pump", first_pending.pk, 0)
    oldest = min(started.values_list("queued_at", flat=True))
    due = wait_for(
        lambda: lock_redis_connection().zscore(deadlines_key(pump.shard), pump.member),
        what="the pump deadline",
    )
    assert due == deadline_score(oldest + RATE_WINDOW)
    event = RunEvent.objects.get(run=run, kind="step.compensating")
    assert event.data["compensation_per_minute"] == 2 and event.data["devices"] == 4
    assert finished(run) is None and run.status == RunStatus.COMPENSATING

    # when the minute has passed (the started rows' window moved back, the deadline due now)
    started.update(queued_at=timezone.now() - 2 * RATE_WINDOW)
    deadlines_set({pump: timezone.now() - timedelta(seconds=1)})

    # then the pump starts the other 2 and the run ends compensated
    assert wait_for(lambda: finished(run)).status == RunStatus.COMPENSATED
    assert set(rows.values_list("device__name", flat=True)) == flashed(run)


def test_a_canceled_rollout_is_not_rolled_back(stack, simulator):
    # given a rollout under policy rollback whose devices never answer
    label = f"rbc-{uuid.uuid4().hex[:6]}"
    simulator({name: DeviceBehaviour(silent=True) for name in gateways(label, "oo")})
    run = rollout(label)
    wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.DISPATCHED).exists(), what="a dispatch"
    )

    # when an operator cancels it
    assert run_cancel(run=run, by="release-manager")

    # then the run is canceled, not compensating: cancel means stop, no rollback is started
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED
    assert not StepRun.objects.filter(run=run, phase=Phase.COMPENSATION).exists()
    assert not RunEvent.objects.filter(run=run, kind="run.compensating").exists()


def test_canceling_a_run_that_rolls_back_stops_its_rollback(stack, simulator):
    # given a rollback at 1 a minute: its first device rolled back, the other 2 pending
    label = f"rbs-{uuid.uuid4().hex[:6]}"
    simulator(gateways(label, "oooxx"))
    run = rollout(label, compensation_per_minute=1)
    rows = undo_rows(run)
    wait_for(
        lambda: (
            rows.filter(status=StepStatus.SUCCEEDED).count() == 1
            and rows.filter(status=StepStatus.PENDING).count() == 2
        ),
        what="the first minute's rollback",
    )

    # when an operator cancels the run
    assert run_cancel(run=run, by="release-manager")

    # then the run is canceled and the rollback's pending rows with it
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED
    assert sorted(rows.values_list("status", flat=True)) == [
        StepStatus.CANCELED,
        StepStatus.CANCELED,
        StepStatus.SUCCEEDED,
    ]
