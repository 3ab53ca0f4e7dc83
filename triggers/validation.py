"""Checks shared by the REST serializers and the admin forms; each returns {field: message}."""

from __future__ import annotations

import functools
import zoneinfo
from typing import Any

from celery.schedules import crontab as celery_crontab
from django.core.exceptions import ValidationError
from django.utils.translation import gettext as _
from django_celery_beat.validators import crontab_validator

from devices import protocol
from devices.models import Device
from devices.topic_claims import device_topic_overlap_error
from iotqueue import topics
from iotqueue.topics import filters_overlap
from jobs.models import JobTemplate
from jobs.parameters import parameters_problem
from jobs.templating import TemplateError, references

from .models import TriggerRule

# Cron order, as in crontab(5) and django-celery-beat's CrontabSchedule.
CRONTAB_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
# What a trigger rule's references may read: the topic's levels and the message body.
RULE_ROOTS = ("topic", "message")


@functools.cache
def _timezone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def timezone_error(name: str) -> str | None:
    if name not in _timezone_names():
        return _("unknown timezone '%(name)s'; use an IANA name such as Europe/Berlin or UTC") % {
            "name": name
        }
    return None


def crontab_fields(expression: str) -> dict[str, str]:
    """The five fields of "minute hour day-of-month month day-of-week"; ValueError names the problem."""
    parts = expression.split()
    if len(parts) != len(CRONTAB_FIELDS):
        raise ValueError(f'a crontab has 5 fields "minute hour day-of-month month day-of-week", not {parts}')
    try:
        crontab_validator(" ".join(parts))
        fields = dict(zip(CRONTAB_FIELDS, parts, strict=True))
        celery_crontab(**fields)  # beat must be able to evaluate it, not only store it
    except (ValidationError, ValueError, TypeError, IndexError) as exc:
        message = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        raise ValueError(
            _("invalid crontab '%(crontab)s': %(problem)s") % {"crontab": expression, "problem": message}
        ) from None
    return fields


def schedule_errors(*, interval_seconds: int | None, crontab: str, timezone: str) -> dict[str, str]:
    """Exactly one of an interval or a crontab (with a known timezone)."""
    errors: dict[str, str] = {}
    if interval_seconds and crontab:
        message = _("give either interval_seconds or crontab, not both")
        return {"interval_seconds": message, "crontab": message}
    if not interval_seconds and not crontab:
        message = _("give interval_seconds or crontab")
        return {"interval_seconds": message, "crontab": message}
    if crontab:
        try:
            crontab_fields(crontab)
        except ValueError as exc:
            errors["crontab"] = str(exc)
    problem = timezone_error(timezone)
    if problem:
        errors["timezone"] = problem
    return errors


def parameters_errors(*, template: JobTemplate | None, parameters: Any) -> dict[str, str]:
    """A schedule's or rule's parameters hold every one the template's steps read.

    Checked on save against the template as it is then (jobs/parameters.py); `run_start`
    checks again at each fire, since the template may have changed since.
    """
    problem = parameters_problem(template, parameters) if template is not None else ""
    return {"parameters": problem} if problem else {}


def topic_filter_error(topic_filter: str) -> str | None:
    """A rule's filter: one the broker accepts (iotqueue/topics.py: no control characters,
    noncharacters, lone surrogates, misplaced wildcards, over 65535 bytes), and not a $ topic."""
    problem = topics.topic_filter_error(topic_filter)
    if problem:
        return problem
    if topic_filter.startswith(topics.SHARE_PREFIX):
        return _("give the plain filter; the bridge adds $share/<group>/ itself")
    if topic_filter.startswith("$"):
        return _("topics starting with $ ($SYS, $CONTROL) are the broker's own, not device messages")
    return None


def rule_listened_topics() -> list[tuple[str, str]]:
    """(filter, "trigger rule <name>") of every rule, enabled or not (one may be enabled later):
    what devices' topic overrides must stay clear of (devices/topic_claims.py)."""
    rules = TriggerRule.objects.values_list("topic_filter", "name")
    return [(topic_filter, _("trigger rule %(name)s") % {"name": name}) for topic_filter, name in rules]


def command_filters() -> list[str]:
    """Filters covering every topic the workers publish commands on.

    The standard space P/<device>/cmd/<action> (an action may span levels) and each legacy
    device's fixed command topic.
    """
    overrides = Device.objects.exclude(command_topic="").values_list("command_topic", flat=True)
    return [protocol.command_topic("+", "#"), *sorted(set(overrides))]


def command_overlap_error(topic_filter: str, commands: list[str]) -> str | None:
    """A rule matching the workers' own commands would start a run per command: a loop."""
    for command in commands:
        if filters_overlap(topic_filter, command):
            return _(
                "the filter matches device command topics (%(topic)s); a rule may not listen to commands"
            ) % {"topic": command}
    return None


def published_overlap_error(topic_filter: str) -> str | None:
    """A rule matching iotqueue's own run events or jobs/get answers would loop like one on
    commands: each run it starts publishes more of them."""
    for published in protocol.server_publish_filters():
        if filters_overlap(topic_filter, published):
            return _(
                "the filter matches topics iotqueue itself publishes (%(topic)s); "
                "a rule may not listen to them"
            ) % {"topic": published}
    return None


def rule_reference_error(value: Any, topic_filter: str) -> str | None:
    """References must read the topic or the message, and topic levels the filter can have."""
    try:
        paths = references(value)
    except TemplateError as exc:
        return str(exc)
    levels = topic_filter.split("/")
    for path in paths:
        root, _dot, rest = path.partition(".")
        if root not in RULE_ROOTS:
            return _("{{ %(path)s }}: references start with topic or message") % {"path": path}
        index = rest.split(".")[0]
        if root == "topic" and rest and not index.isdigit():
            return _("{{ %(path)s }}: a topic level is a number from 0") % {"path": path}
        if root == "topic" and rest and "#" not in levels and int(index) >= len(levels):
            return _("{{ %(path)s }}: the filter '%(filter)s' has only %(count)d levels") % {
                "path": path,
                "filter": topic_filter,
                "count": len(levels),
            }
    return None


def rule_errors(*, topic_filter: str, parameters: Any, idempotency_key: str) -> dict[str, str]:
    errors: dict[str, str] = {}
    problem = (
        topic_filter_error(topic_filter)
        or command_overlap_error(topic_filter, command_filters())
        or published_overlap_error(topic_filter)
        or device_topic_overlap_error(topic_filter)
    )
    if problem:
        return {"topic_filter": problem}
    if not isinstance(parameters, dict):
        errors["parameters"] = _("parameters must be a JSON object")
    else:
        problem = rule_reference_error(parameters, topic_filter)
        if problem:
            errors["parameters"] = problem
    if idempotency_key:
        problem = rule_reference_error(idempotency_key, topic_filter)
        if problem is None and not references(idempotency_key):
            problem = _("a dedupe key must reference the message or topic, e.g. {{ message.event_id }}")
        if problem:
            errors["idempotency_key"] = problem
    return errors
