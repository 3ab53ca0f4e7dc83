"""Orchestration on the real path: data flow, rollback, fan-out, flow control, waits,
for-each runs, idempotency window, retention."""

import itertools
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from devices.models import DeviceGroup
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, JobStep, OnFailure, Phase, RunEvent, RunStatus, StepKind, StepRun, StepStatus
from jobs.retention import runs_prune
from jobs.services import run_start, run_start_each
from jobs.validation import template_errors
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def test_a_later_step_uses_an_earlier_steps_result(stack, simulator):
    # given read_info on one device (it answers with its serial) and register on another
    agent, registry = DeviceFactory(), DeviceFactory()
    sim = simulator({agent.name: DeviceBehaviour(), registry.name: DeviceBehaviour()})
    template = template_with_steps(
        (agent, "read_info", {}),
        (registry, "prepare", {"site": "{{ params.site }}"}),
        (registry, "register", {"serial": "{{ steps.info.result.serial }}", "note": "for {{ params.site }}"}),
    )
    template.steps.filter(position=0).update(name="info")

    run, _ = run_start(template=template, parameters={"site": "berlin"})

    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    register = sim.received(registry.name)[-1]
    assert register["args"] == {"serial": f"SN-{agent.name}", "note": "for berlin"}


def test_references_are_validated_when_the_template_is_saved():
    template = JobTemplateFactory.build()
    device = DeviceFactory()
    steps = [
        JobStep(template=template, position=0, device=device, action="read_info", name="info"),
        JobStep(
            template=template, position=1, device=device, action="a", args={"x": "{{ steps.later.result }}"}
        ),
        JobStep(
            template=template, position=2, device=device, action="b", args={"x": "{{ steps.info.result.s"}
        ),
        JobStep(template=template, position=3, device=device, action="c", args={"x": "{{ os.system }}"}),
        JobStep(template=template, position=4, action="d"),
    ]
    errors = template_errors(steps)
    assert "'later' is not an earlier step" in errors["step 1"]["args"]
    assert "malformed" in errors["step 2"]["args"]
    assert "starts with one of" in errors["step 3"]["args"]
    assert "exactly one target" in errors["step 4"]["device"]
    assert "step 0" not in errors


def test_rollback_runs_compensations_in_reverse_order(stack, simulator):
    # given the provisioning job: check -> init_instance (fails for good) -> deduct, with rollback
    resource, mysql, billing = DeviceFactory(), DeviceFactory(), DeviceFactory()
    sim = simulator(
        {
            resource.name: DeviceBehaviour(),
            mysql.name: DeviceBehaviour(failing_actions=frozenset({"mysql/init_instance"})),
            billing.name: DeviceBehaviour(),
        }
    )
    template = template_with_steps(
        (resource, "resource/check", {"cpu": 2}),
        (mysql, "mysql/init_instance", {"host": "{{ steps.0.result.device }}"}),
        (billing, "resource/deduct", {}),
    )
    template.steps.filter(position=0).update(compensation_action="monitor/report_event")
    template.steps.filter(position=1).update(
        compensation_action="mysql/clean_instance",
        on_failure=OnFailure.ROLLBACK,
        max_attempts=2,
        backoff_seconds=0.1,
    )

    run, _ = run_start(template=template)

    assert wait_for(lambda: finished(run)).status == RunStatus.COMPENSATED
    undo = {c["action"]: c["at"] for name in (resource.name, mysql.name) for c in sim.received(name)}
    assert undo["mysql/clean_instance"] < undo["monitor/report_event"]
    assert not sim.received(billing.name)
    comps = StepRun.objects.filter(run=run, phase=Phase.COMPENSATION).order_by("-index")
    assert [(c.index, c.status) for c in comps] == [(1, StepStatus.SUCCEEDED), (0, StepStatus.SUCCEEDED)]
    init = StepRun.objects.get(run=run, phase=Phase.FORWARD, index=1)
    assert init.attempt == 2
    assert RunEvent.objects.filter(run=run, kind="run.compensating").exists()


def test_failed_compensation_leaves_the_run_failed_with_it_recorded(stack, simulator):
    good, bad = DeviceFactory(), DeviceFactory()
    simulator({good.name: DeviceBehaviour(failure_rate=1.0), bad.name: DeviceBehaviour(failure_rate=1.0)})
    template = template_with_steps((good, "a", {}))
    template.steps.update(compensation_action="undo_a", on_failure=OnFailure.ROLLBACK)
    run, _ = run_start(template=template)
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert "compensation failed" in run.error


def labelled_fleet(count: int, failing: int = 0, label: str = "pump"):
    # Zero-padded names: a fan-out starts devices in name order, failing ones first here.
    fleet = [DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}) for i in range(count)]
    behaviours = {
        d.name: DeviceBehaviour(failure_rate=1.0 if i < failing else 0.0) for i, d in enumerate(fleet)
    }
    return fleet, behaviours


def test_fanout_over_twenty_devices_respects_max_in_flight_and_succeeds(stack, simulator):
    label = f"pump-{uuid.uuid4().hex[:6]}"
    fleet, behaviours = labelled_fleet(20, label=label)
    sim = simulator(behaviours)
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check", max_in_flight=5)

    run, _ = run_start(template=step.template)

    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    rows = StepRun.objects.filter(run=run)
    assert rows.count() == 20 and set(rows.values_list("status", flat=True)) == {StepStatus.SUCCEEDED}
    assert sum(len(sim.received(d.name)) for d in fleet) == 20
    # Decided once, though the two worker processes end rows of it at the same time.
    done = RunEvent.objects.filter(run=run, kind="step.fanout_done")
    assert [e.message for e in done] == ["20 of 20 devices succeeded"]


def test_fanout_rollout_rate_starts_only_that_many_per_minute(stack, simulator):
    label = f"rate-{uuid.uuid4().hex[:6]}"
    fleet, behaviours = labelled_fleet(20, label=label)
    sim = simulator(behaviours)
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check", rollout_per_minute=5)

    run, _ = run_start(template=step.template)

    wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).count() == 5, what="first 5"
    )
    assert StepRun.objects.filter(run=run, status=StepStatus.PENDING).count() == 15
    assert sum(len(sim.received(d.name)) for d in fleet) == 5
    assert finished(run) is None


def test_fanout_abort_threshold_trips_and_reports_the_breakdown(stack, simulator):
    # given 20 pumps of which the first 10 fail, at most 2 in flight, abort above 20% after 5
    label = f"abort-{uuid.uuid4().hex[:6]}"
    fleet, behaviours = labelled_fleet(20, failing=10, label=label)
    sim = simulator(behaviours)
    step = JobStepFactory(
        device=None,
        labels={"kind": label},
        action="firmware/check",
        max_in_flight=2,
        abort_failure_percent=20,
        abort_min_devices=5,
    )

    run, _ = run_start(template=step.template)

    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert "rollout aborted" in run.error and "simulated failure" in run.error
    skipped = StepRun.objects.filter(run=run, status=StepStatus.SKIPPED).count()
    assert skipped >= 12  # 5 ended (all failures) + at most 2 in flight had started
    assert sum(1 for d in fleet if sim.received(d.name)) <= 20 - skipped


def test_for_each_device_in_a_group_starts_one_run_per_device(stack, simulator):
    group = DeviceGroup.objects.create(name=f"cams-{uuid.uuid4().hex[:6]}")
    cams = [DeviceFactory() for _ in range(3)]
    group.devices.set(cams)
    sim = simulator({c.name: DeviceBehaviour() for c in cams})
    step = JobStepFactory(
        device=None, device_param="device", action="snapshot", args={"of": "{{ params.device }}"}
    )

    runs = run_start_each(template=step.template, group=group.name)

    assert len(runs) == 3
    for run in runs:
        assert wait_for(lambda run=run: finished(run)).status == RunStatus.SUCCEEDED
    assert all(sim.received(c.name)[0]["args"] == {"of": c.name} for c in cams)


def test_flow_control_spaces_commands_to_slow_firmware(stack, simulator):
    # given a payment terminal that needs at least 1 s between commands
    terminal = DeviceFactory(min_interval_seconds=1.0)
    sim = simulator({terminal.name: DeviceBehaviour(latency_min_ms=5, latency_max_ms=10)})
    template = template_with_steps(*[(terminal, "add_person", {"n": n}) for n in range(3)])

    run, _ = run_start(template=template)

    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    times = [c["at"] for c in sim.received(terminal.name)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 2 and min(gaps) >= 0.95, gaps
    # the next steps kept the lock while spaced, and each was dispatched once
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    assert kinds.count("step.spaced") >= 1 and kinds.count("step.dispatched") == 3, kinds


def test_delay_and_wait_online_steps_hold_no_worker_or_lock(stack, simulator):
    # given a run that waits 1 s, then waits for an offline device, then commands it
    device = DeviceFactory(online=False)
    template = JobTemplateFactory()
    JobStepFactory(template=template, position=0, device=None, kind=StepKind.DELAY, delay_seconds=1.0)
    JobStepFactory(template=template, position=1, device=device, kind=StepKind.WAIT_ONLINE)
    JobStepFactory(template=template, position=2, device=device, action="wake")
    run, _ = run_start(template=template)

    wait_for(lambda: StepRun.objects.filter(run=run, index=1).exists(), what="delay over")
    delay = StepRun.objects.get(run=run, index=0)
    assert delay.finished_at - delay.dispatched_at >= timedelta(seconds=1)
    assert StepRun.objects.get(run=run, index=1).status == StepStatus.QUEUED

    # when the device comes online
    simulator({device.name: DeviceBehaviour()})

    # then the run goes on and finishes
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED


def test_idempotency_key_is_reused_only_within_its_window(stack, settings):
    template = template_with_steps((DeviceFactory(), "x", {}))
    first, created = run_start(template=template, idempotency_key="nightly-2026-11-22")
    again, created_again = run_start(template=template, idempotency_key="nightly-2026-11-22")
    assert created and not created_again and again.pk == first.pk

    JobRun.objects.filter(pk=first.pk).update(created_at=timezone.now() - timedelta(hours=25))
    later, created_later = run_start(template=template, idempotency_key="nightly-2026-11-22")
    assert created_later and later.pk != first.pk


def test_retention_prunes_old_finished_runs_only(stack, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "x", {}))
    old, _ = run_start(template=template)
    recent, _ = run_start(template=template)
    wait_for(lambda: finished(old) and finished(recent))
    JobRun.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=40))

    assert runs_prune(older_than_days=30) == 1
    assert list(JobRun.objects.filter(pk__in=[old.pk, recent.pk])) == [recent]
    assert not StepRun.objects.filter(run_id=old.pk).exists()


def test_rest_for_each_starts_a_run_per_labelled_device(stack, simulator):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    label = f"cam-{uuid.uuid4().hex[:6]}"
    cams = [DeviceFactory(labels={"kind": label}) for _ in range(3)]
    simulator({c.name: DeviceBehaviour() for c in cams})
    step = JobStepFactory(
        device=None, device_param="device", action="snapshot", args={"cam": "{{ device.name }}"}
    )
    assert not template_errors([step])
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("ops", "ops@example.com", "pw"))

    response = client.post(
        "/api/runs/", {"template": step.template.name, "for_each": {"labels": {"kind": label}}}, format="json"
    )

    assert response.status_code == 201, response.content
    runs = [JobRun.objects.get(pk=r["id"]) for r in response.json()]
    assert sorted(r.parameters["device"] for r in runs) == sorted(c.name for c in cams)
    for run in runs:
        assert wait_for(lambda run=run: finished(run)).status == RunStatus.SUCCEEDED
    bad = client.post(
        "/api/runs/",
        {"template": step.template.name, "for_each": {"labels": {"kind": "none"}}},
        format="json",
    )
    assert bad.status_code == 400 and "for_each" in bad.json()


def test_cancel_during_a_delay_step(stack):
    from jobs.cancel import run_cancel

    template = JobTemplateFactory()
    JobStepFactory(template=template, position=0, device=None, kind=StepKind.DELAY, delay_seconds=60)
    run, _ = run_start(template=template)
    wait_for(lambda: StepRun.objects.filter(run=run, status=StepStatus.IN_PROGRESS).exists(), what="delay")

    assert run_cancel(run=run, by="ops")
    assert StepRun.objects.get(run=run).status == StepStatus.CANCELED
