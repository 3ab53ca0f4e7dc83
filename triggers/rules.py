"""MQTT trigger rules: a message on a matching topic starts the rule's template.

The bridge re-reads `rule_topics()` every couple of seconds and subscribes to each enabled
rule's filter. A message is checked against every enabled rule (so overlapping filters
each start their own run) and dropped, with a `message.dropped` event, when it is not a
JSON object, lacks a field a rule references, is over the rule's rate or active-run limit
(triggers/limits.py), or the run cannot start.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import paho.mqtt.client as mqtt
from django.conf import settings
from django.db import transaction

from devices import protocol
from devices.topic_claims import device_reply_filters
from iotqueue.bridge import Handler
from iotqueue.topics import filters_overlap
from jobs.events import event_record
from jobs.models import JobRun, Trigger
from jobs.services import RunStartError, run_start
from jobs.templating import TemplateError, render

from .limits import RateVerdict, rule_active_runs, rule_rate_admit
from .models import TriggeredRun, TriggerRule, pinned_version_number
from .validation import command_filters, command_overlap_error, published_overlap_error, topic_filter_error

log = logging.getLogger(__name__)

# JobRun.idempotency_key's length; longer rendered keys are hashed to fit.
IDEMPOTENCY_KEY_MAX = 200


def rule_topics() -> dict[str, Handler]:
    """{filter: handler} for the bridge, one entry per distinct filter of an enabled rule.

    Every handler sees all enabled rules (read once per refresh, not per message): the
    bridge hands a message to one handler even when several filters match it.
    """
    commands, devices = command_filters(), device_reply_filters()
    rules = [
        rule
        for rule in TriggerRule.objects.filter(enabled=True).select_related("template", "template_version")
        if _listening_allowed(rule, commands, devices)
    ]
    handler = functools.partial(trigger_message_handle, rules=rules)
    return {rule.topic_filter: handler for rule in rules}


# (rule id, filter) pairs already logged as refused, so a refresh every 2 s logs each once.
_refusals_logged: set[tuple[int, str]] = set()


def _listening_allowed(rule: TriggerRule, commands: list[str], devices: list[str]) -> bool:
    """Refuse, at run time too, a filter that validation would refuse now: a rule saved
    before the check existed, or a device given a legacy command or reply topic the rule
    matches (`devices`: every topic devices answer on, devices/topic_claims.py)."""
    problem = (
        topic_filter_error(rule.topic_filter)
        or command_overlap_error(rule.topic_filter, commands)
        or published_overlap_error(rule.topic_filter)
        or next(
            (
                f"it matches {taken}, a topic devices answer on"
                for taken in devices
                if filters_overlap(rule.topic_filter, taken)
            ),
            None,
        )
    )
    if problem and (rule.pk, rule.topic_filter) not in _refusals_logged:
        _refusals_logged.add((rule.pk, rule.topic_filter))
        log.error("trigger rule %s is not subscribed: %s", rule.name, problem)
    return problem is None


def trigger_message_handle(topic: str, payload: bytes, *, rules: list[TriggerRule]) -> None:
    """Bridge handler: start one run per enabled rule whose filter matches `topic`."""
    matching = [rule for rule in rules if mqtt.topic_matches_sub(rule.topic_filter, topic)]
    matching = [rule for rule in matching if _rate_admitted(rule, topic)]
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
        parameters = render(
            rule.parameters,
            context,
            limit=settings.IOTQUEUE_RUN_PARAMETERS_MAX_BYTES,
            setting="IOTQUEUE_RUN_PARAMETERS_MAX_BYTES",
        )
        key = _idempotency_key(rule, context) if rule.idempotency_key else None
        with transaction.atomic():
            return _rule_run_start(rule, topic, parameters, key)
    except TemplateError as exc:
        _message_drop(rule, topic, str(exc))
        return None
    except RunStartError as exc:
        _message_drop(rule, topic, f"{exc.field}: {exc}")
        return None


def _rule_run_start(rule: TriggerRule, topic: str, parameters: dict, key: str | None) -> JobRun | None:
    """Start the run unless the rule is at its cap of active runs (call in a transaction).

    The rule's row is locked first, so bridge replicas deciding for one rule take turns and
    the cap holds exactly (on PostgreSQL; SQLite serializes every write anyway).
    """
    if not TriggerRule.objects.select_for_update().filter(pk=rule.pk).exists():
        return None  # deleted since the bridge read it
    active = rule_active_runs(rule)
    if active >= rule.max_active_runs:
        reason = f"{active} of its runs have not ended (max_active_runs {rule.max_active_runs})"
        _message_drop(rule, topic, reason, limit="max_active_runs")
        return None
    run, created = run_start(
        template=rule.template,
        version=pinned_version_number(rule),
        parameters=parameters,
        trigger=Trigger.MQTT,
        triggered_by=f"mqtt {rule.name} {topic}"[:150],
        priority=rule.priority,
        idempotency_key=key,
    )
    if created:
        TriggeredRun.objects.create(rule=rule, run=run)
    return run


def _rate_admitted(rule: TriggerRule, topic: str) -> bool:
    """The rule's rate window admits the message; the first drop of a window is recorded."""
    verdict = rule_rate_admit(rule)
    if verdict == RateVerdict.DROPPED_FIRST:
        reason = (
            f"over max_runs_per_minute {rule.max_runs_per_minute}; "
            "further messages are dropped until the minute's window has room (reported once a minute)"
        )
        _message_drop(rule, topic, reason, limit="max_runs_per_minute")
    return verdict == RateVerdict.ADMITTED


def _idempotency_key(rule: TriggerRule, context: dict[str, Any]) -> str:
    value = render(rule.idempotency_key, context)
    if value is None or value == "":
        raise TemplateError(f"dedupe key {rule.idempotency_key!r} is empty for this message")
    key = f"mqtt:{rule.pk}:{value}"
    if len(key) > IDEMPOTENCY_KEY_MAX:
        key = f"mqtt:{rule.pk}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def _message_drop(rule: TriggerRule, topic: str, reason: str, **data: str) -> None:
    # The rule's name leads the message so the admin's event search finds it.
    event_record(
        "message.dropped",
        device="",
        message=f"rule {rule.name}: {reason}",
        topic=topic,
        rule=rule.name,
        **data,
    )
