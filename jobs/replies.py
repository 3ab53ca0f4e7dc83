"""Bridge handlers for device replies: validate cheaply, hand off to Celery in groups.

Malformed messages are dropped here and noted in the bridge's dropped-message tally
(iotqueue/budget.py): the bridge's run loop hands its summaries to `dropped_summaries_record`,
which writes them as `message.dropped` events, a few per device and window, never one per
message, and never on the bridge's network thread. Every valid ack,
progress and done joins the bridge's reply batcher (iotqueue/batching.py), which hands
the replies that arrived together to the workers as one group (jobs/inbox.py): a
worker applies what has gathered in one transaction and one lock call
(jobs/engine/batch.py), and checks each reply against the database there (current,
stale, unknown, foreign). The bridge itself reads and writes no row per reply.
"""

from __future__ import annotations

from celery import current_app
from django.conf import settings
from django.db import close_old_connections

from devices import protocol
from devices.models import Device
from iotqueue.batching import Batcher
from iotqueue.bridge import BRIDGE_MESSAGES, Handler, ack_defer, message_again
from iotqueue.budget import DropSummary, MessageBudget, message_drop_note
from iotqueue.metrics import counter_buffer

from .current import JOBS_GET_BURST, JOBS_GET_RATE, JOBS_GET_TASK
from .events import EventLog
from .inbox import replies_enqueue
from .models import RunEvent
from .rows import Writes, rows_atomic

# A dropped message's reason groups the device's drops in the tally; this much of it (a
# device cannot make a reason of its payload: protocol errors name fields, not values).
DROP_REASON_CHARS = 80

# Replies that arrive together go to the workers as one group ([[device, payload], ...]).
reply_batcher = Batcher(
    replies_enqueue,
    max_items=settings.IOTQUEUE_REPLY_BATCH_MAX,
    idle_seconds=settings.IOTQUEUE_REPLY_BATCH_IDLE_MS / 1000,
    max_wait_seconds=settings.IOTQUEUE_REPLY_BATCH_MAX_WAIT_MS / 1000,
    name="replies",
)


def reply_accept(device: str, kind: str | None, topic: str, payload: bytes) -> None:
    """Parse one reply; enqueue it for the engine or record why it was dropped."""
    try:
        body = protocol.payload_json(payload)
        reply = protocol.reply_parse(kind or protocol.reply_kind_infer(body), body)
    except protocol.ProtocolError as exc:
        message_dropped(device, topic, payload, str(exc))
        return
    counter_buffer.add(BRIDGE_MESSAGES, "accepted")
    # The device's message is acknowledged to the broker once its group is in the inbox. A
    # `done` goes at once (with the ack or progress gathered before it): nothing more is
    # coming for its command, and the next step waits for it.
    reply_batcher.add([device, reply.as_task_payload()], ack_defer(), urgent=reply.kind == "done")


def reply_message_handle(topic: str, payload: bytes) -> None:
    """Handler for P/<device>/ack|progress|done."""
    parsed = protocol.topic_parse(topic)
    if parsed is None:
        return
    device, kind = parsed
    reply_accept(device, kind, topic, payload)


# Each device's jobs/get questions, answered at most this often (a Celery task each).
jobs_get_budget = MessageBudget(rate=JOBS_GET_RATE, burst=JOBS_GET_BURST)


def jobs_get_handle(topic: str, payload: bytes) -> None:
    """Handler for P/<device>/jobs/get (protocol v1.1): a worker answers on jobs/current.

    The bridge reads no row for it: the question goes to the `jobs.device_jobs_get` task
    (by name, jobs/current.py); the payload (empty or an object) carries nothing else. A
    device asking faster than JOBS_GET_RATE is not answered more often (the answer would
    be the same): the excess is dropped and counted, so its questions cannot fill the
    workers' queue ahead of other devices' work.
    """
    device = protocol.jobs_get_device(topic)
    if device is None:
        return
    try:
        protocol.jobs_get_parse(payload)
    except protocol.ProtocolError as exc:
        message_dropped(device, topic, payload, str(exc))
        return
    if not message_again() and not jobs_get_budget.admit(device):
        why = f"jobs/get over {JOBS_GET_RATE:g} a second; not answered again"
        message_dropped(device, topic, payload, why)
        return
    counter_buffer.add(BRIDGE_MESSAGES, "accepted")
    current_app.signature(JOBS_GET_TASK, args=(device,)).apply_async(argsrepr=f"devices=[{device}]")


def message_dropped(device: str, topic: str, payload: bytes, why: str) -> None:
    """A malformed (or unwanted) message from `device`: counted, and noted for the summary."""
    counter_buffer.add(BRIDGE_MESSAGES, "malformed")
    reason = why[:DROP_REASON_CHARS]
    message_drop_note(device=device, reason=reason, message=why, topic=topic, size=len(payload))


def dropped_summaries_record(summaries: list[DropSummary]) -> None:
    """The bridge's dropped-message summaries as `message.dropped` events, in one INSERT.

    Called from the bridge's run loop (iotqueue/budget.py). A summary of one message reads
    as that message's own event; one of many names the count and the last one's reason.
    How it fails: a database error raises to the bridge, which logs it and goes on (the
    counts on /metrics stay); those summaries are not written.
    """
    close_old_connections()
    events = EventLog()  # its metrics are not sent: each message was counted as it came
    for summary in summaries:
        text = _summary_text(summary)
        # A legacy topic's budget key may be a topic, longer than a device name can be.
        device = summary.device[: RunEvent._meta.get_field("device").max_length]
        events.add("message.dropped", device=device, message=text, topic=summary.topic,
                   size=summary.size, count=summary.count)  # fmt: skip
    with rows_atomic():
        writes = Writes()
        events.insert(writes)
        writes.send(last=True)
    events.committed()


def _summary_text(summary: DropSummary) -> str:
    if summary.count == 1:
        return summary.message
    gathered = f"{summary.count} messages dropped in {summary.seconds:.0f} s ({summary.reason})"
    return f"{gathered}; the last: {summary.message}"


def _legacy_handler(device: str) -> Handler:
    def handle(topic: str, payload: bytes) -> None:
        reply_accept(device, None, topic, payload)

    # The bridge counts the topic's messages against this device's budget.
    handle.budget_key = device  # type: ignore[attr-defined]
    return handle


def legacy_reply_topics() -> dict[str, Handler]:
    """Legacy devices' single reply topics (e.g. dev/face/123/Ack), re-read by the bridge."""
    topics = Device.objects.filter(enabled=True).exclude(reply_topic="").values_list("reply_topic", "name")
    return {topic: _legacy_handler(name) for topic, name in topics}
