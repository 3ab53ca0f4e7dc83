"""The benchmark's own stack: Redis, MQTT broker, a fresh SQLite file, and the Celery children.

Everything is started in a scratch directory under var/bench/ with its own topic prefix, Redis
key prefix and Celery queue, and registered on an ExitStack so that it is stopped on any exit:
normal, exception, Ctrl-C or SIGTERM. Only processes started here are ever signalled.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from devtools.processes import BASE_DIR, Supervisor, beat_argv, manage_argv, worker_argv
from devtools.servers import EmbeddedServer, mqtt_broker_start, redis_start

SCRATCH_ROOT = BASE_DIR / "var" / "bench"
# The machine has 2 cores: one prefork child per core, for the engine and the baseline alike.
WORKER_CONCURRENCY = 2
# Cold Python imports of Celery + Django on a busy 2-core machine take a few seconds.
READY_TIMEOUT_SECONDS = 60.0
# The first monitor tick (beat interval 1 s) opens the lock epoch; no grant happens before.
EPOCH_TIMEOUT_SECONDS = 30.0
READY_PATTERNS = {"worker": r"@\S+ ready\.", "bridge": r"bridge: connected", "beat": r"beat: Starting"}
ENGINE_CHILDREN = ("worker", "bridge", "beat")
# The children whose SQL bench.sql_count counts (beat runs none with its file schedule).
SQL_COUNTED_CHILDREN = ("worker", "bridge")
# Log lines that explain a failed phase: errors, and the exception line closing a traceback.
ERROR_RE = re.compile(r"ERROR|CRITICAL|^\w*(Error|Exception): ")
ERROR_LINES_SHOWN = 5


@dataclass
class BenchStack:
    """Servers and children of one benchmark run; `namespace` isolates its topics, keys, queue."""

    workdir: Path
    namespace: str
    redis: EmbeddedServer
    broker: EmbeddedServer
    supervisor: Supervisor

    @property
    def database(self) -> str:
        """What the engine stores its rows in, without credentials."""
        from django.db import connection

        if connection.vendor == "sqlite":
            return "sqlite (WAL file)"
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            return f"{connection.vendor} {cursor.fetchone()[0]}"

    @property
    def baseline_queue(self) -> str:
        return f"{self.namespace}-baseline"

    def child_start(self, name: str, argv: list[str]) -> None:
        """Start a child and wait until its log says it is ready; raises if it dies first."""
        offset = self.supervisor.log_size(name) if name in self.supervisor.children else 0
        self.supervisor.start(name, argv)
        pattern = READY_PATTERNS[name.split("-")[-1]]
        self.supervisor.wait_for_log(name, pattern, timeout=READY_TIMEOUT_SECONDS, since=offset)

    def baseline_worker_start(self) -> None:
        """A worker with the engine's settings that also knows bench.noop, on its own queue."""
        argv = worker_argv(concurrency=WORKER_CONCURRENCY, hostname=f"{self.namespace}-baseline")
        self.child_start(
            "baseline-worker", [*argv, "--queues", self.baseline_queue, "--include", "bench.tasks"]
        )

    def engine_start(self, *, sql_count: bool = False) -> None:
        """Worker, bridge and beat (file schedule, as the tests use), then the lock epoch.

        With `sql_count`, the worker (pool children included) and the bridge run under
        bench.sql_count, which counts their SQL statements and commits in Redis.
        """
        from devices.locks import lock_epoch_exists

        worker = worker_argv(concurrency=WORKER_CONCURRENCY, hostname=self.namespace)
        bridge = manage_argv("bridge")
        if sql_count:
            worker, bridge = sql_counted(worker, "worker"), sql_counted(bridge, "bridge")
        self.child_start("worker", worker)
        self.child_start("bridge", bridge)
        self.child_start(
            "beat", beat_argv(self.workdir, scheduler="iotqueue.beat_lease:LeasedPersistentScheduler")
        )
        deadline = time.monotonic() + EPOCH_TIMEOUT_SECONDS
        while not lock_epoch_exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no monitor tick opened the lock epoch within {EPOCH_TIMEOUT_SECONDS}s")
            time.sleep(0.05)

    def cpu_roots(self) -> dict[str, int]:
        """Root PIDs of what this benchmark runs, by component, for bench.cpu."""
        roots = {"bench": os.getpid(), "redis": self.redis.process.pid, "mqtt": self.broker.process.pid}
        for name, child in self.supervisor.children.items():
            if child.alive():
                roots[name] = child.pid
        return roots

    def engine_stop(self) -> None:
        for name in reversed(ENGINE_CHILDREN):
            self.supervisor.stop(name)

    def log_dir(self) -> Path:
        return self.supervisor.log_dir

    def errors_say(self, say: Callable[[str], None]) -> None:
        """Show the last error lines of every child's log: why runs stalled, usually."""
        for name, child in self.supervisor.children.items():
            lines = [line for line in child.log_text().splitlines() if ERROR_RE.search(line)]
            for line in lines[-ERROR_LINES_SHOWN:]:
                say(f"  {name}: {line}")
        say(f"  logs: {self.log_dir()}")


def sql_counted(argv: list[str], component: str) -> list[str]:
    """`python -m celery ARGS` / `python manage.py ARGS` under bench.sql_count, ARGS unchanged."""
    python, rest = argv[0], argv[1:]
    if rest[:1] == ["-m"]:
        rest = rest[1:]
    return [python, "-m", "bench.sql_count", "--component", component, *rest]


def _database_create(exits: ExitStack, *, workdir: Path, namespace: str, server_url: str | None) -> str:
    """The URL of a fresh, empty database: a SQLite file in workdir by default.

    With `server_url` (postgres://user@host:port/db) a database named `namespace` is created
    beside `db` on that server, and dropped again at exit.
    """
    if not server_url:
        return f"sqlite:///{(workdir / 'bench.sqlite3').resolve()}"
    parsed = urlsplit(server_url)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise ValueError("--database-url takes a postgres:// URL; without it the bench uses SQLite")
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{namespace}"')

    def drop() -> None:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{namespace}" WITH (FORCE)')

    exits.callback(drop)
    return urlunsplit(parsed._replace(path=f"/{namespace}"))


def stack_open(
    exits: ExitStack, *, database_url: str | None = None, mosquitto_options: tuple[str, ...] = ()
) -> BenchStack:
    """Start Redis and the broker, point this process's settings at them, migrate a fresh DB.

    `mosquitto_options`: extra lines for the broker's config (devtools.servers). Must run
    before django.setup() anywhere else: settings are read from os.environ once.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    workdir = SCRATCH_ROOT / f"{stamp}-{os.getpid()}"
    workdir.mkdir(parents=True)
    redis = redis_start(workdir)
    exits.callback(redis.stop)
    broker = mqtt_broker_start(workdir, mosquitto_options=mosquitto_options)
    exits.callback(broker.stop)
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    database = _database_create(exits, workdir=workdir, namespace=namespace, server_url=database_url)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
            "DATABASE_URL": database,
            "REDIS_URL": redis.url,
            "CELERY_BROKER_URL": redis.url,
            "MQTT_URL": broker.url,
            "IOTQUEUE_MQTT_AUTH": broker.auth,
            "IOTQUEUE_TOPIC_PREFIX": namespace,
            "IOTQUEUE_REDIS_KEY_PREFIX": namespace,
            "CELERY_TASK_DEFAULT_QUEUE": namespace,
            # As in production: DEBUG would make every process keep a log of its SQL queries.
            # Without DEBUG the settings want a real secret key and hosts: a throwaway one.
            "DEBUG": "false",
            "SECRET_KEY": secrets.token_urlsafe(50),
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
        }
    )
    import django
    from django.core.management import call_command

    django.setup()
    # This process starts runs and polls; its per-event INFO lines would bury the report.
    logging.getLogger().setLevel(logging.WARNING)
    call_command("migrate", verbosity=0)
    supervisor = Supervisor(workdir / "logs", dict(os.environ))
    exits.callback(supervisor.stop_all)
    return BenchStack(workdir, namespace, redis, broker, supervisor)


def stop_signals_install(tool: str) -> None:
    """Make SIGTERM and SIGINT unwind the caller's ExitStack, so every child and server it
    started is stopped (SIGINT too when started in the background, where the shell leaves
    it ignored)."""

    def terminate(signum: int, frame: object) -> None:
        print(f"{tool}: signal {signum}; stopping everything it started", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
