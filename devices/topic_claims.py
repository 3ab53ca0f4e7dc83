"""Whose topics a device's topics are: no two devices, and no device and a listener, share one.

A device's command topic or reply topic override equal to another device's override, or
inside another device's standard space P/<other>/..., would send that device's commands
to it or let its replies pass for the other's. An override a trigger rule listens on would
hand the rule the device's replies (each starting a run) or feed it the device's commands;
in reverse, a rule may not listen on any device's topics (`device_topic_overlap_error`).
Other apps say what they listen on through `topic_listeners_register` (triggers does, at app
ready: devices never imports it). Shared by the REST serializers and the admin forms; each
answer is {field: message}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.core import checks
from django.utils.translation import gettext as _

from iotqueue.topics import filters_overlap, topic_name_error

from . import protocol
from .models import Device

OVERRIDE_FIELDS = ("command_topic", "reply_topic")

# What another app listens on: (filter, who in words, e.g. "trigger rule door-opened") pairs.
ListenedTopics = Callable[[], Iterable[tuple[str, str]]]
_listeners: dict[str, ListenedTopics] = {}


def topic_listeners_register(kind: str, listened: ListenedTopics) -> None:
    """`listened()` names the filters `kind` subscribes to; device overrides must stay clear."""
    _listeners[kind] = listened


def topic_prefix_check(app_configs=None, **kwargs) -> list[checks.Error]:
    """System check: IOTQUEUE_TOPIC_PREFIX is a topic the broker accepts, one that is not its own.

    Every device topic starts with it; a control character or wildcard in it would make the
    broker drop the bridge on its first subscribe (a deaf bridge, every step timing out).
    """
    prefix = protocol.topic_prefix()
    problem = topic_name_error(prefix) if isinstance(prefix, str) else _("it is not text")
    if not problem and prefix.startswith("$"):
        problem = _("topics starting with $ are the broker's own")
    if not problem:
        return []
    return [
        checks.Error(
            _("IOTQUEUE_TOPIC_PREFIX %(prefix)r: %(problem)s") % {"prefix": prefix, "problem": problem},
            id="devices.E001",
        )
    ]


def device_reply_filters() -> list[str]:
    """Filters covering every topic a device publishes to iotqueue.

    Its replies and presence (P/+/ack|progress|done|status|heartbeat), P/+/jobs/get, and each
    device's reply-topic override: a rule matching one would take the device's messages over.
    """
    standard = [*protocol.device_subscriptions(), protocol.device_topic("+", protocol.JOBS_GET)]
    overrides = Device.objects.exclude(reply_topic="").values_list("reply_topic", flat=True).distinct()
    return [*standard, *sorted(overrides)]


def device_topic_overlap_error(topic_filter: str) -> str | None:
    """Why a listener (a trigger rule) may not subscribe to `topic_filter`: it matches a device's
    replies, presence or jobs/get (wildcards included), or None."""
    for device_filter in device_reply_filters():
        if filters_overlap(topic_filter, device_filter):
            return _(
                "the filter matches topics devices answer on (%(topic)s); those belong to the "
                "devices, a rule may not listen to them"
            ) % {"topic": device_filter}
    return None


def _listener_overlaps(topic: str) -> str | None:
    """The first registered listener whose filter matches `topic`, in words, or None."""
    for listened in _listeners.values():
        for topic_filter, owner in listened():
            if filters_overlap(topic_filter, topic):
                return _(
                    "%(topic)r is listened on by %(owner)s (%(filter)s); a device's topic may not be"
                ) % {
                    "topic": topic,
                    "owner": owner,
                    "filter": topic_filter,
                }
    return None


def device_topic_collisions(
    *, pk: int | None, name: str, command_topic: str, reply_topic: str
) -> dict[str, str]:
    """Override topics (and a name) that collide with another device's topics."""
    others = Device.objects.exclude(pk=pk) if pk is not None else Device.objects.all()
    claimed = _overrides_of(others)
    errors: dict[str, str] = {}
    for field, topic in zip(OVERRIDE_FIELDS, (command_topic, reply_topic), strict=True):
        if not topic:
            continue
        if topic in claimed:
            errors[field] = f"{topic!r} is already a topic of device {claimed[topic]}"
            continue
        owner = _standard_space_owner(topic, name, others)
        if owner:
            errors[field] = f"{topic!r} is inside device {owner}'s topics ({_space(owner)}...)"
            continue
        listener = _listener_overlaps(topic)
        if listener:
            errors[field] = listener
    space = _space(name)
    intruder = next((other for topic, other in sorted(claimed.items()) if topic.startswith(space)), None)
    if intruder:
        errors["name"] = f"device {intruder} has a legacy topic inside this name's topics ({space}...)"
    return errors


def _overrides_of(devices) -> dict[str, str]:
    """{override topic: device name} of the given devices."""
    claimed: dict[str, str] = {}
    rows = devices.exclude(command_topic="", reply_topic="").values_list("name", *OVERRIDE_FIELDS)
    for other, *topics in rows:
        for topic in topics:
            if topic:
                claimed.setdefault(topic, other)
    return claimed


def _space(name: str) -> str:
    return f"{protocol.topic_prefix()}/{name}/"


def _standard_space_owner(topic: str, name: str, others) -> str | None:
    """The other device whose P/<name>/... space holds `topic`, if any."""
    prefix = f"{protocol.topic_prefix()}/"
    if not topic.startswith(prefix):
        return None
    level = topic[len(prefix) :].split("/")[0]
    if level != name and others.filter(name=level).exists():
        return level
    return None
