"""Bridge handlers for device replies: validate cheaply, hand off to Celery in groups.

Malformed messages are dropped here with a `message.dropped` event. Every valid ack,
progress and done joins the bridge's reply batcher (iotqueue/batching.py), which hands
the replies that arrived together to the workers as one group (jobs/inbox.py): a
worker applies what has gathered in one transaction and one lock call
(jobs/engine/batch.py), and checks each reply against the database there (current,
stale, unknown, foreign). The bridge itself reads and writes no row per reply.
"""

from __future__ import annotations

from celery import current_app
from django.conf import settings

from devices import protocol
from devices.models import Device
from iotqueue.batching import Batcher
from iotqueue.bridge import BRIDGE_MESSAGES, Handler, ack_defer
from iotqueue.metrics import counter_buffer

from .current import JOBS_GET_TASK
from .events import event_record
from .inbox import replies_enqueue

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
        event_record("message.dropped", device=device, message=str(exc), topic=topic, size=len(payload))
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


def jobs_get_handle(topic: str, payload: bytes) -> None:
    """Handler for P/<device>/jobs/get (protocol v1.1): a worker answers on jobs/current.

    The bridge reads no row for it: the question goes to the `jobs.device_jobs_get` task
    (by name, jobs/current.py); the payload (empty or an object) carries nothing else.
    """
    device = protocol.jobs_get_device(topic)
    if device is None:
        return
    try:
        protocol.jobs_get_parse(payload)
    except protocol.ProtocolError as exc:
        event_record("message.dropped", device=device, message=str(exc), topic=topic, size=len(payload))
        return
    counter_buffer.add(BRIDGE_MESSAGES, "accepted")
    current_app.signature(JOBS_GET_TASK, args=(device,)).delay()


def _legacy_handler(device: str) -> Handler:
    def handle(topic: str, payload: bytes) -> None:
        reply_accept(device, None, topic, payload)

    return handle


def legacy_reply_topics() -> dict[str, Handler]:
    """Legacy devices' single reply topics (e.g. dev/face/123/Ack), re-read by the bridge."""
    topics = Device.objects.filter(enabled=True).exclude(reply_topic="").values_list("reply_topic", "name")
    return {topic: _legacy_handler(name) for topic, name in topics}
