"""Which retained-message filters a bridge's broker session holds, so a restart does not replay them.

MQTT 3.1.1 has a broker send every retained message matching a filter again whenever that
filter is subscribed, even when the session holds the same subscription already. A bridge
that resubscribed its device `status` filter at every connection would so receive the
retained status of every device (100,000 of them take ~10 s) ahead of the replies queued
for it while it was away. Instead, once the broker acknowledged such a filter, the bridge
notes it here, a Redis set per client id; connecting again to a session the broker kept
(CONNACK's session-present flag), it leaves the noted filters alone: the session still
has them and has queued whatever status changed meanwhile (statuses are QoS 1). A new
session forgets the notes first.

How it fails: safe side only. When Redis cannot be read, or the note was never written
(the process died between CONNACK and SUBACK), the filter is subscribed again and the
statuses are replayed, as before; a note outliving its session is discarded at the next
connection without session-present.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from .redis_conn import redis_connection, redis_key

log = logging.getLogger(__name__)


def _key(client_id: str) -> str:
    return redis_key("bridge", client_id, "retained-filters")


def retained_filters_held(client_id: str, *, session_present: bool) -> set[str]:
    """The retained filters the broker session of `client_id` holds; an empty set for a new
    session (whose notes are forgotten) or when Redis cannot say."""
    try:
        if not session_present:
            redis_connection().delete(_key(client_id))
            return set()
        return set(redis_connection().smembers(_key(client_id)))
    except RedisError as exc:
        log.warning("bridge: could not read which retained filters the session holds (%r)", exc)
        return set()


def retained_filter_noted(client_id: str, topic_filter: str) -> None:
    """The broker acknowledged `topic_filter` for this session."""
    try:
        redis_connection().sadd(_key(client_id), topic_filter)
    except RedisError as exc:
        log.warning("bridge: could not note the retained filter %r (%r)", topic_filter, exc)
