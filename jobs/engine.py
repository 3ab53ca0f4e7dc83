"""The step engine, forward path: start runs and steps, take device locks, dispatch commands.

No function here waits for a device. A step is queued on its device's lock; when granted
it is dispatched (row committed with its command id, fence and deadline, then the command
published) and the function returns. The reply comes back through the bridge as a
`step_reply` task (jobs/outcomes.py), which ends the attempt, hands the lock on and starts
the run's next step. The database row is the truth about where a run stands: every
transition is a compare-and-set plus a RunEvent, so a task that runs twice changes nothing.

Step:  pending -> queued -> dispatched -> in_progress -> succeeded | failed | timed_out
       (retrying between attempts; canceled from any non-final state; see docs/architecture.md)
Run:   pending -> running -> succeeded | failed | timed_out | canceled
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from devices import protocol
from devices.flow import device_flow_record, device_flow_wait
from devices.locks import (
    Grant,
    NotReady,
    device_lock_acquire,
    device_lock_extend,
    device_lock_handoff,
    device_lock_release,
    grant_handler_register,
    holder_name,
)
from devices.models import Device
from iotqueue.mqtt import PublishError, publisher
from iotqueue.redis_conn import redis_connection

from . import templating
from .deadlines import Deadline, deadlines_clear, deadlines_set
from .events import event_record
from .models import STEP_IN_FLIGHT, JobRun, Phase, RunStatus, StepKind, StepRun, StepStatus

# Run states in which steps may be dispatched (compensations run while compensating).
RUN_ACTIVE = (RunStatus.RUNNING, RunStatus.COMPENSATING)

log = logging.getLogger(__name__)

HOLDER_KIND = "step"
# The lock lease outlives the step's own timeout by this much, so the timeout (a step
# outcome) always fires before the lease expiry (a crash-recovery path).
LEASE_GRACE_SECONDS = 30.0
# A command committed but not confirmed published by then is sent again (outbox): covers
# a worker that died between commit and publish, and a broker that refused the publish.
SEND_CHECK_SECONDS = 5.0


def step_holder(step_run: StepRun) -> str:
    return holder_name(HOLDER_KIND, step_run.pk)


def step_spec(step_run: StepRun) -> dict[str, Any]:
    """The plan entry a step row executes; a compensation runs the step's compensation."""
    spec = step_run.run.plan[step_run.index]
    if step_run.phase == Phase.COMPENSATION:
        return {
            **spec,
            "kind": StepKind.COMMAND,
            "action": spec["compensation_action"],
            "args": spec["compensation_args"],
            "group": "",
            "labels": {},
        }
    return spec


def lease_seconds(spec: dict[str, Any]) -> float:
    return float(spec["timeout_seconds"]) + LEASE_GRACE_SECONDS


def command_id_new(step_run: StepRun, attempt: int) -> str:
    """Unique per attempt, and names its step so a late reply can be attributed."""
    return f"{step_run.pk}-{attempt}-{uuid.uuid4().hex[:12]}"


def command_id_step(command_id: str) -> int | None:
    """The step run id a command id names, or None for a foreign id."""
    head = command_id.split("-", 1)[0]
    return int(head) if head.isdigit() else None


# --- runs -----------------------------------------------------------------------------


def run_advance(*, run_id: str) -> None:
    """Start a pending run, or (re)start the step at a running run's cursor (idempotent)."""
    run = JobRun.objects.get(pk=run_id)
    if run.status == RunStatus.PENDING:
        now = timezone.now()
        if JobRun.objects.filter(pk=run.pk, status=RunStatus.PENDING).update(
            status=RunStatus.RUNNING, started_at=now
        ):
            run.status, run.started_at = RunStatus.RUNNING, now
            event_record("run.started", run=run, message=f"{len(run.plan)} steps")
    if run.status == RunStatus.RUNNING:
        step_start(run=run, index=run.cursor)


def run_finish(*, run: JobRun, status: str, error: str = "") -> bool:
    """Move a run to a terminal status (once); False when it already was terminal."""
    finished = JobRun.objects.filter(pk=run.pk, status__in=(RunStatus.PENDING, *RUN_ACTIVE)).update(
        status=status, error=error, finished_at=timezone.now()
    )
    if finished:
        run.status, run.error = status, error
        event_record(f"run.{status}", run=run, message=error)
    return bool(finished)


def step_context(run: JobRun, device: Device | None = None) -> dict[str, Any]:
    """What {{ references }} in a step's args can read: params, earlier results, run, device."""
    results = dict(
        StepRun.objects.filter(run=run, phase=Phase.FORWARD, status=StepStatus.SUCCEEDED).values_list(
            "index", "result"
        )
    )
    steps: dict[str, Any] = {}
    for index, spec in enumerate(run.plan):
        entry = {"result": results.get(index)}
        steps[str(index)] = entry
        if spec.get("name"):
            steps[spec["name"]] = entry
    context = {"params": run.parameters, "steps": steps, "run": {"id": str(run.pk)}}
    if device is not None:
        context["device"] = {"name": device.name, "labels": device.labels}
    return context


def step_args(run: JobRun, args: dict[str, Any], device: Device | None) -> dict[str, Any]:
    """Args with their references resolved; no context is read when there are none."""
    if not templating.references(args):
        return args
    return templating.render(args, step_context(run, device))


def step_target(run: JobRun, spec: dict[str, Any]) -> tuple[Device | None, str]:
    """The one device a step addresses, or (None, why not)."""
    name = spec["device"]
    if spec.get("device_param"):
        name = run.parameters.get(spec["device_param"])
        if not isinstance(name, str) or not name:
            return None, f"run parameter {spec['device_param']!r} must name a device"
    device = Device.objects.filter(name=name).first()
    if device is None or not device.enabled:
        return None, f"device {name} {'is disabled' if device else 'does not exist'}"
    return device, ""


# --- steps ----------------------------------------------------------------------------


def step_start(*, run: JobRun, index: int) -> None:
    """Start the run's step at `index`: a command (one device or a fan-out), a delay, or a
    wait for a device to come online. Idempotent: rows are created once."""
    from . import fanout, waits

    if index >= len(run.plan):
        run_finish(run=run, status=RunStatus.SUCCEEDED)
        return
    spec = run.plan[index]
    if spec.get("kind") == StepKind.DELAY:
        waits.delay_start(run=run, index=index)
        return
    if spec.get("group") or spec.get("labels"):
        fanout.fanout_start(run=run, index=index)
        return
    device, problem = step_target(run, spec)
    if device is None:
        _step_refuse(run, index, spec["device"] or spec.get("device_param", ""), problem)
        return
    try:
        args = step_args(run, spec["args"], device)
    except templating.TemplateError as exc:
        _step_refuse(run, index, device.name, str(exc))
        return
    step_run = step_row_create(run=run, index=index, device=device, action=spec["action"], args=args)
    if spec.get("kind") == StepKind.WAIT_ONLINE:
        waits.wait_online_check(step_run=step_run)
    elif step_run.status == StepStatus.QUEUED:
        step_acquire(step_run=step_run)


def _step_refuse(run: JobRun, index: int, device: str, reason: str) -> None:
    from .outcomes import run_step_done

    event_record("step.failed", run=run, device=device, message=reason, index=index)
    run_step_done(run=run, index=index, ok=False, status=StepStatus.FAILED, error=f"step {index}: {reason}")


def step_row_create(
    *, run: JobRun, index: int, device: Device, action: str, args: dict, phase: str = Phase.FORWARD
) -> StepRun:
    """The queued row of a step (once), with its queue deadline."""
    spec = run.plan[index]
    now = timezone.now()
    try:
        # Insert first: the row usually does not exist yet. A redelivered task hits the
        # unique (run, phase, index, device) constraint and reads the row it made before.
        with transaction.atomic():
            step_run = StepRun.objects.create(
                run=run,
                phase=phase,
                index=index,
                device=device,
                action=action,
                args=args,
                status=StepStatus.QUEUED,
                queued_at=now,
                deadline=now + timedelta(seconds=spec["queue_timeout_seconds"]),
            )
            event_record("step.queued", step_run=step_run, message=f"{device.name} {action}")
    except IntegrityError:
        step_run = StepRun.objects.get(run=run, phase=phase, index=index, device=device)
    step_run.run = run
    # Its queue deadline goes to Redis only if it has to wait (step_acquire): most steps get
    # their device at once. Should this process die first, the database sweep finds the row.
    return step_run


def step_acquire(*, step_run: StepRun, quiet: bool = False) -> None:
    """Take the device lock and dispatch, or wait (device busy or offline; no worker waits).

    A step for an offline device stays queued outside the lock queue; the device's return
    online (jobs/presence.py) acquires for it. Its queue deadline bounds the wait.
    """
    if not step_run.device.reachable:
        _queue_deadline_set(step_run)
        if not quiet:
            event_record(
                "step.waiting", step_run=step_run, message=f"device {step_run.device.name} is offline"
            )
        return
    outcome = device_lock_acquire(
        step_run.device.name,
        holder=step_holder(step_run),
        priority=step_run.run.priority,
        lease_seconds=lease_seconds(step_spec(step_run)),
    )
    if isinstance(outcome, Grant):
        # The grant's lease already covers this step's timeout: no extend needed.
        step_dispatch(step_run_id=step_run.pk, fence=outcome.fence, step_run=step_run, lease_fresh=True)
        return
    _queue_deadline_set(step_run)
    if isinstance(outcome, NotReady):
        from .monitor import locks_rebuild

        # Redis lost the locks; rebuilding them re-acquires every queued step, this one too.
        locks_rebuild()
    elif not quiet:
        event_record("step.waiting", step_run=step_run, message=f"device busy, position {outcome.position}")


def _queue_deadline_set(step_run: StepRun) -> None:
    if step_run.deadline is not None:
        deadlines_set({Deadline("queue", step_run.pk, step_run.attempt): step_run.deadline})


def step_dispatch(
    *, step_run_id: int, fence: int, step_run: StepRun | None = None, lease_fresh: bool = False
) -> None:
    """Commit the attempt (command id, fence, deadlines), then publish the command.

    `step_run` may be passed when the caller has just loaded it; the compare-and-set on
    (status, attempt) keeps a stale copy harmless.
    """
    if step_run is None:
        step_run = StepRun.objects.select_related("run", "device").get(pk=step_run_id)
    if step_run.status != StepStatus.QUEUED or step_run.run.status not in RUN_ACTIVE:
        if step_run.status in STEP_IN_FLIGHT and step_run.fence == fence:
            return  # redelivered task: already dispatched under this grant
        lock_pass_on(step_run.device.name, holder=step_holder(step_run), fence=fence)
        return
    spec = step_spec(step_run)
    now = timezone.now()
    spacing = device_flow_wait(step_run.device)
    if spacing > 0:
        # Flow control: keep the lock, publish when the device may take the next command.
        deadlines_set({Deadline("dispatch", step_run.pk, step_run.attempt): now + timedelta(seconds=spacing)})
        device_lock_extend(
            step_run.device.name,
            holder=step_holder(step_run),
            fence=fence,
            lease_seconds=lease_seconds(spec) + spacing,
        )
        event_record("step.spaced", step_run=step_run, message=f"flow control: sending in {spacing:.1f}s")
        return
    attempt = step_run.attempt + 1
    changes = {
        "status": StepStatus.DISPATCHED,
        "attempt": attempt,
        "command_id": command_id_new(step_run, attempt),
        "fence": fence,
        "deadline": now + timedelta(seconds=spec["timeout_seconds"]),
        "dispatched_at": now,
        "acked_at": None,
        "progress": None,
    }
    deadlines = {Deadline("done", step_run.pk, attempt): changes["deadline"]}
    if spec.get("ack_timeout_seconds"):
        deadlines[Deadline("ack", step_run.pk, attempt)] = now + timedelta(
            seconds=spec["ack_timeout_seconds"]
        )
    # Deadlines go in before the commit: if this process dies after committing, the
    # `send` deadline re-sends the command and `done` times the attempt out.
    with redis_connection().pipeline(transaction=False) as pipe:
        deadlines_set(
            {
                **deadlines,
                Deadline("send", step_run.pk, attempt): now + timedelta(seconds=SEND_CHECK_SECONDS),
            },
            pipe=pipe,
        )
        deadlines_clear([Deadline("queue", step_run.pk, step_run.attempt)], pipe=pipe)
        pipe.execute()
    with transaction.atomic():
        claimed = StepRun.objects.filter(
            pk=step_run.pk, status=StepStatus.QUEUED, attempt=step_run.attempt
        ).update(**changes)
        if not claimed:
            return
        for field, value in changes.items():
            setattr(step_run, field, value)
        event_record("step.dispatched", step_run=step_run, message=f"attempt {attempt}, fence {fence}")
    if not lease_fresh:
        device_lock_extend(
            step_run.device.name, holder=step_holder(step_run), fence=fence, lease_seconds=lease_seconds(spec)
        )
    device_flow_record(step_run.device)
    if command_send(step_run=step_run):
        deadlines_clear([Deadline("send", step_run.pk, attempt)])


def command_send(*, step_run: StepRun) -> bool:
    """Publish the step's current command (QoS 1); False (and an event) when it failed.

    A failed publish is retried by the `send` deadline; the device deduplicates by id.
    """
    payload = protocol.command_payload(
        command_id=step_run.command_id,
        run=str(step_run.run_id),
        step=step_run.index,
        attempt=step_run.attempt,
        token=step_run.fence,
        action=step_run.action,
        args=step_run.args,
        deadline=step_run.deadline.isoformat(),
    )
    try:
        publisher.publish(step_run.device.command_topic_for(step_run.action), payload)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=str(exc))
        return False
    return True


def command_resend(*, step_run_id: int, attempt: int) -> None:
    """The `send` deadline: re-send a command whose publish was never confirmed."""
    step_run = (
        StepRun.objects.select_related("run", "device")
        .filter(pk=step_run_id, attempt=attempt, status=StepStatus.DISPATCHED)
        .first()
    )
    if step_run is None:
        return
    event_record("step.resent", step_run=step_run, message="publish was not confirmed; sending again")
    if not command_send(step_run=step_run):
        deadlines_set(
            {Deadline("send", step_run.pk, attempt): timezone.now() + timedelta(seconds=SEND_CHECK_SECONDS)}
        )
    else:
        deadlines_clear([Deadline("send", step_run.pk, attempt)])


def lock_pass_on(device: str, *, holder: str, fence: int) -> None:
    """Release a lock this holder no longer needs and start whoever gets it next."""
    grant = device_lock_release(device, holder=holder, fence=fence)
    if grant is not None:
        device_lock_handoff(device, grant)


def _step_handoff(device: str, grant: Grant) -> None:
    step_dispatch(step_run_id=int(grant.holder.partition(":")[2]), fence=grant.fence)


grant_handler_register(HOLDER_KIND, _step_handoff)
