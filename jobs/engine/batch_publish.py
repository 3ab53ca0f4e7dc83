"""Stage 5 of a batched transition (jobs/engine/batch.py): after the commit, the commands
leave, and what the batch still writes to Redis is gathered as its `LastWrites`.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from devices.flow import device_flow_record
from devices.models import Device
from iotqueue.metrics import MetricsBatch
from iotqueue.redis_conn import lock_redis_connection, lock_redis_shared, redis_connection

from ..deadlines import Deadline, deadlines_clear, deadlines_set
from ..events import event_record
from .publish import attempts_send, publications_open


class LastWrites:
    """What transitions write to Redis once committed and published, in one round trip (two
    while the locks have a Redis of their own): the `send` deadlines of commands the
    broker acknowledged, the runs' deadlines, the metrics, the send times of commands to
    devices with flow control.

    A transition runs its own (`execute()`), unless its caller gathers them to run them in
    a pipeline of its own commands: the inbox acknowledges its entries and reads the next
    ones in the same round trip (jobs/inbox.py).
    """

    def __init__(self) -> None:
        self.cleared: list[Deadline] = []
        self.deadlines: dict[Deadline, datetime] = {}
        self.metrics = MetricsBatch()
        self.flows: list[Device] = []  # flow-controlled devices sent a command (devices.flow)

    def __bool__(self) -> bool:
        return bool(self.cleared or self.deadlines or self.metrics or self.flows)

    def execute(self, pipe: Any | None = None) -> list:
        """Send the writes; with `pipe` (a pipeline of `redis_connection()`, without a
        transaction), after the caller's commands already on it.

        Returns the replies to the caller's commands, an error as its exception, for the
        caller to judge; an error of the writes' own commands raises (the caller's
        commands were sent all the same).
        """
        if pipe is None:
            if not self:
                return []
            with redis_connection().pipeline(transaction=False) as own:
                return self.execute(own)
        theirs = len(pipe)
        # One round trip while the locks share REDIS_URL; else one more, to LOCK_REDIS_URL.
        locks = pipe if lock_redis_shared() else lock_redis_connection().pipeline(transaction=False)
        deadlines_clear(self.cleared, pipe=locks)
        deadlines_set(self.deadlines, pipe=locks)
        self.metrics.pipe_add(pipe)
        for device in self.flows:
            device_flow_record(device, pipe=pipe)
        self.cleared, self.deadlines, self.flows = [], {}, []
        replies = pipe.execute(raise_on_error=False)
        if locks is not pipe:
            locks.execute()
        for reply in replies[theirs:]:
            if isinstance(reply, Exception):
                raise reply
        return replies[:theirs]


class BatchPublish:
    """Publishing and the last writes. The state is `Executor`'s (jobs/engine/executor.py)."""

    # --- 5. after the commit ---------------------------------------------------------

    def publish(self) -> None:
        """Send every attempt of the batch (jobs/engine/publish.py `attempts_send`: a
        command into the unit of work's `Publications`, a task step's Celery task by its
        kind's `attempt_sender`); then the last writes: clear the `send` deadlines of the
        commands the broker has acknowledged by now, set the runs' deadlines, count the
        metrics — added to the caller's `LastWrites` (`self.last`) or sent here."""
        with publications_open() as publications:
            confirmed, failed = attempts_send(publications, self.dispatches)
        for row, failure in failed:
            # The `send` deadline re-sends it; the device deduplicates by id.
            self.later.append(partial(event_record, "step.publish_failed", step_run=row, message=failure))
        last = self.last if self.last is not None else LastWrites()
        last.cleared += confirmed
        last.deadlines.update(self.run_deadlines)
        last.metrics.extend(self.events.metrics)
        last.flows += self.plan.flow_sent
        if self.last is None:
            last.execute()
