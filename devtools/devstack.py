"""The dev stack: `python -m devtools.devstack` (what `make run` calls) runs everything locally.

It starts a real Redis and a real MQTT broker on free ports (unless REDIS_URL / MQTT_URL
are set), migrates, starts a Celery worker, beat, the bridge, the web server and the device
simulator, then runs the `demo` command (seed devices and templates, trigger runs, show
progress). Ctrl-C or SIGTERM stops every child it started. With --exit-when-done (implied
when CI is set) it stops once the demo runs have finished.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .processes import BASE_DIR, Supervisor, beat_argv, manage_argv, worker_argv
from .servers import EmbeddedServer, free_port, mqtt_broker_start, redis_start

STATE_DIR = BASE_DIR / "var" / "devstack"
# The web server's usual port; a free one is taken when something else listens there.
WEB_PORT = 8000
# How long children get to report ready; cold Python imports on a busy laptop are slow.
READY_TIMEOUT_SECONDS = 60.0


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


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


def _services_start(servers: list[EmbeddedServer]) -> dict[str, str]:
    env = {}
    if not os.environ.get("REDIS_URL"):
        servers.append(redis_start(STATE_DIR))
        env["REDIS_URL"] = servers[-1].url
        print(f"  redis   {servers[-1].url}  ({servers[-1].kind})")
    if not os.environ.get("MQTT_URL"):
        servers.append(mqtt_broker_start(STATE_DIR))
        env["MQTT_URL"] = servers[-1].url
        env["IOTQUEUE_MQTT_AUTH"] = servers[-1].auth
        print(f"  mqtt    {servers[-1].url}  ({servers[-1].kind})")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devstack", description=__doc__.splitlines()[0])
    parser.add_argument("--exit-when-done", action="store_true", default=bool(os.environ.get("CI")))
    parser.add_argument("--runs", type=int, default=2, help="demo runs per template")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    servers: list[EmbeddedServer] = []
    print("iotqueue dev stack")
    try:
        os.environ.update(_services_start(servers))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "iotqueue.settings")
        # Development mode for this process and every child: the development SECRET_KEY and
        # hosts, runserver's static files, and the demo's admin/admin superuser.
        os.environ["DEBUG"] = "true"
        # The demo's step task (a template step of kind `task`): the worker runs it, the web
        # process checks templates against it.
        os.environ["CELERY_IMPORTS"] = "devtools.demo_tasks"
        # The demo's webhook receiver listens on 127.0.0.1, which webhooks refuse unless it is
        # listed (docs/operations.md, Securing a deployment): listed here, for the demo only.
        os.environ.setdefault("IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS", "127.0.0.1/32")
        import django
        from django.core.management import CommandError, call_command

        django.setup()
        # The progress display says what happens; the timeline's log lines would drown it.
        logging.getLogger("jobs.timeline").setLevel(logging.WARNING)
        call_command("migrate", verbosity=0)
        call_command("monitors_install", stdout=io.StringIO())
        call_command("demo", seed_only=True, stdout=sys.stdout)
        # Every run event of the demo is delivered to a receiver in this process.
        call_command("webhook_demo", url=_webhook_receiver_start(), stdout=io.StringIO())
        web_port = WEB_PORT if _port_free(WEB_PORT) else free_port()
        with Supervisor(STATE_DIR / "logs", dict(os.environ)) as supervisor:
            _children_start(supervisor, web_port)
            print(f"\n  admin   http://127.0.0.1:{web_port}/admin/   (login admin / admin)")
            print(f"  API     http://127.0.0.1:{web_port}/api/runs/")
            print(f"  webhook deliveries  http://127.0.0.1:{web_port}/admin/webhooks/delivery/")
            print(f"  logs    {supervisor.log_dir}")
            # manage.py commands in another shell (run_start --wait, runs, locks) need the
            # same servers; the embedded ones listen on ports chosen at start.
            print(
                f"  CLI     export REDIS_URL={os.environ['REDIS_URL']} MQTT_URL={os.environ['MQTT_URL']}"
                f" IOTQUEUE_MQTT_AUTH={os.environ.get('IOTQUEUE_MQTT_AUTH', 'dynsec')} DEBUG=true\n"
            )
            try:
                call_command("demo", runs=args.runs, follow=True, stdout=sys.stdout)
                demo_ok = True
            except CommandError as exc:
                print(f"demo: {exc}")
                demo_ok = False
            if args.exit_when_done or stop.is_set():
                return 0 if demo_ok else 1
            print("\nStack is running; Ctrl-C stops it.")
            while not stop.wait(1.0):
                dead = [c.name for c in supervisor.children.values() if not c.alive() and not c.restart]
                if dead:
                    print(f"{', '.join(dead)} exited; see {supervisor.log_dir}. Stopping.")
                    return 1
        return 0
    finally:
        for server in reversed(servers):
            server.stop()
        print("dev stack stopped")


def _children_start(supervisor: Supervisor, web_port: int) -> None:
    # Logs are appended across runs: readiness is what this run's children write.
    names = ("worker", "beat", "bridge", "web", "simulator")
    offsets = {name: supervisor.log_size(name) for name in names}
    supervisor.start("worker", worker_argv(concurrency=2), restart=True)
    supervisor.start("beat", beat_argv(STATE_DIR), restart=True)
    supervisor.start("bridge", manage_argv("bridge"), restart=True)
    supervisor.start("web", manage_argv("runserver", f"127.0.0.1:{web_port}", "--noreload"), restart=True)
    supervisor.start(
        "simulator",
        manage_argv(
            "simulate",
            "--from-db",
            "--own-credentials",
            "--latency-ms",
            "200,700",
            "--stats-file",
            str(STATE_DIR / "sim.json"),
        ),
    )
    ready = {
        "worker": r"@\S+ ready\.",
        "bridge": r"bridge: connected",
        "web": r"Quit the server|Starting development server",
        "simulator": r"simulate: \d+ devices online",
    }
    for name, pattern in ready.items():
        supervisor.wait_for_log(name, pattern, timeout=READY_TIMEOUT_SECONDS, since=offsets[name])
        print(f"  {name:<10}up (pid {supervisor.children[name].pid})")


if __name__ == "__main__":
    sys.exit(main())
