"""Commands published without waiting for the broker, held by the unit of work that published them.

A batched transition publishes its commands at QoS 1 and goes on without waiting for the
broker's PUBACKs (jobs/engine/batch_publish.py); each command's `send` deadline stays set
until its PUBACK is seen. A `Publications` holds those commands for one unit of work: a
Celery task (jobs/tasks.py opens one around every task) or a transition called outside
one (a test, a shell: `publications_open` opens one for the transition's time). While it
is open, each transition asks it which `send` deadlines can be cleared by now (they join
its last pipeline); when it closes, it waits for the rest and clears theirs. The
PUBACKs of one batch thus arrive while the next is applied, and a task never returns
with a command whose fate it did not look at.

The open one is found through a context variable that its `with` block sets and resets:
nothing outlives the unit of work, and a transition deep in the general path (a fan-out's
pump starting its rows on commit) publishes into its task's without being handed it.

How it fails: a command the broker has not acknowledged PUBLISH_TIMEOUT_SECONDS after its
publish makes the process drop its MQTT client, as a failed `publish` does
(iotqueue/mqtt.py): a late copy must never leave after its attempt moved on. Every
command still unconfirmed then is left to its `send` deadline, which re-sends it (the
device deduplicates by id); so is a command held by a worker that dies.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import Any

from iotqueue.mqtt import PUBLISH_TIMEOUT_SECONDS, publisher

from ..deadlines import Deadline, deadlines_clear
from ..models import StepRun
from .dispatch import command_message
from .kinds import REGISTRY, row_commanded
from .plan import spec_kind, step_spec

log = logging.getLogger(__name__)


class Publications:
    """The commands a unit of work handed to the MQTT client whose PUBACK it has not seen
    yet; a context manager: on exit it waits for them and clears their `send` deadlines."""

    def __init__(self) -> None:
        # (message info, its `send` deadline, time.monotonic() when published), oldest first.
        self._waiting: list[tuple[Any, Deadline, float]] = []
        self._token: Token | None = None

    def __enter__(self) -> Publications:
        self._token = _open.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            deadlines_clear(self.confirmed(wait=True))
        finally:
            _open.reset(self._token)
            self._token = None

    def publish(self, rows: list[StepRun]) -> list[tuple[StepRun, str]]:
        """Publish each row's current command without waiting for the broker (QoS 1).

        The `send` deadlines stay until the broker's acknowledgement is seen (`confirmed`);
        returns (row, why) for commands that could not be queued at all, which their
        `send` deadline re-sends.
        """
        outcomes = publisher.publish_nowait([command_message(row) for row in rows])
        failed, now = [], time.monotonic()
        for row, outcome in zip(rows, outcomes, strict=True):
            if isinstance(outcome, str):
                failed.append((row, outcome))
            else:
                self._waiting.append((outcome, Deadline.of("send", row), now))
        return failed

    def confirmed(self, *, wait: bool = False) -> list[Deadline]:
        """The `send` deadlines of commands the broker acknowledged since the last call.

        With `wait`, waits for the others (each up to PUBLISH_TIMEOUT_SECONDS from its
        publish). One left unacknowledged past that makes the client drop its queue, as a
        failed `publish` does (iotqueue/mqtt.py): a late copy must never leave after its
        attempt moved on; every unconfirmed command is then left to its `send` deadline.
        """
        confirmed, waiting = [], []
        for info, send, published_at in self._waiting:
            remaining = published_at + PUBLISH_TIMEOUT_SECONDS - time.monotonic()
            if wait and remaining > 0 and not info.is_published():
                with contextlib.suppress(RuntimeError, ValueError):
                    info.wait_for_publish(timeout=remaining)
            if info.is_published():
                confirmed.append(send)
            elif time.monotonic() - published_at > PUBLISH_TIMEOUT_SECONDS:
                seconds = PUBLISH_TIMEOUT_SECONDS
                log.warning("no PUBACK for %s within %ss; dropping the MQTT client", send.member, seconds)
                publisher.close()
                self._waiting.clear()
                return confirmed
            else:
                waiting.append((info, send, published_at))
        self._waiting[:] = waiting
        return confirmed


# The unit of work's open Publications, set by its `with` block for the block's time.
_open: ContextVar[Publications | None] = ContextVar("publications", default=None)


@contextlib.contextmanager
def publications_open() -> Iterator[Publications]:
    """The unit of work's open `Publications`; outside one, a new one for the block's time
    (a transition called directly then waits for its own PUBACKs at its end)."""
    current = _open.get()
    if current is not None:
        yield current
        return
    with Publications() as own:
        yield own


def attempts_send(
    publications: Publications, rows: list[StepRun]
) -> tuple[list[Deadline], list[tuple[StepRun, str]]]:
    """Send each row's current attempt: a command into `publications` (its `send` deadline
    is cleared once the broker acknowledged it), a kind's own attempt (a task step's Celery
    task) by the kind's `attempt_sender`. Returns the `send` deadlines that can be cleared
    now, and the (row, why) of commands that could not be queued at all (a sender that
    failed recorded its own event); their `send` deadline sends them again."""
    commands = [row for row in rows if row_commanded(row)]
    failed = publications.publish(commands)
    confirmed = publications.confirmed()
    for row in rows:
        if not row_commanded(row) and REGISTRY.attempt_senders[spec_kind(step_spec(row))](step_run=row):
            confirmed.append(Deadline.of("send", row))
    return confirmed, failed
