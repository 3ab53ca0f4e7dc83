"""The dev stack: `python -m devtools.devstack` (what `make run` calls) runs everything locally.

It starts a real Redis and a real MQTT broker on free ports (unless REDIS_URL / MQTT_URL
are set), migrates, starts a Celery worker, beat, the bridge, the web server, the device
simulator (for devices added later) and the demo's devices (on the device agent library,
`manage.py demo_devices`), then runs the `demo` command (seed devices and templates, trigger
runs, show progress). Its start-up ends with one block saying how to use the stack (access_block), printed
again when the demo is done. Ctrl-C or SIGTERM stops every child it started. With
--exit-when-done (implied when CI is set) it stops once the demo runs have finished.

Several stacks can run from one checkout: each claims its own state directory (var/devstack,
else var/devstack-2, -3, ...; instance_claim) and, unless DATABASE_URL is set, a second one
its own SQLite database in it; each binds its servers' and web ports without a window
between a check and the bind.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import logging
import os
import secrets
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .processes import BASE_DIR, Supervisor, beat_argv, manage_argv, worker_argv
from .servers import EmbeddedServer, free_port, mqtt_broker_start, redis_start

# Where the stacks of this checkout keep their files: the first in var/devstack, one started
# while it runs in var/devstack-2, and so on.
STATE_ROOT = BASE_DIR / "var"
STATE_NAME = "devstack"
# The file in a state directory whose exclusive lock marks the directory taken.
INSTANCE_LOCK = "instance.lock"
# Stacks one checkout runs at once: a few on purpose; more means something is wrong.
INSTANCES_MAX = 9
# The web server's usual port; a free one is taken when something else listens there.
WEB_PORT = 8000
# Ports the web server tries in turn, each found taken when it bound (two stacks starting
# at once race for free ports too, rarely twice in a row).
WEB_PORT_ATTEMPTS = 5
# How long children get to report ready; cold Python imports on a busy laptop are slow.
READY_TIMEOUT_SECONDS = 60.0
# The demo's superuser (devtools/demo.py demo_seed): development only, refused without DEBUG.
ADMIN_LOGIN = ("admin", "admin")
# What another shell needs to reach the same servers and database (the CLI, `manage.py ...`).
CLI_VARIABLES = ("REDIS_URL", "MQTT_URL", "IOTQUEUE_MQTT_AUTH", "DATABASE_URL", "DEBUG")
RULE = "-" * 78
# What runserver says when its port is taken (it exits with status 1 then).
PORT_TAKEN = "That port is already in use"


def access_block(*, web_url: str, api_token: str, metrics_token: str, environment: Mapping[str, str]) -> str:
    """The few lines a newcomer needs to use the running stack: where the admin, the API and
    the metrics are with their credentials, and the `export` line for another shell.

    `environment`: this process's environment; CLI_VARIABLES that are set in it are exported,
    with `API`, `TOKEN` and IOTQUEUE_METRICS_TOKEN for curl. Values are shell-quoted.
    """
    exported = {name: environment[name] for name in CLI_VARIABLES if environment.get(name)}
    exported |= {"API": f"{web_url}/api", "TOKEN": api_token, "IOTQUEUE_METRICS_TOKEN": metrics_token}
    export = " ".join(f"{name}={shlex.quote(value)}" for name, value in exported.items())
    user, password = ADMIN_LOGIN
    return "\n".join(
        [
            RULE,
            f"  admin    {web_url}/admin/    login {user} / {password}",
            f"  API      {web_url}/api/      header  Authorization: Token {api_token}",
            f"  metrics  {web_url}/metrics   header  Authorization: Bearer {metrics_token}",
            "  In another shell, for the CLI (manage.py) and curl against this stack:",
            f"  export {export}",
            '  e.g. .venv/bin/python manage.py runs   or   curl -H "Authorization: Token $TOKEN" $API/runs/',
            _certificate_devices_line(environment),
            RULE,
        ]
    )


def _certificate_devices_line(environment: Mapping[str, str]) -> str:
    """Where certificate devices connect (the mTLS listener) and the CA file they trust."""
    if environment.get("MQTT_TLS_URL"):
        return (
            f"  devices  MQTT_TLS_URL={environment['MQTT_TLS_URL']}  "
            f"CA {environment.get('IOTQUEUE_DEVICE_CA_CERT', '')}  "
            "(certificate: POST $API/devices/<name>/certificate/)"
        )
    return "  devices  no mTLS listener: certificate devices need Mosquitto with dynamic security"


def _webhook_receiver_start() -> str:
    """A local receiver for the demo webhook: answers 204 to every POST; returns its URL."""

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:  # the admin's delivery log shows them
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/webhook"


class InstancesTaken(RuntimeError):
    """Every state directory is held by a running stack."""


@dataclass(frozen=True)
class Instance:
    """The state directory this stack claimed, and the open file whose lock claims it."""

    number: int
    directory: Path
    lock_fd: int


def instance_claim(root: Path = STATE_ROOT) -> Instance:
    """Claim the first state directory no running stack holds: root/devstack, else
    root/devstack-2, -3, ... up to INSTANCES_MAX.

    The claim is an exclusive flock on the directory's INSTANCE_LOCK, taken without waiting:
    two stacks starting at the same moment cannot both get it (the lock is the check, no
    window between looking and taking), and the kernel drops it when the process ends, even
    killed, so a crashed stack's directory is free again (and its leftover servers are
    stopped by the next stack there, servers.py). The descriptor is not inherited by
    children. How it fails: InstancesTaken when every directory is held.
    """
    for number in range(1, INSTANCES_MAX + 1):
        directory = root / (STATE_NAME if number == 1 else f"{STATE_NAME}-{number}")
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / INSTANCE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return Instance(number, directory, fd)
    taken = f"{_shown(root)}/{STATE_NAME}*"
    raise InstancesTaken(f"{INSTANCES_MAX} dev stacks already run from this checkout (they hold {taken})")


def instance_release(instance: Instance) -> None:
    """Give the state directory up (closing the descriptor drops the lock)."""
    os.close(instance.lock_fd)


def _database_choose(instance: Instance) -> str:
    """Where this stack's database is, for its start-up output. The first stack uses the
    settings' default (var/db.sqlite3, iotqueue/settings.py) when DATABASE_URL is unset; another gets its own
    SQLite file in its state directory, set as DATABASE_URL for this process and every child
    (and the `export` line), so two stacks never migrate and seed one file at once."""
    if os.environ.get("DATABASE_URL"):
        return "DATABASE_URL"
    if instance.number == 1:
        return _shown(STATE_ROOT / "db.sqlite3")
    database = instance.directory / "db.sqlite3"
    os.environ["DATABASE_URL"] = f"sqlite:///{database}"
    return _shown(database)


def _services_start(servers: list[EmbeddedServer], state_dir: Path) -> dict[str, str]:
    env = {}
    if not os.environ.get("REDIS_URL"):
        servers.append(redis_start(state_dir))
        env["REDIS_URL"] = servers[-1].url
    if not os.environ.get("MQTT_URL"):
        servers.append(mqtt_broker_start(state_dir))
        env |= servers[-1].settings_environment()
        if servers[-1].tls_url:
            env["MQTT_TLS_URL"] = servers[-1].tls_url
    started = [f"{server.kind} on port {server.port}" for server in servers]
    print(f"  started {', '.join(started) or 'no server: REDIS_URL and MQTT_URL are set'}")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devstack", description=__doc__.splitlines()[0])
    parser.add_argument("--exit-when-done", action="store_true", default=bool(os.environ.get("CI")))
    parser.add_argument("--runs", type=int, default=2, help="demo runs per template")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    try:
        instance = instance_claim()
    except InstancesTaken as exc:
        print(f"devstack: {exc}", file=sys.stderr)
        return 1
    state_dir = instance.directory
    servers: list[EmbeddedServer] = []
    print("iotqueue dev stack")
    try:
        database = _database_choose(instance)
        print(f"  files in {_shown(state_dir)}, database {database}")
        os.environ.update(_services_start(servers, state_dir))
        _environment_prepare()
        import django
        from django.core.management import CommandError, call_command

        django.setup()
        from iotqueue.startup import StartupError, startup_check

        from .demo import demo_seed

        try:
            # The database is migrated just below; Redis and the broker (and its plugin) first,
            # so a wrong MQTT_URL or REDIS_URL fails in one line, not after a timeout.
            startup_check(("redis", "mqtt"))
        except StartupError as exc:
            print(f"devstack: {exc}", file=sys.stderr)
            return 1

        # The progress display says what happens; the timeline's log lines would drown it.
        logging.getLogger("jobs.timeline").setLevel(logging.WARNING)
        call_command("migrate", verbosity=0)
        call_command("monitors_install", stdout=io.StringIO())
        token = demo_seed()
        # Every run event of the demo is delivered to a receiver in this process.
        call_command("webhook_demo", url=_webhook_receiver_start(), stdout=io.StringIO())
        print("  database migrated, demo devices and templates ready")
        with Supervisor(state_dir / "logs", dict(os.environ)) as supervisor:
            web_port = _children_start(supervisor, state_dir)
            block = access_block(
                web_url=f"http://127.0.0.1:{web_port}",
                api_token=token,
                metrics_token=os.environ["IOTQUEUE_METRICS_TOKEN"],
                environment=os.environ,
            )
            print(block)
            try:
                call_command("demo", runs=args.runs, follow=True, stdout=sys.stdout)
                demo_ok = True
            except CommandError as exc:
                print(f"demo: {exc}")
                demo_ok = False
            except Exception as exc:
                # The demo is a client of the stack: whatever stops it (a database restarting
                # before it follows its runs) leaves the stack itself running.
                print(f"demo: stopped by {type(exc).__name__}: {exc}".splitlines()[0])
                demo_ok = False
            print(block)
            if args.exit_when_done or stop.is_set():
                return 0 if demo_ok else 1
            print("Stack is running; Ctrl-C stops it.")
            while not stop.wait(1.0):
                dead = [c.name for c in supervisor.children.values() if not c.alive() and not c.restart]
                if dead:
                    print(f"{', '.join(dead)} exited; see {supervisor.log_dir}. Stopping.")
                    return 1
        return 0
    finally:
        for server in reversed(servers):
            server.stop()
        instance_release(instance)
        print("dev stack stopped")


def _shown(path: Path) -> str:
    """A path as the start-up output names it: relative to the checkout when inside it."""
    return str(path.relative_to(BASE_DIR)) if path.is_relative_to(BASE_DIR) else str(path)


def _environment_prepare() -> None:
    """The environment of this process and every child, set before Django reads its settings."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "iotqueue.settings")
    # Development mode: the development SECRET_KEY and hosts, runserver's static files, and
    # the demo's admin/admin superuser.
    os.environ["DEBUG"] = "true"
    # /metrics answers a bearer token (iotqueue/views.py): a new one each start, unless given.
    os.environ.setdefault("IOTQUEUE_METRICS_TOKEN", secrets.token_urlsafe(24))
    # The demo's step task (a template step of kind `task`): the worker runs it, the web
    # process checks templates against it.
    os.environ["CELERY_IMPORTS"] = "devtools.demo_tasks"
    # The demo's webhook receiver listens on 127.0.0.1, which webhooks refuse unless it is
    # listed (docs/operations.md, Securing a deployment): listed here, for the demo only.
    os.environ.setdefault("IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS", "127.0.0.1/32")


def _web_start(supervisor: Supervisor) -> int:
    """Start the web server on WEB_PORT, or on a free port when that one is taken; its port.

    runserver binds, then logs "Starting development server at <url>"; when another process
    holds the port (another stack starting at the same moment) it exits with "That port is
    already in use", and the next free port is tried. There is no window between a check
    and the bind: the bind itself is the check.
    """
    port = WEB_PORT
    for _ in range(WEB_PORT_ATTEMPTS):
        since = supervisor.log_size("web")
        argv = manage_argv("runserver", f"127.0.0.1:{port}", "--noreload")
        supervisor.start("web", argv, restart=True)
        bound = rf"Starting development server at http://127\.0\.0\.1:{port}/"
        try:
            supervisor.wait_for_log(
                "web", rf"{bound}|{PORT_TAKEN}", timeout=READY_TIMEOUT_SECONDS, since=since
            )
        except RuntimeError:  # it exited: for a taken port, it said so first
            pass
        if PORT_TAKEN not in supervisor.children["web"].log_text()[since:]:
            return port
        supervisor.stop("web")
        port = free_port()
    raise RuntimeError(f"web: no free port after {WEB_PORT_ATTEMPTS} attempts")


def _children_start(supervisor: Supervisor, state_dir: Path) -> int:
    """Start every child and wait until each is ready; returns the web server's port."""
    # Logs are appended across runs: readiness is what this run's children write.
    names = ("worker", "worker-io", "beat", "bridge", "web", "simulator", "devices")
    offsets = {name: supervisor.log_size(name) for name in names}
    supervisor.start("worker", worker_argv(concurrency=2), restart=True)
    # Webhook deliveries and mail on their own queue and worker (docs/operations.md#queues).
    io_queue = os.environ.get("IOTQUEUE_IO_QUEUE", "iotqueue-io")
    io_argv = [*worker_argv(concurrency=1, hostname="io"), f"--queues={io_queue}"]
    supervisor.start("worker-io", io_argv, restart=True)
    supervisor.start("beat", beat_argv(state_dir), restart=True)
    supervisor.start("bridge", manage_argv("bridge"), restart=True)
    web_port = _web_start(supervisor)
    supervisor.start(
        "simulator",
        manage_argv(
            "simulate",
            "--from-db",
            "--own-credentials",
            "--latency-ms",
            "200,700",
            "--stats-file",
            str(state_dir / "sim.json"),
        ),
    )
    # The demo's devices, on the device agent library (devtools/demo_devices.py). Their state
    # files start empty: a new stack's Redis hands out fencing tokens from 1 again, and an
    # earlier stack's saved tokens would make every new command look stale to them.
    shutil.rmtree(state_dir / "devices", ignore_errors=True)
    supervisor.start("devices", manage_argv("demo_devices", "--state-dir", str(state_dir / "devices")))
    ready = {
        "worker": r"@\S+ ready\.",
        "worker-io": r"@\S+ ready\.",
        "bridge": r"bridge: connected",
        "simulator": r"simulate: \d+ devices online",
        "devices": r"demo devices: \d+ online",
    }
    for name, pattern in ready.items():
        supervisor.wait_for_log(name, pattern, timeout=READY_TIMEOUT_SECONDS, since=offsets[name])
    print(f"  {', '.join(names)} up (logs in {supervisor.log_dir})")
    return web_port


if __name__ == "__main__":
    sys.exit(main())
