"""The jobs app's families (jobs/metrics.py) take every label value jobs computes at run time.

A new deadline kind, terminal status or dropped-reply kind that is counted without being
declared fails here, not in production.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from iotqueue.metrics import MetricsBatch
from jobs import monitor
from jobs.deadlines import KINDS, Deadline
from jobs.events import ATTEMPT_ENDS, DROPPED_MESSAGE_KINDS, event_metrics
from jobs.models import RUN_TERMINAL, STEP_TERMINAL, StepRun, StepStatus

EVENT_KINDS = [
    "run.started",
    *(f"run.{status}" for status in RUN_TERMINAL),
    # Sorted: a set's order changes with the hash seed, and pytest-xdist's workers (each with
    # its own seed) must collect the same tests in the same order.
    *(f"step.{status}" for status in sorted({*STEP_TERMINAL, *ATTEMPT_ENDS, StepStatus.DISPATCHED})),
    *DROPPED_MESSAGE_KINDS,
]


def dispatched_step() -> StepRun:
    """A step row (not saved) queued, dispatched and finished a second apart each."""
    now = timezone.now()
    return StepRun(
        queued_at=now - timedelta(seconds=2), dispatched_at=now - timedelta(seconds=1), finished_at=now
    )


@pytest.mark.parametrize("kind", EVENT_KINDS)
def test_every_counted_event_kind_is_declared(kind):
    # when an event that counts is recorded for a dispatched step
    batch = event_metrics(kind, dispatched_step())

    # then it counts something (and raised nothing: its label values are declared)
    assert batch


def test_every_deadline_kind_the_monitor_fires_is_declared(monkeypatch):
    # given a tick that found a due deadline of every kind, a reclaimed lease, a sweep and a rebuild
    sent: list[MetricsBatch] = []
    monkeypatch.setattr(MetricsBatch, "send", lambda batch: sent.append(batch))
    due = [Deadline(kind, n, 1) for n, kind in enumerate(KINDS)]

    # when the tick counts its work, it raises nothing and sends one batch
    monitor._actions_count(due, leases=1, swept=1, rebuilt=True)

    assert len(sent) == 1 and sent[0]
