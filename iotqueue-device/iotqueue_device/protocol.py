"""iotqueue's device protocol v1.1 from the device's side: topic names and payload shapes.

docs/protocol.md in the iotqueue repository is the contract; this module is its device-side
code form, with no dependency on iotqueue itself (firmware teams install only this package).
Nothing here touches the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# The server's default topic prefix (setting IOTQUEUE_TOPIC_PREFIX on the server).
DEFAULT_PREFIX = "iotqueue"
REPLY_KINDS = ("ack", "progress", "done")
STATUS, HEARTBEAT = "status", "heartbeat"
JOBS_GET, JOBS_CURRENT = "jobs/get", "jobs/current"
ONLINE, OFFLINE = b"online", b"offline"
# The action the server sends to abort the command named in args.id.
CANCEL_ACTION = "cancel"
# The only `status` a done may carry: the device refuses the command (never retried).
DONE_REJECTED = "rejected"
# The server refuses a larger extend_seconds (a week): a firmware bug, not a long flash.
EXTEND_SECONDS_LIMIT = 7 * 24 * 3600


class ProtocolError(ValueError):
    """A message from the server that does not follow the protocol."""


@dataclass(frozen=True)
class Command:
    """A command as the server sent it; `body` is its JSON object verbatim (unknown fields too)."""

    id: str
    action: str
    args: dict[str, Any]
    token: int | None
    deadline: float | None  # epoch seconds; None when absent or unreadable
    body: dict[str, Any] = field(compare=False, repr=False)

    @property
    def cancel_target(self) -> str | None:
        """For a `cancel` command: the id of the command to abort."""
        target = self.args.get("id")
        return target if self.action == CANCEL_ACTION and isinstance(target, str) else None


class Topics:
    """A device's topics under a prefix: P/D/cmd/#, P/D/ack, ..., P/D/jobs/current."""

    def __init__(self, device: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.device, self.prefix = device, prefix
        self.base = f"{prefix}/{device}"
        self.commands = f"{self.base}/cmd/#"
        self.status = f"{self.base}/{STATUS}"
        self.heartbeat = f"{self.base}/{HEARTBEAT}"
        self.jobs_get = f"{self.base}/{JOBS_GET}"
        self.jobs_current = f"{self.base}/{JOBS_CURRENT}"

    def reply(self, kind: str) -> str:
        return f"{self.base}/{kind}"

    def command(self, action: str) -> str:
        return f"{self.base}/cmd/{action}"

    def action_of(self, topic: str) -> str | None:
        """The action of a P/D/cmd/<action> topic; None for any other topic."""
        head = f"{self.base}/cmd/"
        return topic[len(head) :] if topic.startswith(head) and len(topic) > len(head) else None


def deadline_epoch(value: Any) -> float | None:
    """An ISO 8601 deadline with an offset as epoch seconds; None when absent or unreadable
    (a naive time is unreadable: the server always sends UTC with its offset)."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def command_parse(body: Any, *, action: str = "") -> Command:
    """A command from its JSON object; `action` (from the topic) when the body has none.

    Raises ProtocolError when it has no usable id, or args that are not an object.
    """
    if not isinstance(body, dict):
        raise ProtocolError("a command must be a JSON object")
    command_id, args = body.get("id"), body.get("args")
    if not isinstance(command_id, str) or not command_id:
        raise ProtocolError("field 'id' must be a non-empty string")
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise ProtocolError("field 'args' must be a JSON object")
    token = body.get("token")
    token = token if isinstance(token, int) and not isinstance(token, bool) else None
    name = body.get("action") if isinstance(body.get("action"), str) and body.get("action") else action
    return Command(command_id, str(name), args, token, deadline_epoch(body.get("deadline")), body)


def json_load(payload: bytes) -> Any:
    """A payload's JSON; raises ProtocolError for text that is not UTF-8 JSON."""
    try:
        return json.loads(payload.decode("utf-8")) if payload.strip() else None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not UTF-8 JSON: {exc}") from None


def current_parse(payload: bytes) -> Command | None:
    """The command a jobs/current answer names (None for `"command": null`).

    Raises ProtocolError for an answer that is not `{"command": {...} or null, ...}`.
    """
    answer = json_load(payload)
    if not isinstance(answer, dict) or "command" not in answer:
        raise ProtocolError("a jobs/current answer must be an object with a 'command' field")
    return None if answer["command"] is None else command_parse(answer["command"])


def json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def ack_body(command_id: str) -> dict[str, Any]:
    return {"id": command_id}


def progress_body(
    command_id: str, progress: float, *, detail: str | None = None, extend_seconds: float | None = None
) -> dict[str, Any]:
    """A progress message; raises ValueError for a percentage outside 0..100 or an extension
    the server would refuse as malformed (not above 0, or above a week)."""
    if not 0 <= progress <= 100:
        raise ValueError(f"progress must be within 0..100, not {progress}")
    body: dict[str, Any] = {"id": command_id, "progress": progress}
    if detail is not None:
        body["detail"] = str(detail)
    if extend_seconds is not None:
        if not 0 < extend_seconds <= EXTEND_SECONDS_LIMIT:
            raise ValueError(f"extend_seconds must be above 0 and at most {EXTEND_SECONDS_LIMIT}")
        body["extend_seconds"] = extend_seconds
    return body


def done_ok_body(command_id: str, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": command_id, "ok": True, "result": result or {}}


def done_failed_body(command_id: str, error: str, *, retryable: bool = False) -> dict[str, Any]:
    return {"id": command_id, "ok": False, "error": error, "retryable": retryable}


def done_rejected_body(command_id: str, reason: str) -> dict[str, Any]:
    return {"id": command_id, "ok": False, "status": DONE_REJECTED, "error": reason}
