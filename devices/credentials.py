"""Each device's own broker identity: a user that may touch only that device's topics.

With IOTQUEUE_MQTT_AUTH = "dynsec" the broker's users live in Mosquitto's dynamic security
plugin (iotqueue/dynsec.py), and the Device row is the source of truth for them:

- a device's user is its name; its role `iotqueue-device-<name>` allows publishing only
  P/<name>/{ack,progress,done,status,heartbeat,jobs/get} (and its legacy reply topic) and
  subscribing only to P/<name>/cmd/# and P/<name>/jobs/current (and its legacy command topic);
- saving a device (created, renamed, enabled, disabled, topics changed) rewrites its role
  and enables or disables its user; deleting it removes both;
- iotqueue marks the users and roles it creates (`dynsec.MANAGED_MARK`) and only ever changes
  or deletes marked ones: a name held by a user or role it did not create is refused
  (`identity_conflict` before saving, `IdentityForeign` when writing), and deleting a device
  never deletes such a user. Identities from before the mark are adopted when recognised
  (`Identity.legacy`);
- a new user has no password, so nothing can log in as it until an operator issues one
  (`device_password_issue`: REST, admin or CLI), which is shown once and stored only
  as the broker's hash. Issuing again replaces it: the old password stops working.

The broker is changed before the database commits (the callers run in a transaction), so
an unreachable broker fails the operation with nothing changed; `identities_sync` (the
`mqtt_identities_sync` command) repairs drift, such as rows changed with `update()`.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db.models.signals import post_delete, post_save, pre_save
from django.utils.translation import gettext as _

from iotqueue.dynsec import ALREADY, MANAGED_MARK, DynsecError, control, managed_by_iotqueue, password_new
from iotqueue.mqtt import broker_address

from . import aws_jobs, protocol
from .certificate_rules import AuthorityUnavailable, common_name_check
from .models import Device
from .profiles import DeviceProtocol

if TYPE_CHECKING:
    from .certificates import Authority

log = logging.getLogger(__name__)

ROLE_PREFIX = "iotqueue-device-"
# Fields whose change rewrites the device's broker identity.
IDENTITY_FIELDS = ("name", "enabled", "command_topic", "reply_topic", "protocol")


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
    if device.protocol == DeviceProtocol.AWS_IOT_JOBS:
        # Its requests, and its notifications and answers, under $aws/things/<name>/jobs/.
        aws_publish, aws_subscribe = aws_jobs.device_acl_topics(device.name)
        publish += aws_publish
        subscribe += aws_subscribe
    return [{"acltype": "publishClientSend", "topic": t, "allow": True} for t in publish] + [
        {"acltype": "subscribePattern", "topic": t, "allow": True} for t in subscribe
    ]


# A disabled device's role: nothing at all. `disableClient` alone does not stop a certificate
# device: with `use_identity_as_username` Mosquitto never asks the plugin to authenticate it
# (measured on Mosquitto 2.0.11: it reconnects at once and keeps its role's rights), so the
# role itself must deny. Receiving is denied too, so a persistent session's subscriptions
# deliver nothing. disableClient still kicks every connection of that user name at once.
DISABLED_ACLS = [
    {"acltype": acltype, "topic": "#", "allow": False}
    for acltype in ("publishClientSend", "publishClientReceive", "subscribePattern")
]


def _username_check(name: str) -> None:
    if name == broker_address().username:
        raise DynsecError(f"{name!r} is the iotqueue service user's name; a device cannot have it")


class IdentityForeign(DynsecError):
    """The broker holds a client or role under a device's name that iotqueue did not create.

    iotqueue leaves it alone: the device cannot be created (or renamed) to that name.
    """


@dataclass(frozen=True)
class Identity:
    """A device name's entries on the broker as read now: its client and role, None where absent."""

    name: str
    client: dict[str, Any] | None
    role: dict[str, Any] | None

    @property
    def legacy(self) -> bool:
        """A client iotqueue created before it marked its own, so adopted (given the mark).

        Recognised by what only iotqueue's device code made: no mark, the text name
        `device <name>`, exactly the role `iotqueue-device-<name>` and no group. A user an
        operator made by hand (e.g. one the pre-mark code wrongly gave a device role) has
        another text name or other roles, and stays foreign.
        """
        client = self.client
        if client is None or managed_by_iotqueue(client):
            return False
        roles = [entry.get("rolename") for entry in client.get("roles") or []]
        return (
            client.get("textname") == _text_name(self.name)
            and roles == [role_name(self.name)]
            and not client.get("groups")
        )

    @property
    def client_ours(self) -> bool:
        return managed_by_iotqueue(self.client) or self.legacy

    @property
    def role_ours(self) -> bool:
        """Marked, or unmarked but held by a legacy client being adopted with it."""
        return managed_by_iotqueue(self.role) or (self.role is not None and self.legacy)

    def foreign_reason(self) -> str | None:
        """Why iotqueue may not take this name's broker identity, or None when it may."""
        if self.client is not None and not self.client_ours:
            return _(
                "the MQTT broker already has a user named %(name)r that iotqueue did not create; "
                "iotqueue leaves it alone, so a device cannot have this name"
            ) % {"name": self.name}
        if self.role is not None and not self.role_ours:
            return _(
                "the MQTT broker already has a role named %(role)r that iotqueue did not create; "
                "iotqueue leaves it alone, so a device cannot have this name"
            ) % {"role": role_name(self.name)}
        return None


def _text_name(device_name: str) -> str:
    return f"device {device_name}"


def identity_read(device_name: str) -> Identity:
    """What the broker holds under `device_name` now; raises DynsecError."""
    client, role = control.entries_read(username=device_name, rolename=role_name(device_name))
    return Identity(name=device_name, client=client, role=role)


def identity_conflict(device_name: str) -> str | None:
    """Why a device may not be named `device_name` on this broker, or None.

    The check before saving (REST, admin): the service user's name, or a broker client or
    role iotqueue did not create. `identity_write` checks again when it writes, for a
    client created in between.
    How it fails: DynsecError when the broker cannot be reached.
    """
    if not managed():
        return None
    if device_name == broker_address().username:
        return _("iotqueue's own services use this MQTT user name.")
    return identity_read(device_name).foreign_reason()


def identity_write(device: Device) -> None:
    """Create or rewrite `device`'s role and user (idempotent), marking both as iotqueue's.

    How it fails: IdentityForeign (nothing changed) when the name belongs to a client or
    role iotqueue did not create, also one created by someone else between the check and
    the write; DynsecError when the broker refuses or cannot be reached. The callers run in
    a transaction, so either undoes the row's change.
    """
    if not managed():
        return
    _username_check(device.name)
    identity = _identity_owned(identity_read(device.name))
    role, acls = role_name(device.name), device_acls(device) if device.enabled else DISABLED_ACLS
    commands: list[dict[str, Any]] = []
    if identity.client is None:
        client = {
            "username": device.name,
            "textname": _text_name(device.name),
            "textdescription": MANAGED_MARK,
        }
        identity = _created(identity, {"command": "createClient", **client}, client={**client, "roles": []})
    if identity.role is None:
        role_entry = {"rolename": role, "textdescription": MANAGED_MARK}
        identity = _created(identity, {"command": "createRole", **role_entry, "acls": acls}, role=role_entry)
    else:
        commands.append(
            {"command": "modifyRole", "rolename": role, "textdescription": MANAGED_MARK, "acls": acls}
        )
    if not managed_by_iotqueue(identity.client):  # adopting a legacy client
        commands.append({"command": "modifyClient", "username": device.name, "textdescription": MANAGED_MARK})
    if role not in _roles_held(identity):
        commands.append({"command": "addClientRole", "username": device.name, "rolename": role})
    commands.append(
        {"command": "enableClient" if device.enabled else "disableClient", "username": device.name}
    )
    for response in control.execute(commands):
        error = response.get("error")
        if error and not _role_added_meanwhile(response, role, device.name):
            raise DynsecError(f"{response.get('command')}: {error}")


def _roles_held(identity: Identity) -> list[str]:
    return [entry.get("rolename") for entry in (identity.client or {}).get("roles") or []]


def _role_added_meanwhile(response: dict[str, Any], role: str, username: str) -> bool:
    """Whether a failed addClientRole failed only because another writer gave the role first.

    Mosquitto 2.0's dynsec answers "Internal error" (not "already") when the client holds
    the role already, which is what a second process saving the same device meets between
    our read and our command: read again, and the write stands when the role is now held.
    """
    return response.get("command") == "addClientRole" and role in _roles_held(identity_read(username))


def _identity_owned(identity: Identity) -> Identity:
    """`identity` when iotqueue may write it; raises IdentityForeign otherwise."""
    reason = identity.foreign_reason()
    if reason:
        raise IdentityForeign(reason)
    return identity


def _created(identity: Identity, command: dict[str, Any], **made: dict[str, Any]) -> Identity:
    """Run one create command alone, so nothing else is done to an entry someone else made.

    On success the identity now holds `made` (client= or role=). "already exists" means
    another writer got there between our read and now: read again and go on only when that
    writer was iotqueue (another process saving the same device).
    """
    (response,) = control.execute([command])
    error = response.get("error")
    if not error:
        return replace(identity, **made)
    if "already exists" not in error.lower():
        raise DynsecError(f"{command['command']}: {error}")
    return _identity_owned(identity_read(identity.name))


def identity_remove(device_name: str) -> None:
    """Remove a device's user and role (idempotent) where they are iotqueue's; raises DynsecError.

    A client iotqueue did not create is left alone (logged), never deleted; its role, when
    iotqueue's, is deleted, which also takes it away from that client.
    """
    if not managed():
        return
    _username_check(device_name)
    identity = identity_read(device_name)
    commands = []
    if identity.client is not None and identity.client_ours:
        commands.append({"command": "deleteClient", "username": device_name})
    elif identity.client is not None:
        log.warning("device %s: broker user of that name is not iotqueue's; left alone", device_name)
    if identity.role is not None and identity.role_ours:
        commands.append({"command": "deleteRole", "rolename": role_name(device_name)})
    control.execute_checked(commands, tolerate=ALREADY)


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


@dataclass
class SyncReport:
    """What `identities_sync` did: identities written and removed, and names left alone."""

    written: int = 0
    removed: int = 0
    foreign: list[str] = field(default_factory=list)


def identities_sync() -> SyncReport:
    """Rewrite every device's identity and remove iotqueue's identities of devices that are gone.

    Adopts legacy (pre-mark) identities as it writes them. Clients and roles iotqueue did not
    create are left alone and reported in `foreign`: a device whose name one holds, and
    unmarked `iotqueue-device-*` roles of no device.
    How it fails: DynsecError when the broker refuses or cannot be reached (what was done
    before stays done; running it again carries on).
    """
    report = SyncReport()
    if not managed():
        return report
    devices = list(Device.objects.all())
    for device in devices:
        try:
            identity_write(device)
        except IdentityForeign as exc:
            report.foreign.append(f"device {device.name}: {exc}")
            continue
        report.written += 1
    names = {device.name for device in devices}
    for name in sorted(_orphan_names(names)):
        identity = identity_read(name)
        reason = identity.foreign_reason()
        if reason:
            report.foreign.append(f"{role_name(name)} (no device): {reason}")
        if identity.client_ours or identity.role_ours:
            identity_remove(name)
            report.removed += 1
    return report


def _orphan_names(device_names: set[str]) -> set[str]:
    """Names with an `iotqueue-device-*` role or an iotqueue-marked client but no device row."""
    roles, clients = control.execute(
        [{"command": "listRoles", "count": -1}, {"command": "listClients", "verbose": True, "count": -1}]
    )
    for response in (roles, clients):
        if response.get("error"):
            raise DynsecError(f"{response.get('command')}: {response['error']}")
    orphans = {
        role[len(ROLE_PREFIX) :]
        for role in (roles.get("data") or {}).get("roles", [])
        if isinstance(role, str) and role.startswith(ROLE_PREFIX)
    }
    orphans |= {
        client.get("username")
        for client in (clients.get("data") or {}).get("clients", [])
        if isinstance(client, dict) and managed_by_iotqueue(client)
    }
    return {name for name in orphans if name and name not in device_names}


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


@dataclass(frozen=True)
class IssuedCertificate:
    """A device certificate just issued: the PEM texts, shown once, and what the row keeps."""

    certificate_pem: str
    ca_certificate_pem: str
    broker_ca_certificate_pem: str  # what verifies the broker's own certificate
    private_key_pem: str  # "" when the device sent a CSR: its key never left it
    serial: str
    fingerprint: str
    not_after: datetime.datetime


def device_certificate_issue(device: Device, *, csr_pem: str | None = None) -> IssuedCertificate:
    """Sign a client certificate (CN = the device's name) with the device CA; returns it once.

    With `csr_pem` the device's own key is certified; without, a new key is made and
    returned (the only time it exists outside the device). The row keeps only the serial,
    fingerprint and end of validity. The device's broker identity is written first, so the
    certificate works at once on the mTLS listener, confined by the device's role.
    How it fails: CredentialsUnavailable when identities are not managed here;
    AuthorityUnavailable when no device CA is configured or readable;
    CsrRefused for a CSR of another name or a weak key; NameUnfit
    when the device's name is too long for a certificate; DynsecError when the
    broker refuses or cannot be reached. Nothing is issued or stored in any of these cases.
    """
    if not managed():
        raise CredentialsUnavailable(
            _("this deployment's broker does not take device identities from iotqueue")
            + " (IOTQUEUE_MQTT_AUTH=none)"
        )
    common_name_check(device.name)
    # Signing needs `cryptography` (about 17 MB a process): loaded by the process that issues
    # a certificate, not by every bridge and worker (devices/certificate_rules.py).
    from . import certificates

    authority = certificates.authority_load(settings.IOTQUEUE_DEVICE_CA_CERT, settings.IOTQUEUE_DEVICE_CA_KEY)
    key = None
    if csr_pem is None:
        key = certificates.key_new()
        public_key = key.public_key()
    else:
        public_key = certificates.csr_public_key(csr_pem, device_name=device.name)
    identity_write(device)
    certificate = certificates.certificate_sign(
        authority, common_name=device.name, public_key=public_key, days=settings.IOTQUEUE_DEVICE_CERT_DAYS
    )
    issued = IssuedCertificate(
        certificate_pem=certificates.certificate_pem(certificate),
        ca_certificate_pem=authority.certificate_pem,
        broker_ca_certificate_pem=_broker_ca_pem(authority),
        private_key_pem=certificates.key_pem(key) if key is not None else "",
        serial=certificates.certificate_serial(certificate),
        fingerprint=certificates.certificate_fingerprint(certificate),
        not_after=certificate.not_valid_after_utc,
    )
    Device.objects.filter(pk=device.pk).update(
        certificate_serial=issued.serial,
        certificate_fingerprint=issued.fingerprint,
        certificate_not_after=issued.not_after,
    )
    device.certificate_serial, device.certificate_fingerprint = issued.serial, issued.fingerprint
    device.certificate_not_after = issued.not_after
    log.info("device %s: client certificate %s issued", device.name, issued.serial)
    return issued


def _broker_ca_pem(authority: Authority) -> str:
    """The CA a device verifies the broker with: IOTQUEUE_BROKER_CA_CERT, or the device CA.

    How it fails: AuthorityUnavailable when the configured file cannot be read.
    """
    path = settings.IOTQUEUE_BROKER_CA_CERT
    if not path:
        return authority.certificate_pem
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AuthorityUnavailable(
            _("the broker's CA certificate cannot be read: %(error)s") % {"error": exc}
        ) from None
