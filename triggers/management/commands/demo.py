"""`manage.py demo`: seed the demo devices and templates, start runs, follow them."""

import time

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from jobs.models import JobRun, Trigger
from triggers.demo import DOOR_RULE, demo_door_open, demo_seed, demo_trigger, run_progress_line

# How often the progress display re-reads the runs.
POLL_SECONDS = 0.25
# The bridge starts the door sensor's run within a moment; this only bounds a broken stack.
MQTT_RUN_WAIT_SECONDS = 20.0


class Command(BaseCommand):
    help = "Seed demo devices/templates (SCENARIOS.md #1), trigger runs and show their progress."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--seed-only", action="store_true", help="create demo data, start nothing")
        parser.add_argument("--runs", type=int, default=2, help="runs per template")
        parser.add_argument("--follow", action="store_true", help="show progress until the runs finish")
        parser.add_argument("--timeout", type=float, default=120.0, help="give up following after this")

    def handle(self, *args, **options):
        token = demo_seed()
        if options["seed_only"]:
            self.stdout.write(f"demo data ready; API token for admin: {token}")
            return
        runs = demo_trigger(runs_per_template=options["runs"])
        self.stdout.write(f"started {len(runs)} demo runs (Morning and Cleaning both need lamp-2)")
        if options["follow"]:
            runs.append(self._door_open())
            self._follow([run.pk for run in runs], options["timeout"])

    def _door_open(self) -> JobRun:
        """Play the door sensor (SCENARIOS.md #5) and return the run its trigger rule started."""
        since = timezone.now()
        topic = demo_door_open()
        self.stdout.write(f"door sensor published on {topic} (and one malformed message, dropped)")
        deadline = time.monotonic() + MQTT_RUN_WAIT_SECONDS
        while time.monotonic() < deadline:
            run = JobRun.objects.filter(
                trigger=Trigger.MQTT, triggered_by__startswith=f"mqtt {DOOR_RULE} ", created_at__gte=since
            ).first()
            if run is not None:
                return run
            time.sleep(POLL_SECONDS)
        raise CommandError(f"the door sensor's message started no run within {MQTT_RUN_WAIT_SECONDS:.0f}s")

    def _follow(self, run_ids, timeout: float) -> None:
        shown: dict = {}
        deadline = time.monotonic() + timeout
        while True:
            runs = list(
                JobRun.objects.filter(pk__in=run_ids).select_related("template").prefetch_related("step_runs")
            )
            for run in sorted(runs, key=lambda r: r.created_at):
                line = run_progress_line(run)
                if shown.get(run.pk) != line:
                    shown[run.pk] = line
                    self.stdout.write(f"{time.strftime('%H:%M:%S')}  {line}")
            if all(run.is_terminal for run in runs):
                break
            if time.monotonic() > deadline:
                raise CommandError(f"demo runs still not finished after {timeout:.0f}s")
            time.sleep(POLL_SECONDS)
        outcome = {}
        for run in runs:
            outcome[run.status] = outcome.get(run.status, 0) + 1
        self.stdout.write(self.style.SUCCESS(f"all demo runs finished: {outcome}"))
        if any(run.status != "succeeded" for run in runs):
            raise CommandError("some demo runs did not succeed")
