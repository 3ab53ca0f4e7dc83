"""Continuous fan-outs (jobs/engine/continuous.py): which devices join, once each; a closed
one takes no one; the step's validation. Sending the joined rows' commands needs the stack
(tests/jobs/test_continuous_fanout.py)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from devices.models import Device, DeviceGroup
from jobs.engine.continuous import device_joins, fanout_devices_add, fanouts_join, plan_step_index
from jobs.engine.plan import fanout_devices
from jobs.models import ContinuousFanout, JobRun, JobStep, JobTemplate, RunEvent, RunStatus, StepKind, StepRun
from jobs.validation import step_errors

SITE = {"selector": "site in (berlin,paris),!legacy"}


@pytest.fixture(autouse=True)
def _no_broker_identities(settings) -> None:
    """Devices saved here push no identity to a broker (there is none in this tier)."""
    settings.IOTQUEUE_MQTT_AUTH = "none"


@pytest.mark.parametrize(
    ("labels", "joins"),
    [
        ({"site": "berlin"}, True),
        ({"site": "paris", "kind": "gateway"}, True),
        ({"site": "berlin", "legacy": "yes"}, False),
        ({"site": "rome"}, False),
        ({}, False),
    ],
)
def test_a_device_joins_when_the_steps_selector_matches_its_labels(labels, joins):
    assert device_joins(SITE, labels=labels, groups=[], enabled=True) is joins


def test_a_disabled_device_never_joins():
    assert not device_joins(SITE, labels={"site": "berlin"}, groups=[], enabled=False)


def test_labels_and_group_targets_join_as_the_start_selects():
    assert device_joins({"labels": {"kind": "gw"}}, labels={"kind": "gw", "x": "1"}, groups=[], enabled=True)
    assert not device_joins({"labels": {"kind": "gw"}}, labels={"kind": "pump"}, groups=[], enabled=True)
    assert device_joins({"group": "stores"}, labels={}, groups=["stores", "eu"], enabled=True)
    assert not device_joins({"group": "stores"}, labels={}, groups=["eu"], enabled=True)


def test_a_selector_that_does_not_parse_takes_no_one():
    assert not device_joins(
        {"selector": "site in (berlin"}, labels={"site": "berlin"}, groups=[], enabled=True
    )


def test_a_step_is_named_by_its_index_or_its_name():
    plan = [{"name": "download"}, {"name": "flash"}, {}]
    assert plan_step_index(plan, "flash") == 1
    assert plan_step_index(plan, "2") == 2
    assert plan_step_index(plan, "reboot") is None
    assert plan_step_index(plan, "3") is None


@pytest.mark.django_db
def test_the_in_memory_match_agrees_with_the_starts_sql_selection():
    # given devices with labels and a group
    group = DeviceGroup.objects.create(name="stores")
    fleet = [
        Device.objects.create(name="b1", labels={"site": "berlin"}),
        Device.objects.create(name="b2", labels={"site": "berlin", "legacy": "1"}),
        Device.objects.create(name="p1", labels={"site": "paris"}),
        Device.objects.create(name="r1", labels={"site": "rome"}),
        Device.objects.create(name="off", labels={"site": "paris"}, enabled=False),
    ]
    fleet[0].groups.add(group)
    fleet[3].groups.add(group)
    for spec in (SITE, {"labels": {"site": "paris"}}, {"group": "stores"}, {"group": "stores", **SITE}):
        # then a device joins in memory exactly when the start's query selects it
        selected = {device.name for device in fanout_devices(spec)}
        joins = {
            device.name
            for device in Device.objects.prefetch_related("groups")
            if device_joins(
                spec,
                labels=device.labels,
                groups=[g.name for g in device.groups.all()],
                enabled=device.enabled,
            )
        }
        assert joins == selected, spec


def open_fanout(selector: str) -> JobRun:
    """A running run whose step 0 is an open continuous fan-out on `selector`, with no row yet."""
    template = JobTemplate.objects.create(name=f"t-{selector}")
    spec = {
        "selector": selector,
        "action": "flash",
        "args": {},
        "continuous": True,
        "queue_timeout_seconds": 60,
    }
    run = JobRun.objects.create(template=template, plan=[spec], status=RunStatus.RUNNING, cursor=0)
    ContinuousFanout.objects.create(run=run, index=0)
    return run


@pytest.mark.django_db
def test_devices_that_come_to_match_join_once_and_others_do_not():
    # given an open continuous fan-out on site=berlin
    run = open_fanout("site=berlin")
    joining = Device.objects.create(name="gw-new", labels={"site": "berlin"})
    other = Device.objects.create(name="printer", labels={"site": "rome"})

    # when both are looked at, twice (a device saved again, then back online)
    first = fanouts_join([joining.pk, other.pk])
    again = fanouts_join([joining.pk, other.pk])

    # then the matching one has one row, queued by the pump; the other none
    assert (first, again) == (1, 0)
    assert list(StepRun.objects.filter(run=run).values_list("device__name", flat=True)) == ["gw-new"]
    joined = RunEvent.objects.get(run=run, kind="step.fanout_joined")
    assert joined.data["devices"] == ["gw-new"] and joined.data["count"] == 1


@pytest.mark.django_db
def test_a_closed_fanout_takes_no_one_and_one_whose_run_moved_on_is_closed():
    closed = open_fanout("site=berlin")
    ContinuousFanout.objects.filter(run=closed).update(closed_at=timezone.now(), closed_by="ops")
    moved_on = open_fanout("site=berlin ")
    JobRun.objects.filter(pk=moved_on.pk).update(status=RunStatus.CANCELED)
    device = Device.objects.create(name="gw", labels={"site": "berlin"})

    assert fanouts_join([device.pk]) == 0
    assert fanout_devices_add(run=closed, index=0, devices=[device]) == 0
    assert not StepRun.objects.exists()
    assert ContinuousFanout.objects.get(run=moved_on).closed_at is not None


@pytest.mark.django_db
def test_a_device_back_online_whose_row_timed_out_in_its_queue_gets_a_new_try():
    # given a row that timed out in its queue, never sent (the device was offline)
    run = open_fanout("site=berlin")
    device = Device.objects.create(name="gw", labels={"site": "berlin"}, online=False)
    StepRun.objects.create(
        run=run, index=0, device=device, action="flash", status="timed_out", error="waited"
    )
    # when it joins while still offline, nothing changes; once online, the row is queued again
    assert fanouts_join([device.pk]) == 0
    Device.objects.filter(pk=device.pk).update(online=True)
    assert fanouts_join([device.pk]) == 1
    row = StepRun.objects.get(run=run)
    assert row.status == "queued" and row.error == ""
    assert "back online" in RunEvent.objects.get(run=run, kind="step.fanout_joined").message


def step(**fields) -> JobStep:
    return JobStep(position=0, action="flash", **fields)


def test_only_a_fanned_out_command_may_be_continuous():
    assert "continuous" not in step_errors(step(selector="site=berlin", continuous=True, open_seconds=60))
    assert "continuous" in step_errors(step(device_param="device", continuous=True))
    assert "continuous" in step_errors(step(kind=StepKind.DELAY, delay_seconds=1, continuous=True))


def test_open_seconds_is_the_end_by_of_a_continuous_fanout_only():
    assert "open_seconds" in step_errors(step(selector="site=berlin", open_seconds=60))
    assert "open_seconds" in step_errors(step(selector="site=berlin", continuous=True, open_seconds=0))
    assert "open_seconds" in step_errors(step(selector="site=berlin", continuous=True, open_seconds=10**9))
    assert "open_seconds" not in step_errors(step(selector="site=berlin", continuous=True))
