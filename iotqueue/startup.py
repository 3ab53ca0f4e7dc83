"""Start-up checks: each dependency a process needs, probed once, failing in one line.

A process that starts against a broker without the dynamic security plugin, with wrong
broker credentials, an unreachable Redis or an unmigrated database used to die later, after
a timeout, with a traceback. These checks run first, each bounded by a few seconds, and
raise StartupError with one line that says what is wrong and what to do; the entry points
(`manage.py bridge`, `make run`, the Celery worker and beat through their `worker_init` and
`beat_init` signals) print that line and exit with status 1.

Before any of that, the settings themselves fail closed (iotqueue/settings.py: no real
SECRET_KEY or no ALLOWED_HOSTS without DEBUG); every entry point (manage.py, the WSGI
module gunicorn imports, `celery -A iotqueue ...`) loads them through settings_load_or_exit,
which turns the ImproperlyConfigured into the same kind of line.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Iterable

import paho.mqtt.client as mqtt
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.utils import DatabaseError

from . import dynsec
from .mqtt import broker_address, client_connect, client_create

# How long a start-up probe waits for the broker's CONNACK or the plugin's answer: a broker
# on the same network answers in milliseconds; a few seconds leave room for a busy one
# without making a misconfigured start wait long.
PROBE_SECONDS = 3.0
# Redis: connecting and the PING, each.
REDIS_PROBE_SECONDS = 3.0


class StartupError(RuntimeError):
    """A dependency is missing or misconfigured; the message is one line saying what to do."""


def _mqtt_where(url: str | None = None) -> str:
    address = broker_address(url)
    return f"{address.host}:{address.port}"


def mqtt_check(*, url: str | None = None, dynsec_probe: bool | None = None) -> None:
    """Connect to the broker once; with dynamic security (IOTQUEUE_MQTT_AUTH=dynsec, or
    `dynsec_probe`) also ask the plugin one harmless question.

    How it fails: StartupError when the broker is unreachable, refuses the credentials, or
    has no dynamic security plugin (nothing answers on its control topic within PROBE_SECONDS).
    """
    if dynsec_probe is None:
        dynsec_probe = settings.IOTQUEUE_MQTT_AUTH == "dynsec"
    where = _mqtt_where(url)
    connack: list[mqtt.ReasonCode] = []
    connected, subscribed, answered = threading.Event(), threading.Event(), threading.Event()
    correlation = uuid.uuid4().hex

    def on_connect(client, userdata, flags, reason_code, properties) -> None:
        connack.append(reason_code)
        connected.set()
        if not reason_code.is_failure and dynsec_probe:
            client.subscribe(dynsec.RESPONSE_TOPIC, qos=1)

    def on_subscribe(client, userdata, mid, reason_codes, properties) -> None:
        if reason_codes and not reason_codes[0].is_failure:
            command = {"command": "getDefaultACLAccess", "correlationData": correlation}
            client.publish(dynsec.CONTROL_TOPIC, json.dumps({"commands": [command]}), qos=1)
        subscribed.set()

    def on_message(client, userdata, message: mqtt.MQTTMessage) -> None:
        if correlation.encode() in message.payload:
            answered.set()

    client = client_create("startup", url=url)
    client.reconnect_delay_set(min_delay=PROBE_SECONDS, max_delay=PROBE_SECONDS)
    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    try:
        client_connect(client, url=url)
        if not connected.wait(PROBE_SECONDS):
            raise StartupError(f"cannot reach the MQTT broker at {where} (MQTT_URL): is it running?")
        if connack[0].is_failure:
            raise StartupError(
                f"the MQTT broker at {where} refused the connection ({connack[0]}): "
                "check the user and password in MQTT_URL"
            )
        if dynsec_probe and not answered.wait(PROBE_SECONDS):
            raise StartupError(
                f"the MQTT broker at {where} has no dynamic security plugin (or MQTT_URL's user may "
                "not administer it): enable it, or set IOTQUEUE_MQTT_AUTH=none"
            )
    finally:
        client.loop_stop()
        client.disconnect()


def redis_check(*, url: str | None = None) -> None:
    """PING Redis once. How it fails: StartupError naming the URL (without its password)."""
    url = url or settings.REDIS_URL
    client = redis.Redis.from_url(
        url, socket_connect_timeout=REDIS_PROBE_SECONDS, socket_timeout=REDIS_PROBE_SECONDS
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        shown = client.connection_pool.connection_kwargs
        where = f"{shown.get('host', '?')}:{shown.get('port', '?')}/{shown.get('db', 0)}"
        raise StartupError(f"cannot reach Redis at {where} (REDIS_URL): {exc}") from exc
    finally:
        client.close()


def migrations_check(*, database: str = DEFAULT_DB_ALIAS) -> None:
    """The database is reachable and every migration applied.

    How it fails: StartupError saying to run `manage.py migrate`, or that the database
    cannot be reached.
    """
    connection = connections[database]
    try:
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except DatabaseError as exc:
        raise StartupError(f"cannot use the database (DATABASE_URL): {exc}".splitlines()[0]) from exc
    if pending:
        raise StartupError(
            f"the database is not migrated ({len(pending)} migrations pending): "
            "run `python manage.py migrate`"
        )


def mqtt_connect_check() -> None:
    """The broker accepts MQTT_URL's credentials; no dynamic security probe (a worker only
    publishes, and its user need not administer the plugin)."""
    mqtt_check(dynsec_probe=False)


CHECKS = {
    "mqtt": mqtt_check,
    "mqtt_connect": mqtt_connect_check,
    "redis": redis_check,
    "migrations": migrations_check,
}
# What each Celery process checks at start (iotqueue/celery.py): a worker publishes commands
# over MQTT; beat only needs the database (its schedule, the engine's tables) and Redis.
WORKER_CHECKS = ("redis", "migrations", "mqtt_connect")
BEAT_CHECKS = ("redis", "migrations")


def startup_check(names: Iterable[str] = ("migrations", "redis", "mqtt")) -> None:
    """Run the named checks in order; the first that fails raises its StartupError."""
    for name in names:
        CHECKS[name]()


def startup_check_or_exit(process: str, names: Iterable[str]) -> None:
    """startup_check for an entry point: on a failure, write `<process>: <line>` to stderr
    and exit with status 1, without a traceback."""
    try:
        startup_check(names)
    except StartupError as exc:
        sys.stderr.write(f"{process}: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def settings_load_or_exit(process: str, *, status: int = 1) -> None:
    """Load Django's settings for an entry point. They refuse to load when misconfigured
    (ImproperlyConfigured, whose message names the variable to set): then write
    `<process>: <message>` to stderr and exit with `status`, without a traceback. Any
    other error while loading them is a bug and keeps its traceback."""
    try:
        settings.INSTALLED_APPS  # noqa: B018  (the first access imports the settings module)
    except ImproperlyConfigured as exc:
        sys.stderr.write(f"{process}: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(status) from None
