"""Stage 5 of a batched transition (jobs/engine/batch.py): after the commit, the commands
leave and the batch's last pipeline runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from iotqueue.redis_conn import lock_redis_connection, lock_redis_shared, redis_connection

from ..deadlines import deadlines_clear, deadlines_set
from ..events import event_record
from .dispatch import commands_confirmed, commands_publish

# Adds commands to a Redis pipeline; may return a function that is handed the replies
# to those commands (an error as its exception) once the pipeline ran.
PipeHook = Callable[[Any], Callable[[list], None] | None]


class BatchPublish:
    """Publishing and the last pipeline. The state is `_Batch`'s (jobs/engine/batch.py)."""

    # --- 5. after the commit ---------------------------------------------------------

    def publish(self) -> None:
        """Publish every command of the batch; clear the `send` checks of those the broker
        has acknowledged by now, count the metrics, run the caller's `finally_` commands
        (the inbox acknowledges the batch's entries there and reads the next ones)."""
        for row, failure in commands_publish(self.dispatches):
            # The `send` deadline re-sends it; the device deduplicates by id.
            self.later.append(partial(event_record, "step.publish_failed", step_run=row, message=failure))
        confirmed = commands_confirmed()
        with redis_connection().pipeline(transaction=False) as pipe:
            # One round trip while the locks share REDIS_URL; else one more, to LOCK_REDIS_URL.
            locks = pipe if lock_redis_shared() else lock_redis_connection().pipeline(transaction=False)
            deadlines_clear(confirmed, pipe=locks)
            deadlines_set(self.run_deadlines, pipe=locks)
            self.events.metrics.pipe_add(pipe)
            takers = []
            for hook in self.finally_:
                start = len(pipe)
                take = hook(pipe)
                if take is not None:
                    takers.append((take, start, len(pipe)))
            # A hook's own commands answer to it, errors included; any other error raises.
            replies = pipe.execute(raise_on_error=False)
            if locks is not pipe:
                locks.execute()
        taken = {i for _, start, end in takers for i in range(start, end)}
        for i, reply in enumerate(replies):
            if i not in taken and isinstance(reply, Exception):
                raise reply
        for take, start, end in takers:
            take(replies[start:end])
