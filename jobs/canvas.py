"""Device commands as Celery signatures: links of your own chains, groups and chords.

    from jobs.canvas import device_command

    flash = device_command("pump-7", "flash", {"url": "{{ params.previous.url }}"})
    chain(fetch_firmware_url.s("v2.1"), flash, report.s()).apply_async()
    chord(device_command(d, "selftest") for d in pumps)(summarize.s())

How a link runs (task `jobs.device_command`):

1. **Park.** The task creates a run of one command step (trigger `canvas`, template
   "Celery canvas") whose parameters hold the previous link's return value as `previous`
   (so args may say `{{ params.previous.url }}`), and a `CanvasLink` holding what Celery
   would have done next: the rest of the chain, callbacks, errbacks and chord of this task
   id. It then clears those from the task's request and ends with `Ignore`, so that Celery
   sends nothing on and stores no result: the worker is free while the device works. A
   redelivered task finds its run (idempotency key `canvas:<task id>`) and parks nothing new.
2. **Run.** The step is an ordinary command step: the device's FIFO lock and priority,
   timeouts, attempts and backoff, cancel, the timeline in the admin and the API.
3. **Resume.** When the run ends (jobs.events.run_ended, after commit) `jobs.canvas_resume`
   takes the link once (`resumed_at`) and does what the tracer would have done: on success
   it stores the device's result under the link's task id (so `AsyncResult(id).get()` and
   chords see it: a chord counts the link only now) and sends the chain and callbacks on
   with that result; on failure, timeout or cancel it marks the link failed with
   `DeviceCommandFailed`, which stops the chain, fails the chord and calls the errbacks.

**Cancel a whole canvas** by its root task's id (jobs/cancel.py `canvas_cancel`,
`POST /api/canvases/<root_id>/cancel/`, `manage.py canvas_cancel`): its runs that have not
ended are canceled, and a later link of it refuses to park (`canvas_refuse_if_canceled`).

Results need a result backend for chords and `AsyncResult` (CELERY_RESULT_BACKEND, Redis by
default); chains work without one.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app, group, signature
from celery.app.task import Context
from celery.canvas import Signature
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from devices.models import Device

from .cancel import canvas_canceled_by, run_cancel
from .events import event_run
from .models import RUN_TERMINAL, CanvasLink, JobStep, JobTemplate, RunStatus, StepRun, Trigger
from .parameters import parameters_missing, parameters_missing_message, template_parameters
from .services import PLAN_FIELDS, RunStartError, run_start

log = logging.getLogger(__name__)

PARK_TASK = "jobs.device_command"
RESUME_TASK = "jobs.canvas_resume"
# The template canvas runs are filed under (created on first use; it has no steps).
CANVAS_TEMPLATE = "Celery canvas"
# Step options a caller may give, as on a template step.
STEP_OPTIONS = (
    "timeout_seconds",
    "ack_timeout_seconds",
    "queue_timeout_seconds",
    "max_attempts",
    "backoff_seconds",
)
# The parameters a canvas command's run has: the previous link's return value (None first).
CANVAS_PARAMETERS = ("previous",)
# What of a task's request is kept to go on with later (Celery's own names).
CONTINUATION_FIELDS = (
    "id",
    "root_id",
    "parent_id",
    "chain",
    "callbacks",
    "errbacks",
    "chord",
    "group",
    "group_index",
    "delivery_info",
    "task",
)


class DeviceCommandFailed(Exception):
    """A canvas device command did not succeed (failed, timed out or canceled)."""


def device_command(
    device: Device | str, action: str, args: dict | None = None, **step_options: Any
) -> Signature:
    """A signature that sends `action` to `device` and returns the device's result.

    `step_options`: timeout_seconds, ack_timeout_seconds, queue_timeout_seconds,
    max_attempts, backoff_seconds (as on a template step) and priority (0-9). Args may read
    `{{ params.previous… }}` (the previous link's result) and no other parameter: any other
    raises ValueError here, before a canvas is sent or a run exists.
    """
    unknown = set(step_options) - {*STEP_OPTIONS, "priority"}
    if unknown:
        raise TypeError(f"device_command: unknown options {sorted(unknown)}")
    needed = template_parameters([{"args": args or {}}])
    missing = parameters_missing(needed, dict.fromkeys(CANVAS_PARAMETERS))
    if missing:
        # Found when the canvas is built, not when a worker parks it: no run could have them.
        message = _(
            "device_command: %(problem)s; a canvas command has one parameter, previous, "
            "the previous link's result"
        )
        raise ValueError(message % {"problem": parameters_missing_message(missing)})
    name = device.name if isinstance(device, Device) else str(device)
    return signature(
        PARK_TASK, kwargs={"device": name, "action": action, "args": args or {}, "options": step_options}
    )


def canvas_template() -> JobTemplate:
    template, _ = JobTemplate.objects.get_or_create(
        name=CANVAS_TEMPLATE,
        defaults={
            "description": "Runs of device commands sent from Celery canvases (jobs.canvas.device_command)."
        },
    )
    return template


def canvas_spec(device: str, action: str, args: dict, options: dict[str, Any]) -> dict[str, Any]:
    """The plan entry of a canvas command: a template step's defaults, then the options."""
    step = JobStep(name=action, action=action, args=args)
    spec = {name: getattr(step, name) for name in PLAN_FIELDS}
    spec.update(device=device, group="", **{k: v for k, v in options.items() if k in STEP_OPTIONS})
    return spec


def canvas_park(
    request: Context, *, previous: Any, device: str, action: str, args: dict, options: dict
) -> str:
    """Start the command's run and take the task's continuation into it; returns the run id.

    Raises DeviceCommandFailed when the command cannot start (unknown device, bad args):
    the task then fails like any task, with its chain stopped and its errbacks called.
    """
    if not Device.objects.filter(name=device).exists():
        raise DeviceCommandFailed(_("no device named '%(device)s'") % {"device": device})
    root_id = request.root_id or request.id
    canvas_refuse_if_canceled(root_id)
    continuation = {field: getattr(request, field, None) for field in CONTINUATION_FIELDS}
    continuation["delivery_info"] = {"priority": (request.delivery_info or {}).get("priority")}
    try:
        with transaction.atomic():
            run, created = run_start(
                template=canvas_template(),
                plan=[canvas_spec(device, action, args, options)],
                parameters={"previous": previous},
                trigger=Trigger.CANVAS,
                triggered_by=f"celery {root_id}"[:150],
                priority=options.get("priority"),
                idempotency_key=f"canvas:{request.id}",
            )
            if created:
                CanvasLink.objects.create(run=run, task_id=request.id, request=continuation)
    except RunStartError as exc:
        raise DeviceCommandFailed(f"{exc.field}: {exc}") from None
    by = canvas_canceled_by(root_id)
    if by is not None:
        run_cancel(run=run, by=by)  # the canvas was canceled while this run was being written
    # Nothing goes on when this task returns: the run's end sends it on (canvas_resume).
    request.chain = request.callbacks = request.errbacks = request.chord = None
    return str(run.pk)


def canvas_refuse_if_canceled(root_id: str) -> None:
    """A later command of a canceled canvas (jobs/cancel.py `canvas_cancel`) starts no run:
    it fails like a command that cannot start, so its chain stops and its errbacks run."""
    by = canvas_canceled_by(root_id)
    if by is not None:
        message = _("canvas %(root)s was canceled by %(by)s; this command is not started")
        raise DeviceCommandFailed(message % {"root": root_id, "by": by})


def run_ended(sender, event, **kwargs) -> None:
    """jobs.events.run_ended: a canvas run's link resumes after the transaction commits."""
    run = event_run(event)
    if run is None or run.trigger != Trigger.CANVAS:
        return
    run_id = str(run.pk)
    transaction.on_commit(
        lambda: current_app.signature(RESUME_TASK, args=(run_id,)).apply_async(argsrepr=f"runs=[{run_id}]")
    )


def canvas_resume(run_id: str) -> bool:
    """Send the link's canvas on with the run's outcome (once); False when already done."""
    link = CanvasLink.objects.select_related("run").filter(run_id=run_id, resumed_at=None).first()
    if link is None or link.run.status not in RUN_TERMINAL:
        return False
    if not CanvasLink.objects.filter(pk=link.pk, resumed_at=None).update(resumed_at=timezone.now()):
        return False  # another resume took it
    run, request = link.run, Context(link.request)
    request.ignore_result = False
    backend = current_app.backend
    if run.status == RunStatus.SUCCEEDED:
        step = StepRun.objects.filter(run=run).order_by("-pk").first()
        result = step.result if step is not None else {}
        _send_on(request, result)
        backend.mark_as_done(link.task_id, result, request=request)
    else:
        reason = run.error or _("no result")
        exc = DeviceCommandFailed(
            _("run %(run)s %(status)s: %(reason)s") % {"run": run.pk, "status": run.status, "reason": reason}
        )
        backend.mark_as_failure(link.task_id, exc, request=request, call_errbacks=True)
    log.info("canvas link %s resumed (run %s %s)", link.task_id, run.pk, run.status)
    return True


def _send_on(request: Context, result: Any) -> None:
    """What Celery's tracer does after a successful task: callbacks, then the chain's next."""
    parent_id, root_id = request.id, request.root_id or request.id
    priority = (request.delivery_info or {}).get("priority")
    callbacks = [signature(cb, app=current_app) for cb in request.callbacks or []]
    if len(callbacks) == 1:
        callbacks[0].apply_async((result,), parent_id=parent_id, root_id=root_id, priority=priority)
    elif callbacks:
        for sig in [cb for cb in callbacks if isinstance(cb, group)]:
            sig.apply_async((result,), parent_id=parent_id, root_id=root_id, priority=priority)
        rest = [cb for cb in callbacks if not isinstance(cb, group)]
        if rest:
            group(rest, app=current_app).apply_async(
                (result,), parent_id=parent_id, root_id=root_id, priority=priority
            )
    if request.chain:
        chain = list(request.chain)
        following = signature(chain[-1], app=current_app)
        following.apply_async(
            (result,), chain=chain[:-1], parent_id=parent_id, root_id=root_id, priority=priority
        )
