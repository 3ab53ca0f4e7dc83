"""Lists an operator can read: the run list says which step each run is at, how far it is and
why it waits; the device list shows labels, presence since when, the run on the device and
its queue; the run page draws its time view and each waiting step's reason; and the lists
stay a fixed number of queries however many rows they show."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices.locks import device_lock_acquire, device_lock_dequeue, lock_epoch_start
from devices.models import Device
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, JobStep, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start, template_plan
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(90)]


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    return user


def run_at(template, *, cursor: int = 0, status=RunStatus.RUNNING, created_ago: float = 65) -> JobRun:
    """A run of `template` as the engine leaves it at step `cursor`: the steps before it
    succeeded, that one queued (waiting for its device)."""
    now = timezone.now()
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=status, cursor=cursor, started_at=now
    )
    JobRun.objects.filter(pk=run.pk).update(created_at=now - timedelta(seconds=created_ago))
    run.refresh_from_db()
    for step in template.steps.filter(position__lte=cursor):
        done = step.position < cursor
        StepRun.objects.create(
            run=run,
            index=step.position,
            device=step.device,
            action=step.action,
            status=StepStatus.SUCCEEDED if done else StepStatus.QUEUED,
            attempt=1 if done else 0,
            queued_at=now - timedelta(seconds=30),
            dispatched_at=now - timedelta(seconds=29) if done else None,
            finished_at=now - timedelta(seconds=28) if done else None,
            deadline=None if done else now + timedelta(minutes=10),
        )
    return run


def row_of(page: str, marker: str) -> str:
    """The <tr> of the changelist that contains `marker`."""
    for row in re.findall(r"<tr>.*?</tr>", page, flags=re.S):
        if marker in row:
            return row
    raise AssertionError(f"no row with {marker!r}")


# --- the run list ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_run_list_says_a_run_waits_for_its_offline_device_and_since_when(stack, simulator, client, boss):
    # given: scenario 1's Morning, whose camera is offline
    gate, cam = DeviceFactory(), DeviceFactory(online=False)
    simulator({gate.name: DeviceBehaviour()})
    Device.objects.filter(pk=cam.pk).update(last_seen=timezone.now() - timedelta(minutes=8))
    template = template_with_steps((gate, "unlock", {}), (cam, "snapshot", {}))
    # when: the run reaches the camera, through the real worker
    run, _created = run_start(template=template)
    wait_for(
        lambda: StepRun.objects.filter(run=run, index=1, status=StepStatus.QUEUED).exists(),
        what="the camera step to queue",
    )
    page = client.get("/admin/jobs/jobrun/").text
    # then: the run's row names its step, its progress and why it does not move
    row = row_of(page, str(run.pk)[:8])
    assert f"Device {cam.name} is offline since" in row
    assert 'class="iq-why iq-why-device_offline"' in row
    assert '<span class="iq-num">2/2</span> snapshot' in row
    assert '<span class="iq-bar" title="50%">' in row  # one step of two done
    assert re.search(r"<time [^>]*>\d\d:\d\d:\d\d</time>", row)  # created, to the second
    # and the run page says it for the step row too
    detail = client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").text
    assert f"Device {cam.name} is offline since" in detail and 'id="run-waiting"' in detail
    # and its event saying so is highlighted among the events
    waits = [tr for tr in re.findall(r"<tr class=[^>]*>.*?</tr>", detail, flags=re.S) if "step.waiting" in tr]
    assert waits and all('class="iq-tone-attention"' in tr for tr in waits)


def test_run_list_links_the_run_that_holds_a_busy_device(client, boss):
    # given: lamp-2 is held by Morning's step; Cleaning waits in its queue
    lock_epoch_start()
    lamp = DeviceFactory()
    morning = run_at(template_with_steps((lamp, "on", {"level": 80})))
    cleaning = run_at(template_with_steps((lamp, "on", {"level": 100})))
    holder, waiter = (run.step_runs.get() for run in (morning, cleaning))
    device_lock_acquire(lamp.name, holder=f"step:{holder.pk}", priority=5, lease_seconds=60)
    device_lock_acquire(lamp.name, holder=f"step:{waiter.pk}", priority=5, lease_seconds=60)
    try:
        row = row_of(client.get("/admin/jobs/jobrun/").text, str(cleaning.pk)[:8])
    finally:
        device_lock_dequeue(lamp.name, holder=f"step:{waiter.pk}")
    # then: the sentence names the blocker and the place in the queue, and links the blocker
    assert f"busy with run {str(morning.pk)[:8]} step #0" in row and "number 1 in its queue" in row
    assert f'class="iq-why-run" href="/admin/jobs/jobrun/{morning.pk}/change/"' in row


def test_run_list_shows_a_fan_out_progress_in_devices(client, boss):
    pumps = [DeviceFactory(labels={"site": "berlin", "kind": "pump"}) for _ in range(4)]
    template = JobTemplateFactory()
    JobStep.objects.create(template=template, position=0, labels={"kind": "pump"}, action="firmware/check")
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.RUNNING, started_at=timezone.now()
    )
    for n, pump in enumerate(pumps):
        StepRun.objects.create(
            run=run,
            index=0,
            device=pump,
            action="firmware/check",
            status=StepStatus.SUCCEEDED if n < 3 else StepStatus.PENDING,
        )
    row = row_of(client.get("/admin/jobs/jobrun/").text, str(run.pk)[:8])
    assert "3/4 devices" in row and 'style="width: 75%"' in row


# --- the device list and page ----------------------------------------------------------------


def test_device_list_shows_labels_presence_current_run_and_queue(client, boss):
    # given: a pump in Berlin working for a run, two more holders waiting; one offline camera
    lock_epoch_start()
    pump = DeviceFactory(labels={"site": "berlin", "kind": "pump"})
    offline = DeviceFactory(online=False)
    Device.objects.filter(pk=offline.pk).update(last_seen=timezone.now() - timedelta(minutes=3))
    Device.objects.filter(pk=pump.pk).update(presence_since=timezone.now() - timedelta(hours=1))
    template = template_with_steps((pump, "firmware/check", {}))
    run = run_at(template)
    step = run.step_runs.get()
    waiters = [run_at(template_with_steps((pump, "valve/open", {}))).step_runs.get() for _ in range(2)]
    device_lock_acquire(pump.name, holder=f"step:{step.pk}", priority=5, lease_seconds=60)
    for waiter in waiters:
        device_lock_acquire(pump.name, holder=f"step:{waiter.pk}", priority=5, lease_seconds=60)
    try:
        page = client.get("/admin/devices/device/").text
        detail = client.get(f"/admin/devices/device/{pump.pk}/change/").text
    finally:
        for waiter in waiters:
            device_lock_dequeue(pump.name, holder=f"step:{waiter.pk}")
    row = row_of(page, pump.name)
    # labels as links to the devices with that label
    assert '<a class="iq-label" href="?labels__kind=pump">kind=pump</a>' in row
    assert '<a class="iq-label" href="?labels__site=berlin">site=berlin</a>' in row
    # the run on the device, linked, with its step; and the queue's length
    assert (
        f'<a href="/admin/jobs/jobrun/{run.pk}/change/" title="step:{step.pk}">run {str(run.pk)[:8]}</a>'
        in row
    )
    assert "step #0 firmware/check" in row
    assert '<td class="field-queue_length">2</td>' in row
    # online since its presence last changed, not "seen" (which every heartbeat moves)
    assert 'class="iq-presence-online"' in row and "since <time" in row
    off = row_of(page, offline.name)
    assert 'class="iq-presence-offline"' in off and "since <time" in off
    # the device page names the waiting runs in order, each with why it waits
    queue = detail[detail.index("2 waiting, in order:") :]
    first, second = (queue.index(f"/admin/jobs/jobrun/{w.run_id}/change/") for w in waiters)
    assert first < second
    assert "number 1 in its queue" in detail and "number 2 in its queue" in detail


def test_device_list_label_links_filter_the_list(client, boss):
    berlin = DeviceFactory(labels={"site": "berlin"})
    paris = DeviceFactory(labels={"site": "paris"})
    page = client.get("/admin/devices/device/?labels__site=berlin").text
    assert berlin.name in page and paris.name not in page


# --- the run page ------------------------------------------------------------------------------


def test_run_page_draws_the_time_view_with_a_bar_per_step(client, boss):
    # given: a finished two-step run and a retried step
    gate, lamp = DeviceFactory(), DeviceFactory()
    template = template_with_steps((gate, "unlock", {}), (lamp, "on", {"level": 80}))
    run = run_at(template, cursor=1)
    lamp_step = run.step_runs.get(index=1)
    now = timezone.now()
    StepRun.objects.filter(pk=lamp_step.pk).update(
        status=StepStatus.SUCCEEDED, attempt=2, dispatched_at=now - timedelta(seconds=5), finished_at=now
    )
    RunEvent.objects.create(
        run=run, step_run=lamp_step, kind="step.retrying", message="no done; retry 2 of 2"
    )
    JobRun.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, finished_at=now)
    # when
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    # then: one SVG, a bar per step on its device lane, the retry marked
    assert page.count('id="run-timeview"') == 1
    bars = re.findall(r'<g id="tv-step-(\d+)" class="([^"]*)"', page)
    assert sorted(int(pk) for pk, _cls in bars) == sorted(run.step_runs.values_list("pk", flat=True))
    assert all("tv-bar" in cls.split() for _pk, cls in bars)
    assert "tv-retried" in dict(bars)[str(lamp_step.pk)] and 'class="tv-mark tv-retry"' in page
    assert 'class="tv-seg tv-seg-queued"' in page and 'class="tv-seg tv-seg-dispatched"' in page
    assert "cdn" not in page.lower()
    # event times to the millisecond
    assert re.search(r'class="iq-nowrap iq-clock"[^>]*>\d\d:\d\d:\d\d\.\d{3}<', page)


def test_time_view_refreshes_with_the_timeline_and_charts_a_fan_out(client, boss):
    pumps = [DeviceFactory(labels={"kind": "pump"}) for _ in range(3)]
    template = JobTemplateFactory()
    JobStep.objects.create(
        template=template, position=0, labels={"kind": "pump"}, action="firmware/check", rollout_per_minute=50
    )
    now = timezone.now()
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.RUNNING, started_at=now
    )
    for n, pump in enumerate(pumps):
        StepRun.objects.create(
            run=run,
            index=0,
            device=pump,
            action="firmware/check",
            status=StepStatus.SUCCEEDED if n else StepStatus.DISPATCHED,
            queued_at=now - timedelta(seconds=90),
            dispatched_at=now - timedelta(seconds=80),
            finished_at=now - timedelta(seconds=10) if n else None,
        )
    fragment = client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").text
    assert 'id="run-timeview"' in fragment and 'id="run-rollout-0"' in fragment
    assert 'class="tv-plan"' in fragment and "tv-rate-bar tv-rate-ok" in fragment
    assert "Planned: 50 a minute." in fragment and 'class="tv-now"' in fragment


# --- lists stay a fixed number of queries --------------------------------------------------------


def query_count(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200, url
    return len(queries)


@pytest.mark.parametrize("url", ["/admin/jobs/jobrun/", "/admin/devices/device/"])
def test_lists_of_fifty_rows_take_as_many_queries_as_lists_of_two(
    client, boss, url, django_assert_max_num_queries
):
    # given: two waiting runs on devices with labels and lock holders
    lock_epoch_start()

    def some(count: int) -> None:
        for _ in range(count):
            device = DeviceFactory(labels={"site": "berlin"})
            run = run_at(template_with_steps((DeviceFactory(), "unlock", {}), (device, "on", {})), cursor=1)
            step = run.step_runs.get(index=1)
            device_lock_acquire(device.name, holder=f"step:{step.pk}", priority=5, lease_seconds=60)

    some(2)
    client.get(url)  # both measured with the limits this process keeps read (jobs/limits.py)
    few = query_count(client, url)
    # when: fifty more
    some(48)
    # then
    client.get(url)
    with django_assert_max_num_queries(few):
        response = client.get(url)
    assert response.status_code == 200


def test_step_run_and_event_lists_show_times_to_the_second(client, boss):
    run = run_at(template_with_steps((DeviceFactory(), "unlock", {}), (DeviceFactory(), "on", {})), cursor=1)
    RunEvent.objects.create(run=run, kind="step.queued", message="queued")
    to_the_second = r"<time [^>]*>\d\d:\d\d:\d\d</time>"
    steps = client.get("/admin/jobs/steprun/").text
    assert re.search(to_the_second, row_of(steps, "iq-status-succeeded"))  # step 0, sent and ended
    events = client.get("/admin/jobs/runevent/").text
    assert re.search(to_the_second, row_of(events, "step.queued"))
    assert "p.m." not in steps + events and "a.m." not in steps + events
