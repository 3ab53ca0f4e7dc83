"""Each device's own broker identity: a user that may touch only that device's topics.

With IOTQUEUE_MQTT_AUTH = "dynsec" the broker's users live in Mosquitto's dynamic security
plugin (iotqueue/dynsec.py), and the Device row is the source of truth for them:

- a device's user is its name; its role `iotqueue-device-<name>` allows publishing only
  P/<name>/{ack,progress,done,status,heartbeat,jobs/get} (and its legacy reply topic) and
  subscribing only to P/<name>/cmd/# and P/<name>/jobs/current (and its legacy command topic);
- saving a device (created, renamed, enabled, disabled, topics changed) rewrites its role
  and enables or disables its user; deleting it removes both;
- a new user has no password, so nothing can log in as it until an operator issues one
  (`device_password_issue`: REST, admin or CLI), which is shown once and stored only
  as the broker's hash. Issuing again replaces it: the old password stops working.

The broker is changed before the database commits (the callers run in a transaction), so
an unreachable broker fails the operation with nothing changed; `identities_sync` (the
`mqtt_identities_sync` command) repairs drift, such as rows changed with `update()`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db.models.signals import post_delete, post_save, pre_save

from iotqueue.dynsec import ALREADY, DynsecError, control, password_new
from iotqueue.mqtt import broker_address

from . import protocol
from .models import Device

log = logging.getLogger(__name__)

ROLE_PREFIX = "iotqueue-device-"
# Fields whose change rewrites the device's broker identity.
IDENTITY_FIELDS = ("name", "enabled", "command_topic", "reply_topic")


class CredentialsUnavailable(RuntimeError):
    """This deployment's broker identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)."""


def managed() -> bool:
    return settings.IOTQUEUE_MQTT_AUTH == "dynsec"


def role_name(device_name: str) -> str:
    return f"{ROLE_PREFIX}{device_name}"


def device_acls(device: Device) -> list[dict[str, Any]]:
    """What `device` may do: publish its replies and presence, subscribe to its commands."""
    publish = [
        protocol.device_topic(device.name, kind) for kind in (*protocol.DEVICE_KINDS, protocol.JOBS_GET)
    ]
    subscribe = [
        protocol.command_topic(device.name, "#"),
        protocol.device_topic(device.name, protocol.JOBS_CURRENT),
    ]
    # Never a $ topic, even on a row saved before validation refused them: an ACL on
    # $CONTROL/... would let the device administer the broker.
    if device.reply_topic and not device.reply_topic.startswith("$"):
        publish.append(device.reply_topic)
    if device.command_topic and not device.command_topic.startswith("$"):
        subscribe.append(device.command_topic)
    return [{"acltype": "publishClientSend", "topic": t, "allow": True} for t in publish] + [
        {"acltype": "subscribePattern", "topic": t, "allow": True} for t in subscribe
    ]


def _username_check(name: str) -> None:
    if name == broker_address().username:
        raise DynsecError(f"{name!r} is the iotqueue service user's name; a device cannot have it")


def identity_write(device: Device) -> None:
    """Create or rewrite `device`'s role and user (idempotent); raises DynsecError."""
    if not managed():
        return
    _username_check(device.name)
    role = role_name(device.name)
    control.execute_checked(
        [
            {"command": "deleteRole", "rolename": role},
            {"command": "createRole", "rolename": role, "acls": device_acls(device)},
            {"command": "createClient", "username": device.name, "textname": f"device {device.name}"},
            {"command": "addClientRole", "username": device.name, "rolename": role},
            {"command": "enableClient" if device.enabled else "disableClient", "username": device.name},
        ],
        tolerate=ALREADY,
    )


def identity_remove(device_name: str) -> None:
    """Remove a device's user and role (idempotent); raises DynsecError."""
    if not managed():
        return
    _username_check(device_name)
    control.execute_checked(
        [
            {"command": "deleteClient", "username": device_name},
            {"command": "deleteRole", "rolename": role_name(device_name)},
        ],
        tolerate=ALREADY,
    )


def device_password_issue(device: Device) -> str:
    """Give `device` a new random password and return it (the only time it is readable).

    Raises CredentialsUnavailable when identities are not managed here, DynsecError when
    the broker refuses or cannot be reached.
    """
    if not managed():
        raise CredentialsUnavailable(
            "this deployment's broker does not take device identities from iotqueue (IOTQUEUE_MQTT_AUTH=none)"
        )
    identity_write(device)
    password = password_new()
    control.execute_checked([{"command": "setClientPassword", "username": device.name, "password": password}])
    log.info("device %s: new MQTT password issued", device.name)
    return password


def identities_sync() -> tuple[int, int]:
    """Rewrite every device's identity and remove those of devices that are gone.

    Returns (written, removed).
    """
    if not managed():
        return 0, 0
    devices = list(Device.objects.all())
    for device in devices:
        identity_write(device)
    names = {device.name for device in devices}
    response = control.execute([{"command": "listRoles", "count": -1}])[0]
    if response.get("error"):
        raise DynsecError(f"listRoles: {response['error']}")
    orphans = [
        role[len(ROLE_PREFIX) :]
        for role in (response.get("data") or {}).get("roles", [])
        if isinstance(role, str) and role.startswith(ROLE_PREFIX) and role[len(ROLE_PREFIX) :] not in names
    ]
    for name in orphans:
        identity_remove(name)
    return len(devices), len(orphans)


def _identity_before(sender, instance: Device, **kwargs) -> None:
    """Remember the identity fields as stored, to tell after saving what changed."""
    previous = None
    if instance.pk is not None:
        previous = Device.objects.filter(pk=instance.pk).values(*IDENTITY_FIELDS).first()
    instance._identity_previous = previous


def _identity_saved(sender, instance: Device, created: bool, raw: bool = False, **kwargs) -> None:
    if raw or not managed():
        return
    previous = getattr(instance, "_identity_previous", None)
    current = {field: getattr(instance, field) for field in IDENTITY_FIELDS}
    if not created and previous == current:
        return
    if previous and previous["name"] != instance.name:
        identity_remove(previous["name"])  # renamed: the old user must not keep working
    identity_write(instance)


def _identity_deleted(sender, instance: Device, **kwargs) -> None:
    if managed():
        identity_remove(instance.name)


def signals_connect() -> None:
    """Keep broker identities in step with Device rows (called from DevicesConfig.ready)."""
    pre_save.connect(_identity_before, sender=Device, dispatch_uid="devices.identity_before")
    post_save.connect(_identity_saved, sender=Device, dispatch_uid="devices.identity_saved")
    post_delete.connect(_identity_deleted, sender=Device, dispatch_uid="devices.identity_deleted")
