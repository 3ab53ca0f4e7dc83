"""Regenerate docs/img/: the admin's dashboard and a run's page, in English and in Chinese.

`make screenshots` runs it, after installing Debian's chromium and chromium-driver when they
are missing; by hand: `.venv/bin/python docs/screenshot.py [--out-dir DIR] [--width PIXELS]`.
The browser is the browser tier's own (devtools/browser.py: Selenium on headless Chromium).
Nothing in the project imports this file.

It starts a throwaway stack in a temporary directory (embedded Redis and MQTT broker, a new
SQLite database, worker, beat, bridge, runserver, simulated devices in this process) and sets
the scene an operator meets on a working day:
  - a fleet at two sites, played by the simulator, except two devices that never connect
    (offline) and one that is disabled;
  - a week of finished runs of the site routines, written straight into the database with
    backdated times so that the runs-by-status chart has a history (the only rows not made
    by the engine);
  - a firmware rollout to twelve bulbs whose rate ramps up, still going when the dashboard
    is taken, a run blocked by an offline device (stuck after IOTQUEUE_STUCK_AFTER_SECONDS,
    10 s here) and a run that fails;
  - the database-provisioning example with rollback and a fan-out step (docs/orchestration.md),
    with a malformed reply during the run and a late duplicate after it: the run page shown.
It logs in as a throwaway superuser, saves dashboard.png and run-page.png, then the same with a
browser asking for Chinese (dashboard-zh.png, run-page-zh.png). Everything it started is
stopped and the directory removed; nothing else is touched.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# How long the provisioning run may take: two attempts of the failing step with backoff, two
# compensations; and the other waits (devices online, a run stuck), with room for a slow machine.
RUN_TIMEOUT_SECONDS = 120.0
READY_TIMEOUT_SECONDS = 60.0
# A run counts as stuck on the dashboard after this long (production default: 5 minutes).
# Longer than a bulb of the rollout works on its update, so that only the blocked run is stuck.
STUCK_AFTER_SECONDS = 10
# The throwaway superuser's password lives as long as the throwaway database.
PASSWORD = secrets.token_urlsafe(16)
USERNAME = "operator"

# name: (labels, simulated?)
FLEET = {
    "res-agent": ({"site": "berlin", "role": "resources"}, True),
    "db-agent": ({"site": "berlin", "role": "db"}, True),
    "mon-1": ({"site": "berlin", "role": "monitor"}, True),
    "mon-2": ({"site": "shanghai", "role": "monitor"}, True),
    "mon-3": ({"site": "shanghai", "role": "monitor"}, True),
    "gate-1": ({"site": "berlin", "kind": "gate"}, True),
    "lamp-2": ({"site": "berlin", "kind": "lamp"}, True),
    "door-7": ({"site": "shanghai", "kind": "gate"}, False),
    "cam-3": ({"site": "shanghai", "kind": "camera"}, False),
    **{f"bulb-{n:02d}": ({"site": "shanghai", "kind": "bulb"}, True) for n in range(1, 13)},
}
DISABLED = "vac-4"
PROVISIONING_STEPS = [
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
# Slow enough to be under way when the dashboard is taken: 12 bulbs a minute, doubling after
# every 4 that succeeded.
ROLLOUT_STEP = {
    "name": "flash",
    "selector": "kind=bulb",
    "action": "firmware/update",
    "args": {"version": "2.1"},
    "rollout_per_minute": 12,
    "rollout_increment_factor": 2.0,
    "rollout_increment_every": 4,
    "rollout_max_per_minute": 60,
    "abort_failure_percent": 25,
    "abort_min_devices": 4,
}
ROUTINES = {
    "Morning": [("gate-1", "unlock", {}), ("lamp-2", "on", {"level": 80})],
    "Door opened": [("door-7", "snapshot", {"reason": "badge B-1042"}), ("lamp-2", "on", {"level": 100})],
    "Camera check": [("cam-3", "snapshot", {})],
}
HISTORY_DAYS = 7
# How a routine's run went wrong, as the engine words it (jobs/engine/runs.py): status, error.
HISTORY_FAILURES = {
    "Morning": [
        ("failed", "step 1 (lamp-2 on) failed: relay stuck"),
        ("timed_out", "step 0 (gate-1 unlock) timed_out: no reply within 30 s"),
    ],
    "Door opened": [("timed_out", "step 0 (door-7 snapshot) timed_out: offline past its queue timeout")],
    "Camera check": [("failed", "step 0 (cam-3 snapshot) failed: lens cover closed")],
}
# One run in this many fails, one in twice as many is canceled; the rest succeed.
HISTORY_FAILING_ONE_IN = 9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(BASE_DIR / "docs" / "img"))
    parser.add_argument("--width", type=int, default=1280, help="browser window width in pixels")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(BASE_DIR))
    from devtools.browser import BrowserMissing, browser_missing

    if browser_missing():
        raise BrowserMissing(f"{browser_missing()} missing: python -m devtools.browser install")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="iotqueue-screenshot-"))
    servers = []
    try:
        servers = services_start(workdir)
        with stack_with_scene(workdir) as (base_url, run_path):
            for language, suffix in (("en", ""), ("zh-hans", "-zh")):
                saved = shoot(
                    base_url=base_url,
                    pages={f"dashboard{suffix}.png": "/admin/?label=site", f"run-page{suffix}.png": run_path},
                    out_dir=out_dir,
                    language=language,
                    width=args.width,
                )
                for path in saved:
                    print(f"saved {path}")
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
        IOTQUEUE_STUCK_AFTER_SECONDS=str(STUCK_AFTER_SECONDS),
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("monitors_install", stdout=io.StringIO())
    return servers


@contextmanager
def stack_with_scene(workdir: Path) -> Iterator[tuple[str, str]]:
    """Set the scene on a real stack; yield the web address and the shown run's admin path
    while everything keeps running."""
    from devtools.processes import Supervisor, beat_argv, manage_argv, worker_argv
    from devtools.servers import free_port
    from devtools.simulator import DeviceBehaviour, Simulator

    templates = scene_seed()
    port = free_port()
    behaviours = {
        name: DeviceBehaviour(latency_min_ms=150, latency_max_ms=600)
        for name, (_, simulated) in FLEET.items()
        if simulated
    }
    behaviours["db-agent"] = DeviceBehaviour(
        latency_min_ms=300, latency_max_ms=700, failing_actions=frozenset({"mysql/init_instance"})
    )
    behaviours["lamp-2"] = DeviceBehaviour(latency_min_ms=150, latency_max_ms=600, failure_rate=1.0)
    for n in range(1, 13):
        # About as slow as the rollout's first pace (a bulb every 5 s): one is mostly at work.
        behaviours[f"bulb-{n:02d}"] = DeviceBehaviour(latency_min_ms=4000, latency_max_ms=6000)
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
            run = scene_play(templates)
            yield f"http://127.0.0.1:{port}", f"/admin/jobs/jobrun/{run.pk}/change/"
        finally:
            simulator.stop()


def scene_seed() -> dict:
    """The fleet, the templates, a week of history and the superuser; the templates by name."""
    from django.contrib.auth import get_user_model

    from devices.models import Device
    from jobs.models import JobStep, JobTemplate
    from jobs.services import template_version_record

    for name, (labels, _) in FLEET.items():
        Device.objects.create(name=name, labels=labels, description=f"{labels['site']} agent")
    Device.objects.create(name=DISABLED, labels={"site": "berlin", "kind": "robot"}, enabled=False)
    templates = {}
    specs = {
        "Provision MySQL instance": PROVISIONING_STEPS,
        "Bulb firmware 2.1": [ROLLOUT_STEP],
        **{
            name: [{"device": device, "action": action, "args": args} for device, action, args in steps]
            for name, steps in ROUTINES.items()
        },
    }
    for name, steps in specs.items():
        template = JobTemplate.objects.create(name=name)
        for position, spec in enumerate(steps):
            spec = dict(spec)
            device = spec.pop("device", None)
            JobStep.objects.create(
                template=template,
                position=position,
                device=Device.objects.get(name=device) if device else None,
                timeout_seconds=30,
                **spec,
            )
        template_version_record(template=template)
        templates[name] = template
    history_seed([templates[name] for name in ROUTINES])
    get_user_model().objects.create_superuser(USERNAME, "operator@example.com", PASSWORD)
    return templates


def history_seed(templates: list) -> None:
    """Finished runs over the last week, a few an hour, most of them succeeded."""
    from django.utils import timezone

    from jobs.models import JobRun, RunStatus, Trigger
    from jobs.services import template_plan

    rng = random.Random(32)
    now = timezone.now()
    plans = {template.pk: template_plan(template) for template in templates}
    for hours_ago in range(HISTORY_DAYS * 24, 0, -1):
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            created = now - timedelta(hours=hours_ago, minutes=rng.randint(0, 59))
            template = rng.choice(templates)
            status, error = RunStatus.SUCCEEDED, ""
            draw = rng.randrange(2 * HISTORY_FAILING_ONE_IN)
            if draw < 2:
                status, error = rng.choice(HISTORY_FAILURES[template.name])
            elif draw == 2:
                status = RunStatus.CANCELED
            run = JobRun.objects.create(
                template=template,
                plan=plans[template.pk],
                status=status,
                trigger=Trigger.SCHEDULE,
                triggered_by="history",
                error=error,
            )
            # created_at is set on insert; the history is moved back in time afterwards.
            finished = created + timedelta(seconds=rng.randint(2, 40))
            moved = {"created_at": created, "started_at": created, "finished_at": finished}
            JobRun.objects.filter(pk=run.pk).update(**moved)


def scene_play(templates: dict):
    """Start the rollout, the stuck and the failing run, then the provisioning run with its
    malformed and late replies; return the provisioning run once it is over."""
    from devices import protocol
    from devices.models import Device
    from iotqueue.mqtt import publisher
    from jobs.models import JobRun, RunEvent, Trigger
    from jobs.services import run_start

    simulated = sum(1 for _, simulated in FLEET.values() if simulated)
    wait_until(lambda: Device.objects.filter(online=True).count() == simulated, "devices online")
    run_start(template=templates["Bulb firmware 2.1"], trigger=Trigger.ADMIN, triggered_by=USERNAME)
    stuck, _ = run_start(template=templates["Door opened"], trigger=Trigger.MQTT, triggered_by="door sensor")
    run_start(template=templates["Morning"], trigger=Trigger.SCHEDULE, triggered_by="Morning at 07:00")
    run, _ = run_start(
        template=templates["Provision MySQL instance"],
        parameters={"instance": "mysql-42"},
        trigger=Trigger.ADMIN,
        triggered_by=USERNAME,
    )
    publisher.publish(protocol.device_topic("db-agent", "done"), b"{not json")
    wait_until(lambda: JobRun.objects.get(pk=run.pk).is_terminal, "the provisioning run to finish")
    first = run.step_runs.get(index=0, phase="forward")
    late = {"id": first.command_id, "ok": True, "result": first.result}
    publisher.publish(protocol.device_topic("res-agent", "done"), json.dumps(late).encode())
    wait_until(lambda: RunEvent.objects.filter(run=run, kind="reply.stale").exists(), "the stale reply")
    publisher.close()
    # The door's run has waited on its offline camera past the threshold by now; make sure.
    started = JobRun.objects.get(pk=stuck.pk).created_at
    wait_until(lambda: time.time() - started.timestamp() > STUCK_AFTER_SECONDS + 1, "the door run stuck")
    return run


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def shoot(*, base_url: str, pages: dict[str, str], out_dir: Path, language: str, width: int) -> list[Path]:
    """Log in to the admin in a browser asking for `language`; save each page whole."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from devtools.browser import WINDOW_HEIGHT, browser_start, viewport_resize

    driver = browser_start(language=language, width=width)
    saved = []
    try:
        driver.get(f"{base_url}/admin/login/?next=/admin/")
        driver.find_element(By.ID, "id_username").send_keys(USERNAME)
        driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
        driver.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()
        WebDriverWait(driver, READY_TIMEOUT_SECONDS).until(lambda d: "/login/" not in d.current_url)
        # The admin's app list, closed as its own toggle leaves it: it would take a fifth of the width.
        driver.execute_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
        for name, path in pages.items():
            viewport_resize(driver, width=width, height=WINDOW_HEIGHT)
            driver.get(base_url + path)
            driver.find_element(By.ID, "content")
            # A window as tall as the page, so the screenshot holds all of it; on the index,
            # down to the dashboard's end (the app list under it is stock Django).
            height = driver.execute_script(
                "const dash = document.getElementById('dash');"
                "return dash ? Math.ceil(dash.getBoundingClientRect().bottom + window.scrollY) + 16"
                " : document.documentElement.scrollHeight;"
            )
            viewport_resize(driver, width=width, height=height)
            out = out_dir / name
            driver.save_screenshot(str(out))
            saved.append(out)
    finally:
        driver.quit()
    return saved


if __name__ == "__main__":
    sys.exit(main())
