"""A continuous fan-out's record: opening it (what joining devices look for, and its end-by)
and whether it is still open.

The fan-out's start opens it (jobs/engine/fanout.py) and a row's end asks whether it is
open before deciding the step (jobs/engine/fanout_progress.py); joining and closing it are
jobs/engine/continuous.py.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

from django.db import transaction
from django.utils import timezone

from ..deadlines import FANOUT_CLOSE, Deadline, deadlines_set
from ..events import event_record
from ..models import ContinuousFanout, JobRun


def fanout_open(*, run: JobRun, index: int) -> ContinuousFanout:
    """Open a continuous fan-out: record it (what joining devices look for) and set its
    end-by (`fanout_close` deadline, jobs/engine/continuous.py) when it has `open_seconds`."""
    spec = run.plan[index]
    now = timezone.now()
    seconds = spec.get("open_seconds")
    closes_at = now + timedelta(seconds=seconds) if seconds else None
    opened, created = ContinuousFanout.objects.get_or_create(
        run=run, index=index, defaults={"closes_at": closes_at}
    )
    if created:
        until = f"until {closes_at:%Y-%m-%d %H:%M:%S} UTC" if closes_at else "until closed by hand"
        event_record(
            "step.fanout_opened",
            run=run,
            message=f"continuous: devices that come to match join {until}",
            index=index,
            closes_at=closes_at.isoformat() if closes_at else None,
        )
    if opened.closes_at is not None:
        deadline = Deadline(FANOUT_CLOSE, str(run.pk), index)
        transaction.on_commit(partial(deadlines_set, {deadline: opened.closes_at}))
    return opened


def fanout_is_open(run: JobRun, index: int) -> bool:
    """Whether the step is a continuous fan-out still open (one query, only for those)."""
    if not run.plan[index].get("continuous"):
        return False
    return ContinuousFanout.objects.filter(run=run, index=index, closed_at=None).exists()
