"""Mosquitto's dynamic security plugin: the broker's users, roles and ACLs, driven from here.

The broker keeps its identities in a JSON file (`plugin_opt_config_file`) and changes them
when an administrator publishes commands on `$CONTROL/dynamic-security/v1`; answers come
back on `.../response`, matched here by `correlationData`. This module knows the plugin's
file format and command protocol, nothing about devices: `devices/credentials.py` says
which identities and ACLs a device gets.

The file is written once, before the broker first starts (`config_write`, used by the
embedded test/dev broker and by `manage.py mqtt_security_init` in the shipped deployment):
it holds the iotqueue service user (from MQTT_URL), which may administer the plugin and use
every normal topic. Everything after that goes through commands.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from .mqtt import CONNECT_TIMEOUT_SECONDS, ProcessClient, broker_address

CONTROL_TOPICS = "$CONTROL/dynamic-security/#"
CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = f"{CONTROL_TOPIC}/response"
# The plugin's own role for administering it, as `mosquitto_ctrl dynsec init` makes it.
ADMIN_ROLE = "dynsec-admin"
# iotqueue's services (web, worker, beat, bridge): every normal topic ($-topics excepted).
SERVICE_ROLE = "iotqueue-service"
SERVICE_ACL_TYPES = ("publishClientSend", "publishClientReceive", "subscribePattern", "unsubscribePattern")
# `#` matches no topic that starts with `$`: the $-topics the services use besides the plugin's
# own, each named (the AWS IoT Jobs device profile, devices/aws_jobs.py, lives under $aws/things).
SERVICE_DOLLAR_FILTERS = ("$aws/things/#",)
# What `mosquitto_ctrl` uses; the plugin reads the count from the file, so it can change.
PBKDF2_ITERATIONS = 101
SALT_BYTES = 12
# How long a command waits for the broker's answer.
COMMAND_TIMEOUT_SECONDS = 5.0
# Errors that mean "already as asked" for the idempotent helpers below.
ALREADY = ("already exists", "not found")
# The `textdescription` iotqueue gives every client and role it creates. iotqueue changes or
# deletes only entries carrying it: a user or role an operator made by hand (an edge consumer,
# another dynsec-admin) is never rewritten, even when a device is named like it.
MANAGED_MARK = "managed by iotqueue (do not edit: iotqueue rewrites it)"
# What the plugin answers for a getClient / getRole of something that does not exist.
NOT_FOUND = "not found"


class DynsecError(RuntimeError):
    """The broker refused a command, or did not answer in time."""


def _acl(acltype: str, topic: str) -> dict[str, Any]:
    return {"acltype": acltype, "topic": topic, "allow": True}


def password_hash(password: str) -> dict[str, Any]:
    """The plugin's stored form of a password: PBKDF2-SHA512 over a random salt."""
    salt = os.urandom(SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    return {
        "password": base64.b64encode(digest).decode(),
        "salt": base64.b64encode(salt).decode(),
        "iterations": PBKDF2_ITERATIONS,
    }


def config_initial(username: str, password: str) -> dict[str, Any]:
    """A plugin file with one client, the service user; everyone else is denied by default."""
    everything = "#"
    return {
        "clients": [
            {
                "username": username,
                "textName": "iotqueue services",
                **password_hash(password),
                "roles": [{"rolename": ADMIN_ROLE}, {"rolename": SERVICE_ROLE}],
            }
        ],
        "groups": [],
        "roles": [
            {
                "rolename": ADMIN_ROLE,
                "acls": [
                    _acl(kind, CONTROL_TOPICS)
                    for kind in ("publishClientSend", "publishClientReceive", "subscribePattern")
                ],
            },
            {
                "rolename": SERVICE_ROLE,
                "acls": [
                    _acl(kind, topic)
                    for topic in (everything, *SERVICE_DOLLAR_FILTERS)
                    for kind in (
                        "publishClientSend",
                        "publishClientReceive",
                        "subscribePattern",
                        "unsubscribePattern",
                    )
                ],
            },
        ],
        # Nobody may publish or subscribe unless a role says so; receiving what one may
        # subscribe to, and unsubscribing, are harmless.
        "defaultACLAccess": {
            "publishClientSend": False,
            "publishClientReceive": True,
            "subscribe": False,
            "unsubscribe": True,
        },
    }


def config_write(path: Path, username: str, password: str, *, force: bool = False) -> bool:
    """Write the initial plugin file (mode 0600) unless one exists; True when written."""
    path = Path(path)
    if path.exists() and not force:
        return False
    if not username or not password:
        raise ValueError("the service user needs a username and a password (set them in MQTT_URL)")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(config_initial(username, password), file, indent=2)
    temporary.replace(path)
    return True


def managed_by_iotqueue(entry: dict[str, Any] | None) -> bool:
    """True when a client or role (as getClient / getRole return it) carries iotqueue's mark."""
    return bool(entry) and entry.get("textdescription") == MANAGED_MARK


def password_new() -> str:
    """A fresh random password for a broker identity (shown once, stored only as a hash)."""
    return secrets.token_urlsafe(24)


class Control(ProcessClient):
    """A connected administrator of the plugin, shared by the threads of a process.

    Like the command publisher it connects lazily and again after a fork, and is ready
    once subscribed to the plugin's responses. `execute` sends commands in one message and
    returns the broker's responses in order.
    """

    def __init__(self) -> None:
        super().__init__("dynsec")
        self._waiting: dict[str, tuple[threading.Event, list]] = {}

    def _on_ready_connect(self, client: mqtt.Client) -> None:
        client.subscribe(RESPONSE_TOPIC, qos=1)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if reason_codes and not reason_codes[0].is_failure:
            self._ready.set()

    def _client_configure(self, client: mqtt.Client) -> None:
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        try:
            responses = json.loads(message.payload).get("responses") or []
        except (ValueError, AttributeError):
            return
        by_batch: dict[str, list] = {}
        for response in responses:
            batch = str(response.get("correlationData", "")).split(":")[0]
            by_batch.setdefault(batch, []).append(response)
        for batch, items in by_batch.items():
            waiting = self._waiting.get(batch)
            if waiting:
                waiting[1].extend(items)
                waiting[0].set()

    def execute(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run commands in order; returns one response each ({"command", "error"?, "data"?}).

        Raises DynsecError when the broker cannot be reached or does not answer in time.
        """
        if not commands:
            return []
        client = self._client_get()
        if not self._ready.wait(CONNECT_TIMEOUT_SECONDS):
            self.close()  # the next call starts a fresh client (see Publisher._not_connected)
            address = broker_address()
            raise DynsecError(f"cannot administer the MQTT broker at {address.host}:{address.port}")
        batch = uuid.uuid4().hex
        tagged = [{**command, "correlationData": f"{batch}:{n}"} for n, command in enumerate(commands)]
        done, responses = threading.Event(), []
        self._waiting[batch] = (done, responses)
        try:
            client.publish(CONTROL_TOPIC, json.dumps({"commands": tagged}), qos=1)
            while len(responses) < len(commands):
                if not done.wait(COMMAND_TIMEOUT_SECONDS):
                    raise DynsecError(f"the MQTT broker did not answer {commands[0]['command']} in time")
                done.clear()
        finally:
            del self._waiting[batch]
        return sorted(responses, key=lambda r: int(str(r["correlationData"]).split(":")[1]))

    def execute_checked(self, commands: list[dict[str, Any]], *, tolerate: tuple[str, ...] = ()) -> None:
        """execute(), raising DynsecError for any error not containing one of `tolerate`."""
        for response in self.execute(commands):
            error = response.get("error")
            if error and not any(text in error.lower() for text in tolerate):
                raise DynsecError(f"{response.get('command')}: {error}")

    def entries_read(self, *, username: str, rolename: str) -> tuple[dict | None, dict | None]:
        """The plugin's client `username` and role `rolename`, None where absent (one round trip).

        How it fails: DynsecError when the broker cannot be reached or answers with another
        error than "not found".
        """
        client, role = self.execute(
            [{"command": "getClient", "username": username}, {"command": "getRole", "rolename": rolename}]
        )
        found = []
        for response, key in ((client, "client"), (role, "role")):
            error = response.get("error")
            if error and NOT_FOUND not in error.lower():
                raise DynsecError(f"{response.get('command')}: {error}")
            found.append(None if error else (response.get("data") or {}).get(key))
        return found[0], found[1]


control = Control()


def service_role_complete() -> None:
    """Give the service role the $-topic ACLs (SERVICE_DOLLAR_FILTERS) that a plugin file
    written before them lacks; idempotent (an ACL it has already is left as it is).

    How it fails: DynsecError when the broker cannot be reached or refuses.
    """
    control.execute_checked(
        [
            {
                "command": "addRoleACL",
                "rolename": SERVICE_ROLE,
                "acltype": kind,
                "topic": topic,
                "allow": True,
            }
            for topic in SERVICE_DOLLAR_FILTERS
            for kind in SERVICE_ACL_TYPES
        ],
        tolerate=("already exists",),
    )
