"""Device protocol v1: topic names and payload shapes shared by the engine, bridge and simulator.

The contract with firmware is documented in docs/protocol.md; this module is its code form.
Nothing here touches the database or the network.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from iotqueue.nul import nul_path

PROTOCOL_VERSION = 1

# Device -> server message kinds, by the last topic level.
REPLY_KINDS = ("ack", "progress", "done")
PRESENCE_KINDS = ("status", "heartbeat")
DEVICE_KINDS = REPLY_KINDS + PRESENCE_KINDS

# The action the engine sends to abort a device's in-flight command.
CANCEL_ACTION = "cancel"

# A device name is one MQTT topic level: no separators or wildcards.
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
ACTION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


class ProtocolError(ValueError):
    """A device message that does not follow the protocol; the reason is operator-readable."""


def topic_prefix() -> str:
    return settings.IOTQUEUE_TOPIC_PREFIX


def device_topic(device: str, kind: str) -> str:
    """Topic a device publishes `kind` on, e.g. iotqueue/lamp-2/done."""
    return f"{topic_prefix()}/{device}/{kind}"


def command_topic(device: str, action: str, override: str = "") -> str:
    """Topic the server publishes a command on; legacy devices have one fixed topic."""
    return override or f"{topic_prefix()}/{device}/cmd/{action}"


def device_subscriptions() -> list[str]:
    """Topic filters covering every device's replies and presence under the prefix."""
    return [f"{topic_prefix()}/+/{kind}" for kind in DEVICE_KINDS]


def topic_parse(topic: str) -> tuple[str, str] | None:
    """Split P/<device>/<kind> into (device, kind); None when the topic is not one of ours."""
    prefix = topic_prefix() + "/"
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix) :].split("/")
    if len(parts) != 2 or parts[1] not in DEVICE_KINDS or not parts[0]:
        return None
    return parts[0], parts[1]


@dataclass(frozen=True)
class Reply:
    """A validated ack, progress or done message from a device."""

    kind: str
    command_id: str
    ok: bool | None = None
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    retryable: bool = False
    progress: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_task_payload(self) -> dict[str, Any]:
        """JSON-safe form for handing the reply to a Celery task."""
        return {
            "kind": self.kind,
            "command_id": self.command_id,
            "ok": self.ok,
            "result": self.result,
            "error": self.error,
            "retryable": self.retryable,
            "progress": self.progress,
            "detail": self.detail,
        }


def payload_json(raw: bytes) -> Any:
    """Decode a message body; oversized or non-JSON bodies raise ProtocolError."""
    if len(raw) > settings.IOTQUEUE_MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {len(raw)} bytes exceeds {settings.IOTQUEUE_MAX_PAYLOAD_BYTES}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    where = nul_path(body)
    if where:
        raise ProtocolError(f"payload has a NUL character (\\u0000) in {where}")
    return body


def reply_kind_infer(body: Any) -> str:
    """Kind of a reply that arrived on a legacy device's single reply topic."""
    if isinstance(body, dict) and isinstance(body.get("type"), str) and body["type"] in REPLY_KINDS:
        return body["type"]
    if isinstance(body, dict) and "ok" in body:
        return "done"
    if isinstance(body, dict) and "progress" in body:
        return "progress"
    return "ack"


def reply_parse(kind: str, body: Any) -> Reply:
    """Validate a decoded reply body of the given kind; raise ProtocolError naming the field."""
    if not isinstance(body, dict):
        raise ProtocolError("payload must be a JSON object")
    command_id = body.get("id")
    if not isinstance(command_id, str) or not command_id:
        raise ProtocolError("field 'id' must be a non-empty string")
    if kind == "ack":
        return Reply(kind=kind, command_id=command_id)
    if kind == "progress":
        progress = body.get("progress")
        if isinstance(progress, bool) or not isinstance(progress, (int, float)) or not 0 <= progress <= 100:
            raise ProtocolError("field 'progress' must be a number from 0 to 100")
        return Reply(kind=kind, command_id=command_id, progress=int(progress), detail=_object(body, "detail"))
    if kind == "done":
        ok = body.get("ok")
        if not isinstance(ok, bool):
            raise ProtocolError("field 'ok' must be true or false")
        if ok:
            return Reply(kind=kind, command_id=command_id, ok=True, result=_object(body, "result"))
        error = body.get("error", "")
        if not isinstance(error, str):
            raise ProtocolError("field 'error' must be a string")
        retryable = body.get("retryable", False)
        if not isinstance(retryable, bool):
            raise ProtocolError("field 'retryable' must be true or false")
        return Reply(
            kind=kind,
            command_id=command_id,
            ok=False,
            error=error or "device reported failure",
            retryable=retryable,
        )
    raise ProtocolError(f"unknown reply kind {kind!r}")


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"field {name!r} must be a JSON object")
    return value


def command_payload(
    *,
    command_id: str,
    run: str,
    step: int,
    attempt: int,
    token: int,
    action: str,
    args: dict[str, Any],
    deadline: str,
) -> bytes:
    """The body of a command message, exactly as docs/protocol.md lists it."""
    return json.dumps(
        {
            "id": command_id,
            "run": run,
            "step": step,
            "attempt": attempt,
            "token": token,
            "action": action,
            "args": args,
            "deadline": deadline,
        },
        separators=(",", ":"),
    ).encode()


def status_parse(raw: bytes) -> bool:
    """Presence from a status message: True for online; accepts "online" bare or JSON-quoted."""
    text = raw.decode("utf-8", "replace").strip().strip('"').lower()
    if text not in ("online", "offline"):
        raise ProtocolError("status must be 'online' or 'offline'")
    return text == "online"
