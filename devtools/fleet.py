"""The simulator follows the Device table: every enabled device is played, also those created
after the simulator started; deleted and disabled ones are dropped, changed ones replayed.

A device is left alone when its `config` says `{"simulator": false}` (to play it by hand);
otherwise `config["simulator"]` holds behaviour knobs (DeviceBehaviour.configured). Where
iotqueue manages the broker's identities (IOTQUEUE_MQTT_AUTH=dynsec) and the simulator plays
with `own_credentials`, each device it starts playing is issued a new password and logs in
as itself; on an anonymous broker it logs in as the URL's user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from django.db import DatabaseError, close_old_connections
from django.db.models import Count, Max, Q

from devices.credentials import device_password_issue, managed
from devices.models import Device
from iotqueue.dynsec import DynsecError

from .simulator import DeviceBehaviour, Simulator

log = logging.getLogger(__name__)


def fleet_read(base: DeviceBehaviour) -> dict[str, DeviceBehaviour]:
    """How to play every enabled Device row: its topic overrides plus config["simulator"] knobs.

    A device whose knobs are malformed is left out, with a warning naming the mistake.
    """
    behaviours = {}
    rows = Device.objects.filter(enabled=True).order_by("name")
    for name, command_topic, reply_topic, config in rows.values_list(
        "name", "command_topic", "reply_topic", "config"
    ):
        knobs = config.get("simulator") if isinstance(config, dict) else None
        if knobs is False:
            continue
        try:
            behaviour = base.configured(knobs) if isinstance(knobs, dict) else base
        except ValueError as exc:
            log.warning("device %s not simulated: its config['simulator'] is malformed: %s", name, exc)
            continue
        behaviours[name] = replace(
            behaviour, command_topic=command_topic or "", reply_topic=reply_topic or ""
        )
    return behaviours


def passwords_issue(names: list[str]) -> dict[str, str]:
    """A new broker password for each of these devices, where iotqueue manages identities
    (none otherwise). Replaces the password a real device may have. Raises DynsecError."""
    if not managed():
        return {}
    return {device.name: device_password_issue(device) for device in Device.objects.filter(name__in=names)}


def fleet_fingerprint() -> tuple[Any, ...]:
    """A cheap summary of the table that changes when a device is created, deleted, saved,
    enabled or disabled (also by a queryset update of `enabled`): one aggregate query."""
    summary = Device.objects.aggregate(
        count=Count("pk"), enabled=Count("pk", filter=Q(enabled=True)), saved=Max("updated_at")
    )
    return summary["count"], summary["enabled"], summary["saved"]


@dataclass
class FleetChange:
    """What one sync did: devices now played, and devices no longer played (a changed device
    is in both)."""

    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


class FleetFollower:
    """Keeps a running Simulator in step with the Device table (the devices it added only)."""

    def __init__(self, simulator: Simulator, base: DeviceBehaviour, *, own_credentials: bool) -> None:
        self._simulator, self._base, self._own_credentials = simulator, base, own_credentials
        self._played: set[str] = set()
        self._fingerprint: tuple[Any, ...] | None = None

    def sync(self) -> FleetChange:
        """Play the enabled devices not played yet, drop those gone or disabled, replay those
        whose topics or knobs changed.

        How it fails: DatabaseError or DynsecError (broker unreachable while issuing passwords)
        propagate with the devices dropped so far dropped and none added; the next sync
        carries on from there.
        """
        wanted = fleet_read(self._base)
        devices = self._simulator.devices
        change = FleetChange()
        for name in sorted(self._played):
            device = devices.get(name)
            if device is None or wanted.get(name) != device.behaviour:
                self._simulator.device_remove(name)
                self._played.discard(name)
                change.dropped.append(name)
        devices = self._simulator.devices
        new = [name for name in wanted if name not in devices]
        passwords = passwords_issue(new) if self._own_credentials and new else {}
        for name in new:
            self._simulator.device_add(name, wanted[name], password=passwords.get(name))
            self._played.add(name)
            change.added.append(name)
        return change

    def poll(self) -> FleetChange:
        """sync() when the table's fingerprint changed since the last poll; never raises.

        A database or broker error is logged and the next poll tries again (the fingerprint
        is only remembered after a sync that worked).
        """
        close_old_connections()  # a long-running reader: recycle a connection the server dropped
        try:
            fingerprint = fleet_fingerprint()
            if fingerprint == self._fingerprint:
                return FleetChange()
            change = self.sync()
        except (DatabaseError, DynsecError) as exc:
            log.warning("simulate: could not follow the device table (trying again): %s", exc)
            return FleetChange()
        self._fingerprint = fingerprint
        for name in change.dropped:
            log.info("simulate: no longer playing %s", name)
        for name in change.added:
            log.info("simulate: playing %s", name)
        return change
