"""`manage.py demo`: seed the demo devices and templates, start runs, follow them."""

import time

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError, close_old_connections
from django.db.models import Q
from django.utils import timezone

from devtools.demo import (
    BULBS_TEMPLATE,
    DOOR_RULE,
    demo_canvas,
    demo_door_open,
    demo_outcome_line,
    demo_ramp_line,
    demo_runs_line,
    demo_seed,
    demo_trigger,
    demo_versions_line,
    run_progress_line,
)
from jobs.models import JobRun, RunStatus, Trigger

# How often the progress display re-reads the runs.
POLL_SECONDS = 0.25
# The bridge starts the door sensor's run within a moment; this only bounds a broken stack.
MQTT_RUN_WAIT_SECONDS = 20.0


class Command(BaseCommand):
    help = "Seed demo devices/templates, trigger runs and show their progress."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--seed-only", action="store_true", help="create demo data, start nothing")
        parser.add_argument("--runs", type=int, default=2, help="runs per template")
        parser.add_argument("--follow", action="store_true", help="show progress until the runs finish")
        parser.add_argument("--timeout", type=float, default=120.0, help="give up following after this")

    _database_away = False

    def handle(self, *args, **options):
        try:
            token = demo_seed()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if options["seed_only"]:
            self.stdout.write(f"demo data ready; API token for admin: {token}")
            return
        self.stdout.write(demo_versions_line())
        runs = demo_trigger(runs_per_template=options["runs"])
        self.stdout.write(f"started {demo_runs_line(runs)} (Morning and Cleaning both need lamp-2)")
        if not options["follow"]:
            return
        door = self._door_open()
        canvas = demo_canvas()
        # A run per link, each starting when the link before it ends: the second comes later.
        links = [f"canvas:{canvas.parent.id}", f"canvas:{canvas.id}"]
        self._wait_run(JobRun.objects.filter(idempotency_key=links[0]), "the Celery chain")
        self.stdout.write("Celery chain sent: cam-3 snapshot, then lamp-2 on (jobs/canvas.py): 2 runs")
        followed = Q(pk__in=[run.pk for run in [*runs, door]]) | Q(idempotency_key__in=links)
        expected = len(runs) + 1 + len(links)
        self.stdout.write(f"following {expected} demo runs; each is shown when it ends")
        runs = self._follow(followed, expected, options["timeout"], every_change=options["verbosity"] > 1)
        bulbs = next(run for run in runs if run.template.name == BULBS_TEMPLATE)
        self.stdout.write(demo_ramp_line(bulbs))
        try:
            result = canvas.get(timeout=MQTT_RUN_WAIT_SECONDS)
        except Exception as exc:
            raise CommandError(f"the Celery chain failed: {exc}") from exc
        self.stdout.write(self.style.SUCCESS(f"Celery chain returned lamp-2's result: {result}"))

    def _door_open(self) -> JobRun:
        """Play the door sensor and return the run its trigger rule started."""
        since = timezone.now()
        topic = demo_door_open()
        runs = JobRun.objects.filter(
            trigger=Trigger.MQTT, triggered_by__startswith=f"mqtt {DOOR_RULE} ", created_at__gte=since
        )
        run = self._wait_run(runs, "the door sensor's message")
        self.stdout.write(f"door sensor published on {topic}: 1 run (a malformed message beside it: dropped)")
        return run

    def _wait_run(self, runs, what: str) -> JobRun:
        deadline = time.monotonic() + MQTT_RUN_WAIT_SECONDS
        while time.monotonic() < deadline:
            run = self._read(runs.first)
            if run is not None:
                return run
            time.sleep(POLL_SECONDS)
        raise CommandError(f"{what} started no run within {MQTT_RUN_WAIT_SECONDS:.0f}s")

    def _follow(self, followed: Q, expected: int, timeout: float, *, every_change: bool) -> list[JobRun]:
        """Show each run once when it ends (every change of its steps with `every_change`),
        until `expected` runs match `followed` and all have ended; returns them."""
        shown: dict = {}
        deadline = time.monotonic() + timeout
        while True:
            runs = self._read(
                lambda: list(
                    JobRun.objects.filter(followed)
                    .select_related("template", "template_version")
                    .prefetch_related("step_runs")
                    .order_by("created_at")
                )
            )
            if runs is None:  # the database is away (restarting): follow on once it is back
                runs = []
            for run in runs:
                line = run_progress_line(run)
                if (every_change or run.is_terminal) and shown.get(run.pk) != line:
                    shown[run.pk] = line
                    self.stdout.write(f"{time.strftime('%H:%M:%S')}  {line}")
            if len(runs) >= expected and all(run.is_terminal for run in runs):
                break
            if time.monotonic() > deadline:
                raise CommandError(f"demo runs still not finished after {timeout:.0f}s")
            time.sleep(POLL_SECONDS)
        summary = demo_outcome_line(runs)
        if any(run.status != RunStatus.SUCCEEDED for run in runs):
            raise CommandError(f"{summary}: some did not succeed")
        self.stdout.write(self.style.SUCCESS(summary))
        return runs

    def _read(self, read):
        """`read()`, or None while the database is unreachable (said once per outage): the
        stack's processes ride out a database restart, and so does the progress display."""
        try:
            value = read()
        except (OperationalError, InterfaceError) as exc:
            close_old_connections()
            if not self._database_away:
                self._database_away = True
                reason = (str(exc).strip() or type(exc).__name__).splitlines()[0]
                now = time.strftime("%H:%M:%S")
                self.stdout.write(f"{now}  database unreachable ({reason}); still following")
            return None
        if self._database_away:
            self._database_away = False
            self.stdout.write(f"{time.strftime('%H:%M:%S')}  database back")
        return value
