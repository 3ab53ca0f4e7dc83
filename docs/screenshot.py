"""Regenerate docs/img/run-detail.png: a real headless browser on the admin's run page.

Optional tool, not part of `make test` or CI, and nothing in the project imports it. It needs
Chromium and Playwright's Python package (whose own browser download is not used):

    apt-get install chromium                   # or set CHROMIUM=/path/to/chrome
    .venv/bin/pip install playwright==1.65.2
    .venv/bin/python docs/screenshot.py        # --out PATH, --width PIXELS

It starts a throwaway stack in a temporary directory (embedded Redis and MQTT broker, a new
SQLite database, worker, beat, bridge, runserver, simulated devices in this process), runs
the database-provisioning example with rollback (docs/orchestration.md) with a fan-out step
added, lets a device send a malformed reply during the run and a late duplicate after it,
logs in as a throwaway superuser and screenshots the finished run's page. Everything it
started is stopped and the directory removed; nothing else is touched.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# How long the run may take: two attempts of the failing step with backoff, two compensations.
RUN_TIMEOUT_SECONDS = 90.0
READY_TIMEOUT_SECONDS = 60.0
# The throwaway superuser's password lives as long as the throwaway database.
PASSWORD = secrets.token_urlsafe(16)

DEVICES = {
    "res-agent": {},
    "db-agent": {"role": "db"},
    "mon-1": {"role": "monitor"},
    "mon-2": {"role": "monitor"},
    "mon-3": {"role": "monitor"},
}
STEPS = [
    {
        "name": "check",
        "device": "res-agent",
        "action": "resource/check",
        "args": {"cpu": 4, "mem_gb": 16, "disk_gb": 200},
        "compensation_action": "monitor/report_event",
        "compensation_args": {"event": "provision_failed", "instance": "{{ params.instance }}"},
    },
    {
        "name": "register",
        "labels": {"role": "monitor"},
        "action": "monitor/register",
        "args": {"instance": "{{ params.instance }}"},
        "on_failure": "continue",
    },
    {
        "name": "init",
        "device": "db-agent",
        "action": "mysql/init_instance",
        "args": {"instance": "{{ params.instance }}", "cpu": "{{ steps.check.result.echo.cpu }}"},
        "max_attempts": 2,
        "backoff_seconds": 0.5,
        "on_failure": "rollback",
        "compensation_action": "mysql/clean_instance",
        "compensation_args": {"instance": "{{ params.instance }}"},
    },
    {"name": "deduct", "device": "res-agent", "action": "resource/deduct", "args": {"cpu": 4}},
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(BASE_DIR / "docs" / "img" / "run-detail.png"))
    parser.add_argument("--width", type=int, default=1400, help="browser window width in pixels")
    args = parser.parse_args(argv)
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        parser.error("no chromium on PATH; apt-get install chromium, or set CHROMIUM=/path")
    sys.path.insert(0, str(BASE_DIR))
    workdir = Path(tempfile.mkdtemp(prefix="iotqueue-screenshot-"))
    servers = []
    try:
        servers = services_start(workdir)
        with stack_with_finished_run(workdir) as url:
            shoot(chromium=chromium, url=url, out=Path(args.out), width=args.width)
        print(f"saved {args.out}")
        return 0
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def services_start(workdir: Path) -> list:
    """Redis, an MQTT broker and a new database, all in `workdir`; Django set up on them."""
    from devtools.servers import mqtt_broker_start, redis_start

    servers = [redis_start(workdir), mqtt_broker_start(workdir)]
    os.environ.update(
        DJANGO_SETTINGS_MODULE="iotqueue.settings",
        # The dev stack's development mode: its SECRET_KEY, hosts and static files.
        DEBUG="true",
        DATABASE_URL=f"sqlite:///{workdir / 'db.sqlite3'}",
        REDIS_URL=servers[0].url,
        MQTT_URL=servers[1].url,
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("monitors_install", stdout=io.StringIO())
    return servers


@contextmanager
def stack_with_finished_run(workdir: Path) -> Iterator[str]:
    """Run the scenario on a real stack; yield the finished run's admin URL while it serves."""
    from devtools.processes import Supervisor, beat_argv, manage_argv, worker_argv
    from devtools.servers import free_port
    from devtools.simulator import DeviceBehaviour, Simulator

    template = scenario_seed()
    port = free_port()
    behaviours = {name: DeviceBehaviour(latency_min_ms=150, latency_max_ms=600) for name in DEVICES}
    behaviours["db-agent"] = DeviceBehaviour(
        latency_min_ms=300, latency_max_ms=700, failing_actions=frozenset({"mysql/init_instance"})
    )
    with Supervisor(workdir / "logs", dict(os.environ)) as supervisor:
        supervisor.start("worker", worker_argv(concurrency=2))
        supervisor.start("beat", beat_argv(workdir))
        supervisor.start("bridge", manage_argv("bridge"))
        supervisor.start("web", manage_argv("runserver", f"127.0.0.1:{port}", "--noreload"))
        ready = {
            "worker": r"@\S+ ready\.",
            "bridge": r"bridge: connected",
            "beat": r"beat: Starting",
            "web": r"Starting development server",
        }
        for name, pattern in ready.items():
            supervisor.wait_for_log(name, pattern, timeout=READY_TIMEOUT_SECONDS)
        simulator = Simulator(behaviours)
        simulator.start()
        try:
            run = scenario_run(template)
        finally:
            simulator.stop()
        yield f"http://127.0.0.1:{port}/admin/jobs/jobrun/{run.pk}/change/"


def scenario_seed():
    """The devices, the provisioning template, and the superuser the browser logs in as."""
    from django.contrib.auth import get_user_model

    from devices.models import Device
    from jobs.models import JobStep, JobTemplate

    for name, labels in DEVICES.items():
        Device.objects.create(name=name, labels=labels, description="screenshot agent")
    template = JobTemplate.objects.create(
        name="Provision MySQL instance", description="Provisioning with rollback, plus a fan-out registration"
    )
    for position, spec in enumerate(STEPS):
        spec = dict(spec)
        device = spec.pop("device", None)
        JobStep.objects.create(
            template=template,
            position=position,
            device=Device.objects.get(name=device) if device else None,
            timeout_seconds=30,
            **spec,
        )
    get_user_model().objects.create_superuser("screenshot", "screenshot@example.com", PASSWORD)
    return template


def scenario_run(template):
    """Start the run, send a malformed reply while it runs and a late duplicate after it."""
    from devices import protocol
    from devices.models import Device
    from iotqueue.mqtt import publisher
    from jobs.models import JobRun, RunEvent, Trigger
    from jobs.services import run_start

    wait_until(lambda: Device.objects.filter(online=True).count() == len(DEVICES), "devices online")
    run, _ = run_start(
        template=template, parameters={"instance": "mysql-42"}, trigger=Trigger.ADMIN, triggered_by="ops"
    )
    publisher.publish(protocol.device_topic("db-agent", "done"), b"{not json")
    wait_until(lambda: JobRun.objects.get(pk=run.pk).is_terminal, "the run to finish")
    first = run.step_runs.get(index=0, phase="forward")
    late = {"id": first.command_id, "ok": True, "result": first.result}
    publisher.publish(protocol.device_topic("res-agent", "done"), json.dumps(late).encode())
    wait_until(lambda: RunEvent.objects.filter(run=run, kind="reply.stale").exists(), "the stale reply")
    publisher.close()
    return run


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def shoot(*, chromium: str, url: str, out: Path, width: int) -> None:
    """Log in to the admin and save a full-page screenshot of `url`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(url)  # the admin sends the browser to its login page first
        page.fill("#id_username", "screenshot")
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_selector("#run-timeline")
        page.click("#toggle-nav-sidebar")  # the app list would take a fifth of the width
        # A window as tall as the page, so the sidebar's strip reaches the bottom too.
        page.set_viewport_size({"width": width, "height": page.evaluate("document.body.scrollHeight")})
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
