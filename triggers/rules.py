"""MQTT trigger rules: a message on a matching topic starts the rule's template.

The bridge re-reads `rule_topics()` every couple of seconds and subscribes to each enabled
rule's filter. A message is checked against every enabled rule (so overlapping filters
each start their own run) and dropped, with a `message.dropped` event, when it is not a
JSON object, lacks a field a rule references, or the run cannot start.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import paho.mqtt.client as mqtt

from devices import protocol
from iotqueue.bridge import Handler
from jobs.events import event_record
from jobs.models import JobRun, Trigger
from jobs.services import RunStartError, run_start
from jobs.templating import TemplateError, render

from .models import TriggerRule

# JobRun.idempotency_key's length; longer rendered keys are hashed to fit.
IDEMPOTENCY_KEY_MAX = 200


def rule_topics() -> dict[str, Handler]:
    """{filter: handler} for the bridge, one entry per distinct filter of an enabled rule.

    Every handler sees all enabled rules (read once per refresh, not per message): the
    bridge hands a message to one handler even when several filters match it.
    """
    rules = list(TriggerRule.objects.filter(enabled=True).select_related("template"))
    handler = functools.partial(trigger_message_handle, rules=rules)
    return {rule.topic_filter: handler for rule in rules}


def trigger_message_handle(topic: str, payload: bytes, *, rules: list[TriggerRule]) -> None:
    """Bridge handler: start one run per enabled rule whose filter matches `topic`."""
    matching = [rule for rule in rules if mqtt.topic_matches_sub(rule.topic_filter, topic)]
    if not matching:
        return
    try:
        body = protocol.payload_json(payload)
        if not isinstance(body, dict):
            raise protocol.ProtocolError(f"payload must be a JSON object, not {type(body).__name__}")
    except protocol.ProtocolError as exc:
        for rule in matching:
            _message_drop(rule, topic, str(exc))
        return
    for rule in matching:
        trigger_rule_fire(rule=rule, topic=topic, message=body)


def trigger_rule_fire(*, rule: TriggerRule, topic: str, message: dict[str, Any]) -> JobRun | None:
    """Start the rule's run with parameters from the message; None when it was dropped."""
    context = {"topic": topic.split("/"), "message": message}
    try:
        parameters = render(rule.parameters, context)
        key = _idempotency_key(rule, context) if rule.idempotency_key else None
        run, _ = run_start(
            template=rule.template,
            parameters=parameters,
            trigger=Trigger.MQTT,
            triggered_by=f"mqtt {rule.name} {topic}"[:150],
            priority=rule.priority,
            idempotency_key=key,
        )
    except TemplateError as exc:
        _message_drop(rule, topic, str(exc))
        return None
    except RunStartError as exc:
        _message_drop(rule, topic, f"{exc.field}: {exc}")
        return None
    return run


def _idempotency_key(rule: TriggerRule, context: dict[str, Any]) -> str:
    value = render(rule.idempotency_key, context)
    if value is None or value == "":
        raise TemplateError(f"dedupe key {rule.idempotency_key!r} is empty for this message")
    key = f"mqtt:{rule.pk}:{value}"
    if len(key) > IDEMPOTENCY_KEY_MAX:
        key = f"mqtt:{rule.pk}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def _message_drop(rule: TriggerRule, topic: str, reason: str) -> None:
    # The rule's name leads the message so the admin's event search finds it.
    event_record(
        "message.dropped", device="", message=f"rule {rule.name}: {reason}", topic=topic, rule=rule.name
    )
