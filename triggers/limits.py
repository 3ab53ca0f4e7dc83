"""A trigger rule's limits: messages per minute (a Redis window all bridge replicas share)
and runs not yet ended (counted in the database)."""

from __future__ import annotations

import enum
import functools
import time
import uuid
from pathlib import Path

from iotqueue.redis_conn import redis_connection, redis_key
from jobs.models import RUN_TERMINAL

from .models import TriggeredRun, TriggerRule

# max_runs_per_minute counts the messages a rule acted on in any window this long.
WINDOW_SECONDS = 60


class RateVerdict(enum.IntEnum):
    """What the window says of one message (the values lua/rule_rate.lua returns)."""

    ADMITTED = 0
    DROPPED_FIRST = 1  # the first drop of this window: worth an event
    DROPPED = 2  # a later drop of the same window: already reported


@functools.cache
def _rate_script():
    return redis_connection().register_script((Path(__file__).with_name("lua") / "rule_rate.lua").read_text())


def rule_rate_admit(rule: TriggerRule, *, now: float | None = None) -> RateVerdict:
    """Count one message against the rule's sliding window, atomically across bridges.

    A message is admitted while fewer than `max_runs_per_minute` were admitted in the last
    minute. Raises RedisError when Redis is unreachable: the bridge then logs the failed
    handler and the message is not acted on (a rule fails closed, not open).
    """
    tag = "{rule:" + str(rule.pk) + "}"  # the hash tag keeps the rule's two keys in one Cluster slot
    keys = [redis_key("trigger", tag, "window"), redis_key("trigger", tag, "dropped")]
    now_ms = int((time.time() if now is None else now) * 1000)
    args = [rule.max_runs_per_minute, WINDOW_SECONDS * 1000, now_ms, uuid.uuid4().hex]
    return RateVerdict(_rate_script()(keys=keys, args=args))


def rule_active_runs(rule: TriggerRule) -> int:
    """Runs this rule started that have not ended."""
    return TriggeredRun.objects.filter(rule=rule).exclude(run__status__in=RUN_TERMINAL).count()
