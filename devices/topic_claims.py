"""Whose topics a legacy device's override topics would be: no two devices may share one.

A device's command topic or reply topic override equal to another device's override, or
inside another device's standard space P/<other>/..., would send that device's commands
to it or let its replies pass for the other's. Shared by the REST serializer and the admin
form; each answer is {field: message}.
"""

from __future__ import annotations

from . import protocol
from .models import Device

OVERRIDE_FIELDS = ("command_topic", "reply_topic")


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
