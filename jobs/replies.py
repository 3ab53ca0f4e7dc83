"""Bridge handlers for device replies: validate and correlate cheaply, hand off to Celery.

Malformed messages are dropped here with a `message.dropped` event. An ack or progress for
a current attempt is applied here in one statement (a task per ack would double the
engine's work per step); a `done`, and anything that matches no current attempt, goes to
the `step_reply` task, which checks it against the database (unknown, foreign, stale).
"""

from __future__ import annotations

from devices import protocol
from devices.models import Device
from iotqueue.bridge import Handler
from iotqueue.metrics import BRIDGE_MESSAGES, counter_buffer

from .events import event_record
from .outcomes import step_ack_apply
from .tasks import step_reply_task


def reply_accept(device: str, kind: str | None, topic: str, payload: bytes) -> None:
    """Parse one reply; enqueue it for the engine or record why it was dropped."""
    try:
        body = protocol.payload_json(payload)
        reply = protocol.reply_parse(kind or protocol.reply_kind_infer(body), body)
    except protocol.ProtocolError as exc:
        event_record("message.dropped", device=device, message=str(exc), topic=topic, size=len(payload))
        return
    counter_buffer.add(BRIDGE_MESSAGES, "accepted")
    if reply.kind != "done" and step_ack_apply(device=device, reply=reply):
        return  # the common ack/progress: applied in one statement, no task
    step_reply_task.delay(device, reply.as_task_payload())


def reply_message_handle(topic: str, payload: bytes) -> None:
    """Handler for P/<device>/ack|progress|done."""
    parsed = protocol.topic_parse(topic)
    if parsed is None:
        return
    device, kind = parsed
    reply_accept(device, kind, topic, payload)


def _legacy_handler(device: str) -> Handler:
    def handle(topic: str, payload: bytes) -> None:
        reply_accept(device, None, topic, payload)

    return handle


def legacy_reply_topics() -> dict[str, Handler]:
    """Legacy devices' single reply topics (e.g. dev/face/123/Ack), re-read by the bridge."""
    topics = Device.objects.filter(enabled=True).exclude(reply_topic="").values_list("reply_topic", "name")
    return {topic: _legacy_handler(name) for topic, name in topics}
