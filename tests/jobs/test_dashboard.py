"""The dashboard, the admin's first page, on the real stack: fleet counts against the
database, a stuck run with its reason, a rollout's progress, staff only, a fixed number of
queries."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices.locks import device_lock_acquire, device_lock_states, lock_epoch_start
from devices.models import Device
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, Rollout, RunStatus, StepRun, StepStatus
from jobs.services import run_start, template_plan
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory, template_with_steps

pytestmark = pytest.mark.timeout(120)

COUNT_RE = re.compile(r'data-count="(\w+)"[^>]*>(\d+)<')


def section(page: str, element_id: str) -> str:
    """The markup of the element with `element_id`, up to its closing tag's first match."""
    start = page.index(f'id="{element_id}"')
    tag = page.rfind("<", 0, start)
    name = page[tag + 1 : start].split()[0]
    return page[start : page.index(f"</{name}>", start)]


def counts(markup: str) -> dict[str, int]:
    return {key: int(n) for key, n in COUNT_RE.findall(markup)}


def label_row(page: str, value: str) -> dict[str, int]:
    start = page.index(f'data-label-value="{value}"')
    return counts(page[start : page.index("</tr>", start)])


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser(f"boss-{uuid.uuid4().hex[:6]}", "boss@example.com", "pw")
    client.force_login(user)
    return user


def expected_states(devices: list[Device]) -> dict[str, int]:
    """The board's numbers worked out device by device, from the rows and each lock's state."""
    locked = {name for name, state in device_lock_states([d.name for d in devices]).items() if state.holder}
    in_flight = set(
        StepRun.objects.filter(status__in=[StepStatus.DISPATCHED, StepStatus.IN_PROGRESS]).values_list(
            "device_id", flat=True
        )
    )
    out = dict.fromkeys(("online", "offline", "busy", "idle", "disabled", "total"), 0)
    for device in devices:
        out["total"] += 1
        if not device.enabled:
            out["disabled"] += 1
            continue
        reachable = device.online or not device.presence_required
        busy = device.name in locked or device.pk in in_flight
        out["online" if reachable else "offline"] += 1
        out["busy"] += busy
        out["idle"] += reachable and not busy
    return out


@pytest.mark.django_db
def test_fleet_counts_match_the_database_in_all_and_per_label(client, boss):
    # given a mix: idle, offline, busy by its lock, busy with a step in flight, disabled, and
    # one that reports no presence (reachable), on two sites and one without a site label
    lock_epoch_start()
    tag = uuid.uuid4().hex[:6]
    DeviceFactory(labels={"site": f"a-{tag}"})
    DeviceFactory(labels={"site": f"a-{tag}"}, online=False)
    locked = DeviceFactory(labels={"site": f"b-{tag}"})
    working = DeviceFactory(labels={"site": f"b-{tag}"}, online=False)
    DeviceFactory(labels={"site": f"b-{tag}"}, enabled=False)
    DeviceFactory(labels={"kind": "pump"}, online=False, presence_required=False)
    device_lock_acquire(locked.name, holder="task:1", priority=5, lease_seconds=60)
    template = template_with_steps((working, "flash", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.RUNNING)
    StepRun.objects.create(run=run, index=0, device=working, action="flash", status=StepStatus.DISPATCHED)

    # when the dashboard is shown, in all and per site
    page = client.get("/admin/").text
    by_site = client.get("/admin/?label=site").text

    # then every number is the database's, worked out device by device
    devices = list(Device.objects.all())
    assert counts(section(page, "dash-fleet-totals")) == expected_states(devices)
    assert counts(section(by_site, "dash-fleet-totals")) == expected_states(devices)
    for site in (f"a-{tag}", f"b-{tag}"):
        on_site = [d for d in devices if d.labels.get("site") == site]
        assert label_row(by_site, site) == expected_states(on_site)
    assert label_row(by_site, f"b-{tag}") == {
        "online": 1,
        "offline": 1,
        "busy": 2,
        "idle": 0,
        "disabled": 1,
        "total": 3,
    }
    assert 'data-label-missing="true"' in by_site and '<option value="site" selected>' in by_site


@pytest.mark.django_db
def test_each_fleet_number_links_to_the_device_list_showing_that_many(client, boss):
    # given an idle device, a busy one and a disabled one on one site
    lock_epoch_start()
    site = f"s-{uuid.uuid4().hex[:6]}"
    DeviceFactory(labels={"site": site})
    busy = DeviceFactory(labels={"site": site})
    DeviceFactory(labels={"site": site}, enabled=False)
    device_lock_acquire(busy.name, holder="task:2", priority=5, lease_seconds=60)
    page = client.get("/admin/?label=site").text
    start = page.index(f'data-label-value="{site}"')
    row = page[start : page.index("</tr>", start)]

    # when each number's link is followed, then the list shows that many devices
    links = re.findall(r'<a data-count="(\w+)" href="([^"]+)">(\d+)</a>', row)
    assert {state for state, _url, _n in links} == {"online", "offline", "busy", "idle", "disabled", "total"}
    for state, url, n in links:
        response = client.get(url.replace("&amp;", "&"))
        assert response.status_code == 200, url
        assert response.context["cl"].result_count == int(n), (state, url)
    assert dict((s, int(n)) for s, _u, n in links)["busy"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_blocked_by_an_offline_device_is_stuck_with_its_reason(stack, client, boss, settings):
    # given a run whose only step is queued on a device that is offline
    device = DeviceFactory(online=False)
    template = template_with_steps((device, "unlock", {}))
    run, _ = run_start(template=template)
    wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.QUEUED).exists(),
        what="the step queued on the offline device",
    )

    # when it has waited less than the threshold, then it is not listed as stuck
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 300
    assert f'data-run="{run.pk}"' not in section(client.get("/admin/").text, "dash-stuck")

    # when the threshold is past (0 s), then it is listed, with the reason and a link to its page
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 0

    def stuck_row() -> str | None:
        stuck = section(client.get("/admin/dashboard/").text, "dash-stuck")
        marker = f'data-run="{run.pk}"'
        if marker not in stuck:
            return None
        return stuck[stuck.index(marker) : stuck.index("</tr>", stuck.index(marker))]

    row = wait_for(stuck_row, what="the run under stuck runs")
    assert 'data-reason="device_offline"' in row
    assert f"Device {device.name} is offline" in row
    assert f'href="/admin/jobs/jobrun/{run.pk}/change/"' in row


@pytest.mark.django_db(transaction=True)
def test_a_running_rollout_shows_its_progress_pace_and_abort_margin(stack, simulator, client, boss):
    # given three devices and a fan-out to them that starts one device a minute
    label = f"dash-{uuid.uuid4().hex[:6]}"
    names = [DeviceFactory(name=f"{label}-{i}", labels={"kind": label}).name for i in range(3)]
    simulator(dict.fromkeys(names, DeviceBehaviour()))
    step = JobStepFactory(
        device=None,
        labels={"kind": label},
        action="firmware/check",
        rollout_per_minute=1,
        abort_failure_percent=50,
        abort_min_devices=2,
    )

    # when it runs and the first device has answered
    run, _ = run_start(template=step.template)

    def rollout() -> str | None:
        panel = section(client.get("/admin/dashboard/").text, "dash-rollouts")
        marker = f'data-run="{run.pk}"'
        if marker not in panel:
            return None
        block = panel[panel.index(marker) :]
        return block if counts(block).get("succeeded") == 1 else None

    block = wait_for(rollout, what="the rollout with one device done")

    # then the panel shows its counts, its rate and when the rest starts, and the criterion
    assert {k: v for k, v in counts(block).items() if k != "total"} == {
        "succeeded": 1,
        "failed": 0,
        "in_flight": 0,
        "pending": 2,
    }
    assert "the rollout allows 1 a minute now" in block
    assert "All devices started in about 2 min 00 s" in block
    assert "0 of 1 finished devices (0.0%); the rollout aborts above 50%" in block
    assert "tested once 2 devices finished" in block


@pytest.mark.django_db
def test_an_unknown_or_odd_label_key_never_breaks_the_page(client, boss):
    # given devices whose label keys are odd: "__" inside, a lookup's name, markup
    DeviceFactory(labels={"a__b": "x", "contains": "y", "<b>": "z"})

    # when the dashboard is asked for each of them, and for a key no device has
    for label in ("a__b", "contains", "<b>", "nope", ""):
        response = client.get("/admin/", {"label": label})

        # then it renders; an existing key is counted by its own value, without a link when
        # the device list's lookups cannot express it
        assert response.status_code == 200, label
        page = response.text
        if label in ("a__b", "contains", "<b>"):
            rows = section(page, "dash-fleet-labels")
            assert label != "<b>" or "<b>" not in rows
            value = {"a__b": "x", "contains": "y", "<b>": "z"}[label]
            assert label_row(page, value)["total"] == 1
        else:
            assert 'id="dash-fleet-labels"' not in page


@pytest.mark.django_db
def test_recent_failures_show_the_error(client, boss):
    # given a failed run
    template = JobTemplateFactory()
    run = JobRun.objects.create(
        template=template, status=RunStatus.FAILED, error="step 0: valve stuck on pump-7", plan=[]
    )

    # when the dashboard is shown, then the failure is listed with its error, linked
    panel = section(client.get("/admin/").text, "dash-failures")
    assert f'data-run="{run.pk}"' in panel and "valve stuck on pump-7" in panel
    assert f"/admin/jobs/jobrun/{run.pk}/change/" in panel


@pytest.mark.django_db
def test_the_chart_counts_the_runs_of_the_last_day_and_week(client, boss):
    # given two runs now, one failed, and one ten days ago
    template = JobTemplateFactory()
    JobRun.objects.create(template=template, status=RunStatus.SUCCEEDED, plan=[])
    JobRun.objects.create(template=template, status=RunStatus.FAILED, plan=[])
    old = JobRun.objects.create(template=template, status=RunStatus.FAILED, plan=[])
    JobRun.objects.filter(pk=old.pk).update(created_at=timezone.now() - timezone.timedelta(days=10))

    # when the dashboard is shown
    chart = section(client.get("/admin/").text, "dash-chart")

    # then the current hour's and today's bars hold the two runs, by status; the old one is out
    day = section(chart, "dash-chart-7d")
    hour = section(chart, "dash-chart-24h")
    for svg in (day, hour):
        assert len(re.findall(r'data-series="succeeded" data-count="1"', svg)) == 1
        assert len(re.findall(r'data-series="failed" data-count="1"', svg)) == 1
        assert re.findall(r'data-total="(\d+)"', svg).count("2") == 1
    assert "Last 7 days, per day: 2 runs" in chart


@pytest.mark.django_db
def test_non_staff_get_no_dashboard(client):
    # given a signed-in user who is not staff, and no one signed in
    for user in (User.objects.create_user("plain", password="pw"), None):
        client.logout()
        if user:
            client.force_login(user)
        # when they ask for the dashboard or its fragment, then they are sent to the login
        for url in ("/admin/", "/admin/dashboard/"):
            response = client.get(url)
            assert response.status_code == 302 and "/admin/login/" in response["Location"], url


@pytest.mark.django_db
def test_the_dashboard_reads_a_fixed_number_of_queries(client, boss, django_assert_max_num_queries):
    # given a fleet, failed runs and a running fan-out
    def fill(n: int) -> None:
        label = f"q-{uuid.uuid4().hex[:6]}"
        devices = [DeviceFactory(labels={"site": label}) for _ in range(n)]
        step = JobStepFactory(device=None, labels={"site": label}, action="x", abort_failure_percent=10)
        run = JobRun.objects.create(
            template=step.template, plan=template_plan(step.template), status=RunStatus.RUNNING
        )
        statuses = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DISPATCHED, StepStatus.PENDING)
        for i, device in enumerate(devices):
            StepRun.objects.create(run=run, index=0, device=device, action="x", status=statuses[i % 4])
        for _ in range(n):
            JobRun.objects.create(template=step.template, status=RunStatus.FAILED, error="broke", plan=[])

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/admin/?label=site").status_code == 200
        return len(captured)

    fill(2)
    few = queries()
    fill(12)
    many = queries()

    # then more devices, runs and rollouts take no more queries
    assert many == few
    with django_assert_max_num_queries(16):
        client.get("/admin/?label=site")


def waved_run(state: str, **rollout) -> JobRun:
    """A running fan-out in waves (2 devices of 4 done, 2 pending) whose rollout is in `state`."""
    label = f"w-{uuid.uuid4().hex[:6]}"
    devices = [DeviceFactory(labels={"site": label}) for _ in range(4)]
    waves = [{"count": 2, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"site": label}, action="x", waves=waves, rollout_per_minute=1)
    run = JobRun.objects.create(
        template=step.template, plan=template_plan(step.template), status=RunStatus.RUNNING
    )
    for i, device in enumerate(devices):
        done = i < 2
        StepRun.objects.create(
            run=run,
            index=0,
            device=device,
            action="x",
            wave=0 if done else 1,
            status=StepStatus.SUCCEEDED if done else StepStatus.PENDING,
        )
    sizes = [{"size": 2, "gate": "approval"}, {"size": 2}]
    Rollout.objects.create(run=run, index=0, waves=sizes, wave_checked=True, state=state, **rollout)
    return run


def rollout_block(page: str, run: JobRun) -> str:
    panel = section(page, "dash-rollouts")
    block = panel[panel.index(f'data-run="{run.pk}"') :]
    return block[: block.index("</p>", block.index("iq-rollout-pace"))]


@pytest.mark.django_db
def test_a_rollout_paused_or_at_a_gate_shows_its_state_instead_of_an_eta(client, boss):
    # given rollouts in waves paused by an operator, at an approval gate, asking the webhook
    # and soaking, and one that runs
    paused = waved_run("paused", decided_by="ops", reason="change freeze")
    approval = waved_run("awaiting_approval")
    webhook = waved_run("awaiting_webhook")
    soaking = waved_run("soaking", soak_until=timezone.now() + timedelta(minutes=10))
    running = waved_run("running")

    page = client.get("/admin/dashboard/").text

    # then each halted one says why it starts no device, with no ETA; the running one has its ETA
    expected = {
        paused: "Paused by ops: change freeze",
        approval: "Awaiting approval of wave 2 of 2.",
        webhook: "Awaiting the webhook&#x27;s answer for wave 2 of 2.",
        soaking: "then its gate decides whether wave 2 of 2 opens.",
    }
    for run, text in expected.items():
        block = rollout_block(page, run)
        assert text in block, block
        assert "All devices started in about" not in block
    assert "All devices started in about" in rollout_block(page, running)


@pytest.mark.django_db
def test_rollouts_in_waves_take_a_fixed_number_of_queries(client, boss):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/admin/dashboard/").status_code == 200
        return len(captured)

    waved_run("paused", decided_by="ops")
    few = queries()
    for state in ("awaiting_approval", "soaking", "running", "awaiting_webhook"):
        waved_run(state)
    assert queries() == few
