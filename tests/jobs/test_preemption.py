"""Urgent preemption on the real path: an urgent step of a high-priority run takes a busy
simulated device from a lower-priority command in flight, which is canceled on the device
and runs again afterwards; a high-priority step that is not urgent waits its turn.

The stack runs with IOTQUEUE_PREEMPT_PRIORITY=8 (tests/conftest.py).
"""

from itertools import pairwise

import pytest
from django.db.models import Q

from devices.locks import device_lock_state
from devtools.simulator import DeviceBehaviour
from jobs.engine.plan import step_holder
from jobs.models import RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Long enough that the urgent run arrives while the download is in flight, on a loaded CI
# machine too; the download then runs again in full.
DOWNLOAD_MS = 6000.0


def template(device, action, *, urgent=False):
    made = template_with_steps((device, action, {}))
    made.steps.update(urgent=urgent, timeout_seconds=60)
    return made


def in_progress(run) -> StepRun | None:
    return StepRun.objects.filter(run=run, status=StepStatus.IN_PROGRESS).first()


def ended(*runs) -> bool:
    for run in runs:
        run.refresh_from_db()
    return all(run.status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED) for run in runs)


def intervals_disjoint(spans: list[tuple[float, float]]) -> bool:
    spans = sorted(spans)
    return all(end <= next_start for (_, end), (next_start, _) in pairwise(spans))


@pytest.fixture(autouse=True)
def _preempt_from_priority_8(settings):
    """As the stack's processes run (should a transition run in this process too)."""
    settings.IOTQUEUE_PREEMPT_PRIORITY = 8


@pytest.fixture
def busy_device(stack, simulator):
    """A device busy with a long, low-priority download (acknowledged: in flight)."""
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(action_latency_ms=(("download", DOWNLOAD_MS),))})
    low, _ = run_start(template=template(device, "download"), priority=2)
    first = wait_for(lambda: in_progress(low), what="the download in flight")
    return device, sim, low, first


def test_an_urgent_run_preempts_the_download_which_runs_again_without_overlap(busy_device):
    device, sim, low, first = busy_device

    # when an urgent step of a priority-9 run asks for the device
    urgent, _ = run_start(template=template(device, "unlock", urgent=True), priority=9)

    # then both runs succeed: the urgent one first, then the download again
    wait_for(lambda: ended(low, urgent), what="both runs ending")
    assert (low.status, urgent.status) == (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED)
    low_row = StepRun.objects.get(run=low)
    urgent_row = StepRun.objects.get(run=urgent)
    assert low_row.attempt == first.attempt + 1 and low_row.fence > urgent_row.fence > first.fence

    # the timelines say who preempted whom
    preempted = RunEvent.objects.get(run=low, kind="step.preempted")
    assert preempted.data["by_run"] == str(urgent.pk) and preempted.data["command_id"] == first.command_id
    took = RunEvent.objects.get(run=urgent, kind="step.preempted")
    assert took.data["preempted_run"] == str(low.pk)

    # the device got the cancel before the urgent command, and the download again after it
    received = sim.received(device.name)
    assert [(r["action"], r["id"] if r["action"] != "cancel" else r["args"]["id"]) for r in received] == [
        ("download", first.command_id),
        ("cancel", first.command_id),
        ("unlock", urgent_row.command_id),
        ("download", low_row.command_id),
    ]
    assert sim.stats()["totals"]["canceled"] == 1

    # the canceled command's late done was refused as stale; the row ran again anyway
    # (named as the row's command while it waits, as an earlier attempt's once it ran again)
    late = Q(data__command_id=first.command_id) | Q(data__reply_id=first.command_id)
    stale = RunEvent.objects.filter(late, run=low, kind="reply.stale")
    wait_for(stale.exists, what="the canceled download's done refused as stale")

    # never two commands in hand on the device: the oracle saw none, and the spans between
    # each command's receipt and its done (or cancel) do not overlap
    assert sim.overlaps == [] and sim.token_regressions == []
    spans = [(r["received_at"], r["done_at"]) for r in received if r["action"] != "cancel"]
    assert len(spans) == 3 and intervals_disjoint(spans), spans


def test_a_high_priority_run_that_is_not_urgent_waits_its_turn(busy_device):
    device, sim, low, first = busy_device

    # when a priority-9 run whose step is not urgent asks for the device
    high, _ = run_start(template=template(device, "unlock"), priority=9)

    # then it waits in the device's queue (observable), and the download is left alone
    high_row = wait_for(lambda: StepRun.objects.filter(run=high).first(), what="the high run's row")
    wait_for(
        lambda: device_lock_state(device.name).queue == [step_holder(high_row)],
        what="the high run's step queued behind the download",
    )
    wait_for(lambda: RunEvent.objects.filter(run=high, kind="step.waiting").exists(), what="its step.waiting")
    assert device_lock_state(device.name).holder == step_holder(first)
    assert StepRun.objects.get(pk=first.pk).command_id == first.command_id
    assert not RunEvent.objects.filter(kind="step.preempted", run__in=[low, high]).exists()

    # and it runs once the download has finished, which was never canceled
    wait_for(lambda: ended(low, high), what="both runs ending")
    assert (low.status, high.status) == (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED)
    assert StepRun.objects.get(pk=first.pk).attempt == first.attempt
    assert sim.stats()["totals"]["canceled"] == 0 and sim.overlaps == []
