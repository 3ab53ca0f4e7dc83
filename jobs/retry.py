"""Retry from the failed step: a new run that carries over what already happened.

The failed run stays as it ended (terminal states never change: late replies to it are
still recorded as stale). The retry is a new run of the same plan snapshot and
parameters, linked by `retry_of`, whose cursor starts at the step the old run stopped on:

- rows of the steps before it are copied as they ended (results included, so
  `{{ steps.NAME.result }}` still resolves), marked with no command id, and never re-sent;
- a fan-out step it stopped on keeps its devices that succeeded and re-runs only the
  others (the three pumps that failed, not all two hundred);
- a single-device, delay or wait step it stopped on runs again from its first attempt.

Not retryable: active or succeeded runs, runs that were rolled back (their earlier steps
were undone, so carrying them over would lie), and runs already retried (retry the retry).
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils.translation import gettext as _

from .events import event_record
from .models import JobRun, Phase, RunStatus, StepRun, StepStatus, Trigger

RETRYABLE = (RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELED)

# Copied as they ended; the command id stays with the old row (it is unique, and a late
# reply to it must find the old run, not the retry).
CARRIED_FIELDS = (
    "index",
    "phase",
    "device_id",
    "action",
    "args",
    "status",
    "attempt",
    "fence",
    "progress",
    "progress_detail",
    "progress_messages",
    "result",
    "error",
    "queued_at",
    "dispatched_at",
    "acked_at",
    "finished_at",
)


class RetryError(ValueError):
    """The run cannot be retried (still active, rolled back, ...); the message says why."""


def run_retry(*, run: JobRun, by: str, trigger: str = Trigger.REST) -> JobRun:
    """Start a new run of `run`'s plan from the step that failed; returns the new run."""
    from .services import _run_enqueue

    try:
        with transaction.atomic():
            run = JobRun.objects.select_for_update().select_related("template").get(pk=run.pk)
            _retryable_check(run)
            start = _retry_start(run)
            retry = JobRun.objects.create(
                template=run.template,
                template_version_id=run.template_version_id,
                parameters=run.parameters,
                plan=run.plan,
                cursor=start,
                trigger=trigger,
                triggered_by=by,
                priority=run.priority,
                max_duration=run.max_duration,
                windows=run.windows,  # its maintenance windows, as its plan (not its own start / end)
                retry_of=run,
            )
            carried = _rows_carry(run, retry, start)
            event_record(
                "run.retried",
                run=run,
                message=f"retried as {retry.pk} from step {start} by {by or 'anonymous'}",
                retry=str(retry.pk),
            )
            event_record(
                "run.created",
                run=retry,
                message=f"{trigger} by {by or 'anonymous'}: retry of {run.pk} from step {start}, "
                f"{carried} step row(s) carried over",
                retry_of=str(run.pk),
                from_step=start,
            )
            transaction.on_commit(lambda: _run_enqueue(retry))
    except IntegrityError:
        raise RetryError(
            _("run %(run)s was already retried; retry that run instead") % {"run": run.pk}
        ) from None
    return retry


def _retryable_check(run: JobRun) -> None:
    existing = JobRun.objects.filter(retry_of=run).values_list("pk", flat=True).first()
    if existing:
        raise RetryError(
            _("run %(run)s was already retried as %(retry)s; retry that run instead")
            % {"run": run.pk, "retry": existing}
        )
    if run.status not in RETRYABLE:
        if run.status == RunStatus.COMPENSATED:
            raise RetryError(_("the run was rolled back, so its earlier steps were undone: start a new run"))
        raise RetryError(
            _("only failed, timed-out or canceled runs can be retried; this one is %(status)s")
            % {"status": run.status}
        )
    if run.step_runs.filter(phase=Phase.COMPENSATION).exists():
        raise RetryError(
            _("the run was (partly) rolled back, so its earlier steps were undone: start a new run")
        )
    if not run.plan:
        raise RetryError(_("the run has no steps"))


def _retry_start(run: JobRun) -> int:
    """The step the old run stopped on; the next one if that step had in fact succeeded
    everywhere (canceled between its last success and the cursor moving on)."""
    start = min(run.cursor, len(run.plan) - 1)
    statuses = set(
        run.step_runs.filter(phase=Phase.FORWARD, index=start).values_list("status", flat=True).distinct()
    )
    return start + 1 if statuses == {StepStatus.SUCCEEDED} else start


def _rows_carry(run: JobRun, retry: JobRun, start: int) -> int:
    """Copy the rows before `start` (and a fan-out's successes at it); returns how many."""
    spec = run.plan[start] if start < len(run.plan) else {}
    rows = list(run.step_runs.filter(phase=Phase.FORWARD, index__lte=start).order_by("index", "pk"))
    copies = [
        StepRun(run=retry, **{field: getattr(row, field) for field in CARRIED_FIELDS})
        for row in rows
        if row.index < start or (row.status == StepStatus.SUCCEEDED and _is_fanout(spec))
    ]
    if _is_fanout(spec):
        # The devices that did not succeed run again; other rows of a fan-out at `start`
        # make fanout_start pump instead of selecting devices afresh.
        copies += [
            StepRun(run=retry, index=start, device_id=row.device_id, action=row.action, args=row.args)
            for row in rows
            if row.index == start and row.status != StepStatus.SUCCEEDED
        ]
    StepRun.objects.bulk_create(copies)
    return sum(1 for copy in copies if copy.status != StepStatus.PENDING)


def _is_fanout(spec: dict) -> bool:
    return bool(spec.get("group") or spec.get("labels") or spec.get("selector") or spec.get("devices_from"))
