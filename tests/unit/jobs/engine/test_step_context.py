"""What a fan-out hands on to later steps (jobs/engine/plan.py): the references' context
(results, errors, counts, device lists, bounded) and the devices a `devices_from` step targets."""

from __future__ import annotations

import pytest

from devices.models import Device
from jobs.engine.plan import args_renderer, fanout_devices, outcome_counts, step_args, step_context
from jobs.models import JobRun, Phase, StepRun, StepStatus
from jobs.templating import TemplateError
from tests.factories import JobTemplateFactory

pytestmark = pytest.mark.django_db

# The fan-out's devices by how their rows ended.
OUTCOMES = {
    "gw-a": StepStatus.SUCCEEDED,
    "gw-b": StepStatus.FAILED,
    "gw-c": StepStatus.SUCCEEDED,
    "gw-d": StepStatus.REJECTED,
    "gw-e": StepStatus.TIMED_OUT,
    "gw-f": StepStatus.SKIPPED,
    "gw-g": StepStatus.QUEUED,
}


@pytest.fixture
def run() -> JobRun:
    """A run whose step 0 ("flash") fanned out to OUTCOMES' devices; step 1 reads one device."""
    plan = [
        {"name": "flash", "labels": {"kind": "gateway"}, "action": "firmware/flash", "args": {}},
        {"name": "report", "device": "hub", "action": "report", "args": {}},
    ]
    run = JobRun.objects.create(template=JobTemplateFactory(), plan=plan, cursor=1)
    # bulk_create: no broker identity is written (this tier has no broker)
    devices = Device.objects.bulk_create(Device(name=name, labels={"kind": "gateway"}) for name in OUTCOMES)
    for device, (name, status) in zip(devices, OUTCOMES.items(), strict=True):
        ok = status == StepStatus.SUCCEEDED
        StepRun.objects.create(
            run=run,
            phase=Phase.FORWARD,
            index=0,
            device=device,
            action="firmware/flash",
            status=status,
            result={"version": "2.1", "device": name} if ok else None,
            error="" if ok else f"{status} on {name}",
        )
    return run


def test_a_fan_outs_counts_name_every_outcome_and_the_total(run):
    context = step_context(run, paths=["steps.flash.counts"])

    assert context["steps"]["flash"]["counts"] == {
        "succeeded": 2,
        "failed": 1,
        "rejected": 1,
        "timed_out": 1,
        "canceled": 0,
        "skipped": 1,
        "unfinished": 1,
        "total": 7,
    }
    # the same entry by index
    assert context["steps"]["0"]["counts"]["total"] == 7


def test_the_device_lists_and_per_device_values_by_outcome(run):
    paths = ["steps.flash.succeeded", "steps.flash.failed", "steps.flash.results", "steps.flash.errors"]
    flash = step_context(run, paths=paths)["steps"]["flash"]

    # "failed" is every row that ended without success; skipped and unfinished rows are neither
    assert flash["succeeded"] == ["gw-a", "gw-c"]
    assert flash["failed"] == ["gw-b", "gw-d", "gw-e"]
    assert flash["results"] == {
        "gw-a": {"version": "2.1", "device": "gw-a"},
        "gw-c": {"version": "2.1", "device": "gw-c"},
    }
    assert flash["errors"] == {
        "gw-b": "failed on gw-b",
        "gw-d": "rejected on gw-d",
        "gw-e": "timed_out on gw-e",
    }


def test_args_render_the_values_with_their_json_type(run):
    args = {
        "counts": "{{ steps.flash.counts }}",
        "failed": "{{ steps.flash.failed }}",
        "note": "{{ steps.flash.counts.failed }} failed, first {{ steps.flash.failed.0 }}",
        "version": "{{ steps.flash.results.gw-a.version }}",
    }

    rendered = step_args(run, args, None)

    assert rendered["counts"]["succeeded"] == 2
    assert rendered["failed"] == ["gw-b", "gw-d", "gw-e"]
    assert rendered["note"] == "1 failed, first gw-b"
    assert rendered["version"] == "2.1"


def test_a_list_longer_than_the_bound_fails_the_render_naming_the_setting(run, settings):
    # given at most 2 devices per list: the fan-out has 3 failed devices and 2 succeeded
    settings.IOTQUEUE_STEP_RESULTS_MAX_DEVICES = 2

    # then the failed list is refused, naming the reference and the setting; counts still render
    with pytest.raises(TemplateError, match=r"steps\.flash\.failed .*more than 2 devices.*STEP_RESULTS_MAX"):
        step_args(run, {"x": "{{ steps.flash.failed }}"}, None)
    assert step_args(run, {"x": "{{ steps.flash.succeeded }}"}, None) == {"x": ["gw-a", "gw-c"]}
    assert step_args(run, {"x": "{{ steps.flash.counts.total }}"}, None) == {"x": 7}


def test_nothing_is_read_for_args_that_reference_no_step(run, django_assert_num_queries):
    # args with parameters only, or none at all, read no row
    with django_assert_num_queries(0):
        assert step_args(run, {"x": 1}, None) == {"x": 1}
        assert step_args(JobRun(plan=run.plan, parameters={"v": 3}), {"v": "{{ params.v }}"}, None) == {
            "v": 3
        }


def test_a_fan_outs_values_are_read_once_for_all_the_devices_a_step_renders_for(
    run, django_assert_num_queries
):
    # given a later fan-out's args reading the counts and naming each device
    render = args_renderer(run, {"of": "{{ steps.flash.counts.total }}", "me": "{{ device.name }}"})
    devices = Device.objects.bulk_create(Device(name=f"hub-{i}") for i in range(3))

    # then rendering them for every device reads the counts once (one GROUP BY)
    with django_assert_num_queries(1):
        rendered = [render(device) for device in devices]
    assert rendered == [{"of": 7, "me": device.name} for device in devices]


def test_devices_from_targets_the_enabled_devices_of_that_outcome(run):
    # given one of the failed gateways disabled since
    Device.objects.filter(name="gw-e").update(enabled=False)

    succeeded = fanout_devices({"devices_from": {"step": "flash", "outcome": "succeeded"}}, run)
    failed = fanout_devices({"devices_from": {"step": "flash", "outcome": "failed"}}, run)

    assert [device.name for device in succeeded] == ["gw-a", "gw-c"]
    assert [device.name for device in failed] == ["gw-b", "gw-d"]


def test_devices_from_a_step_the_run_does_not_fan_out_is_refused(run):
    with pytest.raises(ValueError, match="no fan-out step 'report'"):
        fanout_devices({"devices_from": {"step": "report", "outcome": "failed"}}, run)


def test_outcome_counts_without_rows():
    assert outcome_counts({}) == dict.fromkeys(
        ("succeeded", "failed", "rejected", "timed_out", "canceled", "skipped", "unfinished", "total"), 0
    )
