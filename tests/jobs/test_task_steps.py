"""Task steps: a registered Celery task as a template step — its result feeding a device
step, retries of a task that raises, the device lock it holds, and the registry's refusals
on save. The engine's path runs on the real worker, bridge, beat, Redis and broker."""

import pytest

from devices.locks import device_lock_state
from devtools.simulator import DeviceBehaviour
from iotqueue.redis_conn import redis_connection, redis_key
from jobs.engine.plan import step_holder
from jobs.models import JobRun, RunEvent, RunStatus, StepKind, StepRun, StepStatus
from jobs.services import run_start
from jobs.tasksteps import step_task_call
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory
from tests.jobs import step_tasks  # noqa: F401  (registers the test step tasks here too)

pytestmark = [pytest.mark.timeout(120)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def step_of(run: JobRun, index: int = 0) -> StepRun | None:
    return StepRun.objects.filter(run=run, index=index).first()


# --- the registry's call, directly ----------------------------------------------------


def test_a_task_returning_a_dict_gives_it_as_the_result():
    outcome = step_task_call("tests.firmware_url", {"version": "2.1"})
    assert (outcome.ok, outcome.result["url"]) == (True, "https://fw.example.com/pump-2.1.bin")


def test_a_task_that_raises_is_a_retryable_failure_with_its_error():
    outcome = step_task_call("tests.always_fails", {"reason": "stock service down"})
    assert (outcome.ok, outcome.retryable) == (False, True)
    assert outcome.error == "RuntimeError: stock service down"


def test_an_unregistered_celery_task_is_never_called():
    outcome = step_task_call("tests.not_a_step_task", {})
    assert (outcome.ok, outcome.retryable) == (False, False)
    assert "not a registered step task" in outcome.error


# --- validation on save (REST) ----------------------------------------------------------


def task_template(**step) -> dict:
    return {"name": "Fetch", "steps": [{"position": 0, "kind": "task", "name": "fetch", **step}]}


@pytest.mark.django_db
def test_unknown_or_unregistered_task_names_are_refused_on_save(admin_api):
    # given a template naming a task nobody registered, and one naming a plain Celery task
    for name in ("tests.no_such_task", "tests.not_a_step_task"):
        # when it is saved
        response = admin_api.post("/api/templates/", task_template(action=name), format="json")

        # then it is refused, naming the step's field
        assert response.status_code == 400, response.content
        assert "not a registered step task" in response.json()["steps"]["0"]["action"][0]


@pytest.mark.django_db
def test_task_step_refuses_a_fan_out_target_and_an_unregistered_compensation(admin_api):
    body = task_template(action="tests.firmware_url", labels={"kind": "pump"}, compensation_action="nope")
    errors = admin_api.post("/api/templates/", body, format="json").json()["steps"]["0"]
    assert set(errors) == {"device", "compensation_action"}, errors


@pytest.mark.django_db
def test_a_registered_task_step_is_saved(admin_api):
    body = task_template(action="tests.firmware_url", args={"version": "{{ params.version }}"})
    response = admin_api.post("/api/templates/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["steps"][0]["kind"] == StepKind.TASK


# --- on the real stack --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_task_steps_result_feeds_the_args_of_a_later_device_step(stack, simulator):
    # given: fetch (a task, no device) -> flash on a device, whose args read fetch's result
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=5, latency_max_ms=15)})
    template = JobTemplateFactory()
    JobStepFactory(
        template=template,
        position=0,
        name="fetch",
        kind=StepKind.TASK,
        device=None,
        action="tests.firmware_url",
        args={"version": "{{ params.version }}"},
    )
    JobStepFactory(
        template=template,
        position=1,
        device=device,
        action="flash",
        args={"url": "{{ steps.fetch.result.url }}", "note": "v{{ steps.fetch.result.version }}"},
    )

    # when a run starts
    run, _ = run_start(template=template, parameters={"version": "2.1"})
    wait_for(lambda: finished(run), what="the run to end")

    # then the task's return value is the step's result and the device got it rendered
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert step_of(run, 0).result == {"url": "https://fw.example.com/pump-2.1.bin", "version": "2.1"}
    [command] = sim.received(device.name)
    assert command["args"] == {"url": "https://fw.example.com/pump-2.1.bin", "note": "v2.1"}
    kinds = list(RunEvent.objects.filter(step_run=step_of(run, 0)).values_list("kind", flat=True))
    assert kinds == ["step.queued", "step.dispatched", "step.in_progress", "step.succeeded"]


@pytest.mark.django_db(transaction=True)
def test_a_task_that_raises_is_retried_per_max_attempts_then_fails_the_run(stack):
    # given a task step that always raises, with two attempts
    template = JobTemplateFactory()
    JobStepFactory(
        template=template,
        position=0,
        kind=StepKind.TASK,
        device=None,
        action="tests.always_fails",
        args={"reason": "stock service down"},
        max_attempts=2,
        backoff_seconds=0.1,
    )

    # when it runs
    run, _ = run_start(template=template)
    wait_for(lambda: finished(run), what="the run to end")

    # then both attempts ran, each with a new command id, and the run failed with the error
    step = step_of(run)
    assert (run.status, step.status, step.attempt) == (RunStatus.FAILED, StepStatus.FAILED, 2)
    assert step.error == "RuntimeError: stock service down"
    assert "RuntimeError: stock service down" in run.error
    kinds = list(RunEvent.objects.filter(step_run=step).values_list("kind", flat=True))
    assert kinds.count("step.dispatched") == 2 and kinds.count("step.retrying") == 1


@pytest.mark.django_db(transaction=True)
def test_a_task_step_on_a_device_holds_its_lock_while_it_runs(stack, simulator):
    # given a task step on a device, running (held at its gate), and a command for that device
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=5, latency_max_ms=15)})
    gate = f"{device.name}-gate"
    task_template = JobTemplateFactory()
    JobStepFactory(
        template=task_template,
        position=0,
        kind=StepKind.TASK,
        device=device,
        action="tests.gate_wait",
        args={"gate": gate},
    )
    command_template = JobTemplateFactory()
    JobStepFactory(template=command_template, position=0, device=device, action="on")
    task_run, _ = run_start(template=task_template)
    conn = redis_connection()
    wait_for(lambda: conn.exists(redis_key(f"test-gate-entered:{gate}")), what="the task to start")
    assert device_lock_state(device.name).holder == step_holder(step_of(task_run))

    # when another run's command step asks for the device
    command_run, _ = run_start(template=command_template)
    waiting = RunEvent.objects.filter(run=command_run, kind="step.waiting", message__contains="busy")
    wait_for(waiting.exists, what="the command to wait for the device")

    # then it waits while the task runs, and is sent once the task step has ended
    assert sim.received(device.name) == []
    conn.set(redis_key(f"test-gate:{gate}"), "1", ex=60)
    wait_for(lambda: finished(task_run) and finished(command_run), what="both runs to end")
    assert (task_run.status, command_run.status) == (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED)
    assert step_of(task_run).result == {"value": "passed"}
    assert [c["run"] for c in sim.received(device.name)] == [str(command_run.pk)]
    assert step_of(task_run).finished_at <= step_of(command_run).dispatched_at


@pytest.mark.django_db(transaction=True)
def test_a_failed_task_step_is_rolled_back_by_its_compensation_task(stack):
    # given a task step that fails, under `rollback`, whose compensation is a task too
    template = JobTemplateFactory()
    JobStepFactory(
        template=template,
        position=0,
        kind=StepKind.TASK,
        device=None,
        action="tests.always_fails",
        args={"reason": "half done"},
        on_failure="rollback",
        compensation_action="tests.firmware_url",
        compensation_args={"version": "{{ run.id }}"},
    )

    # when it runs
    run, _ = run_start(template=template)
    wait_for(lambda: finished(run), what="the run to end")

    # then the compensation task ran with its rendered args and the run is compensated
    assert run.status == RunStatus.COMPENSATED, run.error
    compensation = StepRun.objects.get(run=run, phase="compensation")
    assert (compensation.status, compensation.result["version"]) == (StepStatus.SUCCEEDED, str(run.pk))
