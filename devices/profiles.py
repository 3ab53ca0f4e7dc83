"""Device protocols: which MQTT API a device speaks, and who builds its messages.

A device speaks iotqueue's own protocol v1.1 (devices/protocol.py) or the AWS IoT Jobs MQTT
API (devices/aws_jobs.py), chosen per device (`Device.protocol`). The engine builds a
command the same way for both, then asks this registry once per row for the profile's own
message: a profile that is not iotqueue's registers its builders here, where it is
defined (jobs/aws_jobs.py), and the engine never tests a protocol itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.utils.translation import gettext_lazy as _

from iotqueue.mqtt import Message


class DeviceProtocol(models.TextChoices):
    IOTQUEUE = "iotqueue", _("iotqueue v1.1")
    AWS_IOT_JOBS = "aws-iot-jobs", _("AWS IoT Jobs")


# A row (jobs.StepRun, duck-typed: devices never imports jobs) -> the message to publish.
MessageBuilder = Callable[[Any], Message]

# protocol -> what a dispatched attempt publishes, what a canceled one publishes, and what
# a device is told when a step joins its queue (iotqueue's own protocol tells it nothing).
command_builders: dict[str, MessageBuilder] = {}
cancel_builders: dict[str, MessageBuilder] = {}
queued_builders: dict[str, MessageBuilder] = {}


def command_builder(protocol: str) -> Callable[[MessageBuilder], MessageBuilder]:
    """Decorator: `build(row)` makes the message that dispatches a row to a `protocol` device."""

    def register(build: MessageBuilder) -> MessageBuilder:
        command_builders[protocol] = build
        return build

    return register


def cancel_builder(protocol: str) -> Callable[[MessageBuilder], MessageBuilder]:
    """Decorator: `build(row)` makes the message that tells a `protocol` device its command ended."""

    def register(build: MessageBuilder) -> MessageBuilder:
        cancel_builders[protocol] = build
        return build

    return register


def queued_builder(protocol: str) -> Callable[[MessageBuilder], MessageBuilder]:
    """Decorator: `build(row)` makes the message that tells a `protocol` device a step (the
    row) joined its queue."""

    def register(build: MessageBuilder) -> MessageBuilder:
        queued_builders[protocol] = build
        return build

    return register


def profiles_check() -> None:
    """Raise ImproperlyConfigured naming every protocol other than iotqueue's own whose
    command or cancel messages no module declared (jobs/apps.py PROFILE_MODULES)."""
    missing = [
        f"{table} {protocol!r}"
        for protocol in DeviceProtocol.values
        if protocol != DeviceProtocol.IOTQUEUE
        for table, builders in (("command_builder", command_builders), ("cancel_builder", cancel_builders))
        if protocol not in builders
    ]
    if missing:
        raise ImproperlyConfigured("device protocols without their messages: " + ", ".join(missing))
