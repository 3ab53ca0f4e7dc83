"""Device protocol v1.1: topic names and payload shapes shared by the engine, bridge and simulator.

The contract with firmware is documented in docs/protocol.md; this module is its code form.
Nothing here touches the database or the network.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from iotqueue.jsondepth import json_max_depth, json_too_deep
from iotqueue.text import text_problem

PROTOCOL_VERSION = 1
# v1.1 adds to v1 without changing it (a v1 device never sees a difference): jobs/get and
# jobs/current, `"status": "rejected"` in done, `extend_seconds` and a text `detail` in progress.
PROTOCOL_REVISION = "1.1"

# Device -> server message kinds, by the last topic level.
REPLY_KINDS = ("ack", "progress", "done")
PRESENCE_KINDS = ("status", "heartbeat")
DEVICE_KINDS = REPLY_KINDS + PRESENCE_KINDS

# v1.1: a device asks what it should be doing (P/D/jobs/get) and is answered on P/D/jobs/current.
JOBS_LEVEL = "jobs"
JOBS_GET = f"{JOBS_LEVEL}/get"
JOBS_CURRENT = f"{JOBS_LEVEL}/current"

# Run lifecycle events go out on P/events/runs/<run id> (webhooks/outbox.py).
EVENTS_LEVEL = "events"
RUN_EVENTS = f"{EVENTS_LEVEL}/runs"

# The only `status` a done may carry (v1.1): the device refuses the command.
DONE_REJECTED = "rejected"
# A progress `detail` is stored on the run's timeline and shown to people: longer text is cut
# to this many characters (a line of an operator's screen, not a log file).
DETAIL_MAX_CHARS = 500
# No step may push its deadline out further than this (a week): a larger `extend_seconds`
# is a firmware bug, not a long flash, and would overflow date arithmetic if taken as is.
EXTEND_SECONDS_LIMIT = 7 * 24 * 3600

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


def server_publish_filters() -> list[str]:
    """Filters of what iotqueue's own processes publish besides commands: run events
    (P/events/runs/#) and the answers to jobs/get (P/+/jobs/current)."""
    return [f"{topic_prefix()}/{RUN_EVENTS}/#", device_topic("+", JOBS_CURRENT)]


def device_subscriptions() -> list[str]:
    """Topic filters covering every device's replies and presence under the prefix."""
    return [f"{topic_prefix()}/+/{kind}" for kind in DEVICE_KINDS]


def jobs_get_device(topic: str) -> str | None:
    """The device of a P/<device>/jobs/get topic; None when the topic is not one."""
    prefix, suffix = topic_prefix() + "/", "/" + JOBS_GET
    if not topic.startswith(prefix) or not topic.endswith(suffix):
        return None
    device = topic[len(prefix) : -len(suffix)]
    return device if DEVICE_NAME_RE.match(device) else None


def jobs_get_parse(raw: bytes) -> None:
    """Validate a jobs/get body: empty, or a JSON object (its fields are ignored)."""
    if not raw.strip():
        return
    if not isinstance(payload_json(raw), dict):
        raise ProtocolError("a jobs/get payload must be empty or a JSON object")


def jobs_current_payload(*, command: bytes | None, queued: int) -> bytes:
    """The answer to jobs/get: the in-flight command's own body (or null) and the queue length."""
    body = command.decode() if command is not None else "null"
    return f'{{"command":{body},"queued":{int(queued)}}}'.encode()


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
    rejected: bool = False
    progress: int | None = None
    detail: str = ""
    extend_seconds: float | None = None

    def as_task_payload(self) -> dict[str, Any]:
        """JSON-safe form for handing the reply to a Celery task."""
        return {
            "kind": self.kind,
            "command_id": self.command_id,
            "ok": self.ok,
            "result": self.result,
            "error": self.error,
            "retryable": self.retryable,
            "rejected": self.rejected,
            "progress": self.progress,
            "detail": self.detail,
            "extend_seconds": self.extend_seconds,
        }


def payload_json(raw: bytes) -> Any:
    """Decode a message body; oversized, non-JSON or too deeply nested bodies, and bodies with
    text that cannot be stored (a NUL, a lone surrogate: iotqueue/text.py), raise ProtocolError."""
    if len(raw) > settings.IOTQUEUE_MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {len(raw)} bytes exceeds {settings.IOTQUEUE_MAX_PAYLOAD_BYTES}")
    too_deep = f"payload is nested more than {json_max_depth()} levels deep (IOTQUEUE_JSON_MAX_DEPTH)"
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError(too_deep) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    if json_too_deep(body):
        raise ProtocolError(too_deep)
    problem = text_problem(body)
    if problem:
        raise ProtocolError(f"payload holds text that cannot be stored: {problem}")
    return body


def reply_kind_infer(body: Any) -> str:
    """Kind of a reply that arrived on a legacy device's single reply topic."""
    if isinstance(body, dict) and isinstance(body.get("type"), str) and body["type"] in REPLY_KINDS:
        return body["type"]
    if isinstance(body, dict) and ("ok" in body or body.get("status") == DONE_REJECTED):
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
        return Reply(
            kind=kind,
            command_id=command_id,
            progress=int(progress),
            detail=_detail(body),
            extend_seconds=_extend_seconds(body),
        )
    if kind == "done":
        status = body.get("status")
        if status is not None and status != DONE_REJECTED:
            raise ProtocolError(f"field 'status' must be {DONE_REJECTED!r} when given")
        ok = body.get("ok", False if status else None)
        if not isinstance(ok, bool):
            raise ProtocolError("field 'ok' must be true or false")
        if ok and status:
            raise ProtocolError("a rejected done cannot say ok: true")
        if ok:
            return Reply(kind=kind, command_id=command_id, ok=True, result=_object(body, "result"))
        error = body.get("error", "")
        if not isinstance(error, str):
            raise ProtocolError("field 'error' must be a string")
        retryable = body.get("retryable", False)
        if not isinstance(retryable, bool):
            raise ProtocolError("field 'retryable' must be true or false")
        if status:
            return Reply(
                kind=kind, command_id=command_id, ok=False, error=error or "device rejected", rejected=True
            )
        return Reply(
            kind=kind,
            command_id=command_id,
            ok=False,
            error=error or "device reported failure",
            retryable=retryable,
        )
    raise ProtocolError(f"unknown reply kind {kind!r}")


def _detail(body: dict[str, Any]) -> str:
    """A progress `detail` as text: a string (v1.1) or a JSON object (v1), cut to DETAIL_MAX_CHARS."""
    value = body.get("detail")
    if value is None:
        return ""
    if isinstance(value, dict):
        value = json.dumps(value, separators=(",", ":")) if value else ""
    elif not isinstance(value, str):
        raise ProtocolError("field 'detail' must be a string or a JSON object")
    return value if len(value) <= DETAIL_MAX_CHARS else value[: DETAIL_MAX_CHARS - 1] + "…"


def _extend_seconds(body: dict[str, Any]) -> float | None:
    value = body.get("extend_seconds")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= EXTEND_SECONDS_LIMIT
    ):
        raise ProtocolError(
            f"field 'extend_seconds' must be a number above 0 and at most {EXTEND_SECONDS_LIMIT}"
        )
    return float(value)


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
