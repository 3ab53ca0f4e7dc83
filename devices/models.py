"""Devices: what the engine can send commands to, and what presence says about them."""

import zoneinfo

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils.translation import gettext_lazy as _

from iotqueue.names import url_name_validator
from iotqueue.topics import topic_name_error

from . import protocol
from .profiles import DeviceProtocol


def device_name_validate(value: str) -> None:
    if not protocol.DEVICE_NAME_RE.match(value):
        raise ValidationError(
            _("Use letters, digits and . _ : - only (the name is one MQTT topic level)."), code="invalid"
        )


def labels_validate(value) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValidationError(_('Labels must be a JSON object of strings, e.g. {"site": "berlin"}.'))


def time_zone_validate(value: str) -> None:
    """An IANA time zone name zoneinfo knows (time windows, quiet hours)."""
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValidationError(
            _("Unknown time zone %(zone)s: use an IANA name such as Europe/Berlin."),
            code="invalid",
            params={"zone": value},
        ) from None


def quiet_hours_problem(start, end) -> dict[str, str]:
    """A device's quiet hours are both times or neither: {field: message} of what is wrong."""
    if (start is None) != (end is None):
        field = "quiet_hours_end" if end is None else "quiet_hours_start"
        return {field: str(_("Give both the start and the end of the quiet hours, or neither."))}
    return {}


def config_validate(value) -> None:
    if not isinstance(value, dict):
        raise ValidationError(_('Config must be a JSON object, e.g. {"mode": "eco"}.'))


def topic_validate(value: str) -> None:
    """A device's command or reply topic: one the broker accepts, and none of the broker's own.

    Control characters, noncharacters and text without a UTF-8 form would make the broker drop
    the bridge (or the device) that subscribes to it, as a malformed packet.
    """
    problem = value and topic_name_error(value)
    if problem:
        raise ValidationError(_("Not a topic the MQTT broker accepts: %(problem)s.") % {"problem": problem})
    if value and ("+" in value or "#" in value or value.startswith("/")):
        raise ValidationError(_("A topic may not contain wildcards (+ #) or start with '/'."))
    if value.startswith("$"):
        # $CONTROL/... administers the broker, $SYS/... is its own: a device's ACL on one
        # would hand it the broker.
        raise ValidationError(_("A topic may not start with $: those are the broker's own topics."))
    events = f"{settings.IOTQUEUE_TOPIC_PREFIX}/events"
    if value == events or value.startswith(events + "/"):
        raise ValidationError(
            _("A topic may not be under %(events)s/, where iotqueue publishes run events.")
            % {"events": events}
        )


class DeviceGroup(models.Model):
    """A named set of devices that steps can target as a whole (fan-out comes later)."""

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[url_name_validator])
    description = models.TextField(_("description"), blank=True)

    class Meta:
        verbose_name = _("device group")
        verbose_name_plural = _("device groups")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Device(models.Model):
    """A device addressed over MQTT by its name, or by legacy topic overrides."""

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[device_name_validate])
    description = models.TextField(_("description"), blank=True)
    labels = models.JSONField(
        _("labels"),
        default=dict,
        blank=True,
        validators=[labels_validate],
        help_text=_('e.g. {"site": "berlin", "kind": "pump"}'),
    )
    groups = models.ManyToManyField(DeviceGroup, blank=True, related_name="devices", verbose_name=_("groups"))
    command_topic = models.CharField(
        _("command topic"),
        max_length=255,
        blank=True,
        validators=[topic_validate],
        help_text=_("Legacy firmware: every command goes to this fixed topic, not P/<name>/cmd/<action>."),
    )
    reply_topic = models.CharField(
        _("reply topic"),
        max_length=255,
        blank=True,
        db_index=True,
        validators=[topic_validate],
        help_text=_("Legacy firmware: the device answers on this one topic, not P/<name>/ack|progress|done."),
    )
    protocol = models.CharField(
        _("protocol"),
        max_length=16,
        choices=DeviceProtocol.choices,
        default=DeviceProtocol.IOTQUEUE,
        help_text=_(
            "The MQTT API the device's firmware speaks: iotqueue's own (v1.1), or the AWS IoT Jobs "
            "API on $aws/things/<name>/jobs/... for firmware written for AWS. Changing it rewrites "
            "the device's broker permissions."
        ),
    )
    config = models.JSONField(
        _("config"),
        default=dict,
        blank=True,
        validators=[config_validate],
        help_text=_("Free-form settings for jobs and firmware: a JSON object."),
    )
    min_interval_seconds = models.FloatField(
        _("min interval seconds"),
        default=0,
        help_text=_("Flow control: at least this long between two commands (slow firmware)."),
    )
    max_per_minute = models.PositiveIntegerField(
        _("max per minute"),
        default=0,
        help_text=_("Flow control: at most this many commands per minute; 0 = no limit."),
    )
    enabled = models.BooleanField(
        _("enabled"), default=True, help_text=_("Disabled devices receive no commands.")
    )
    presence_required = models.BooleanField(
        _("presence required"),
        default=True,
        help_text=_(
            "Send commands only while the device reports online. Turn off for firmware that "
            "publishes no status or heartbeat (it is then always treated as reachable)."
        ),
    )
    # Time windows: the device's quiet hours, in its own time zone (or its `tz` label).
    timezone = models.CharField(
        _("time zone"),
        max_length=64,
        blank=True,
        validators=[time_zone_validate],
        help_text=_("An IANA name, e.g. Europe/Berlin; empty = its tz label, else UTC."),
    )
    quiet_hours_start = models.TimeField(
        _("quiet hours start"),
        null=True,
        blank=True,
        help_text=_("Local time from which no command is sent (unless its step is urgent), e.g. 08:00."),
    )
    quiet_hours_end = models.TimeField(
        _("quiet hours end"),
        null=True,
        blank=True,
        help_text=_(
            "Local time at which commands may go again, e.g. 21:00 (before the start: over midnight)."
        ),
    )
    online = models.BooleanField(
        _("online"), default=False, help_text=_("From the device's retained status / last will.")
    )
    last_seen = models.DateTimeField(_("last seen"), null=True, blank=True)
    # When `online` last changed: "online since" / "offline since" (last_seen moves with every
    # heartbeat, so it cannot say how long a device has been up).
    presence_since = models.DateTimeField(
        _("online or offline since"), null=True, blank=True, help_text=_("When the presence last changed.")
    )
    # The device's current client certificate (devices/credentials.py device_certificate_issue):
    # what identifies it, never the certificate or its key, which are shown once.
    certificate_serial = models.CharField(
        _("certificate serial"), max_length=64, blank=True, editable=False,
        help_text=_("Serial number (hex) of the last client certificate issued to the device."),
    )  # fmt: skip
    certificate_fingerprint = models.CharField(
        _("certificate fingerprint"), max_length=95, blank=True, editable=False,
        help_text=_("SHA-256 fingerprint of the last client certificate issued to the device."),
    )  # fmt: skip
    certificate_not_after = models.DateTimeField(
        _("certificate valid until"), null=True, blank=True, editable=False
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("device")
        verbose_name_plural = _("devices")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        problem = quiet_hours_problem(self.quiet_hours_start, self.quiet_hours_end)
        if problem:
            raise ValidationError(problem)

    @property
    def reachable(self) -> bool:
        """May a command be sent now: online, or presence not tracked for this device."""
        return self.online or not self.presence_required

    def command_topic_for(self, action: str) -> str:
        return protocol.command_topic(self.name, action, self.command_topic)
