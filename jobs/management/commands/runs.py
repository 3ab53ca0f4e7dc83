"""`manage.py runs [--status S ...] [--template T] [--device D] | --stuck`: a table of runs and
what each active one waits for."""

from django.core.management.base import CommandError
from django.http import QueryDict
from django.utils.translation import gettext as _
from redis.exceptions import RedisError
from rest_framework.exceptions import ValidationError

from iotqueue.cli_language import LocalizedCommand
from jobs.api import runs_filter
from jobs.cli import run_table_lines
from jobs.models import JobRun, RunStatus
from jobs.waiting import runs_stuck, runs_waiting

FILTERS = ("status", "template", "device", "since", "until")


class Command(LocalizedCommand):
    help = (
        "List recent runs, newest first (the filters of GET /api/runs/), with what each active run "
        "waits for; --stuck lists the stuck runs instead."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--status", action="append", choices=RunStatus.values, help="repeatable")
        parser.add_argument("--template", help="template name")
        parser.add_argument("--device", help="runs with a step on this device")
        parser.add_argument("--since", metavar="ISO", help="created at or after, e.g. 2026-11-22T02:00:00Z")
        parser.add_argument("--until", metavar="ISO", help="created before")
        parser.add_argument("--limit", type=int, default=20, help="at most this many runs (default 20)")
        parser.add_argument(
            "--stuck",
            action="store_true",
            help="runs whose oldest unfinished step waited past IOTQUEUE_STUCK_AFTER_SECONDS, newest "
            "problem first (no other filter)",
        )

    def handle(self, *args, **options):
        if options["limit"] < 1:
            raise CommandError(_("--limit must be at least 1"))
        if options["stuck"]:
            if any(options[name] for name in FILTERS):
                raise CommandError(_("--stuck takes no other filter"))
            self._stuck(options["limit"])
            return
        params = QueryDict(mutable=True)
        params.setlist("status", options["status"] or [])
        for name in ("template", "device", "since", "until"):
            if options[name]:
                params[name] = options[name]
        try:
            runs = runs_filter(JobRun.objects.select_related("template"), params)
        except ValidationError as exc:
            problems = "; ".join(
                f"--{field}: {' '.join(map(str, msgs))}" for field, msgs in exc.detail.items()
            )
            raise CommandError(problems) from None
        runs = list(runs.order_by("-created_at")[: options["limit"]])
        if not runs:
            self.stdout.write(_("no runs match"))
            return
        try:
            waiting = runs_waiting(runs)
        except RedisError as exc:
            waiting = {}
            self.stderr.write(
                _("lock state unavailable (%(error)s): no waiting reasons shown") % {"error": exc}
            )
        for line in run_table_lines(runs, waiting):
            self.stdout.write(line)

    def _stuck(self, limit: int) -> None:
        stuck = runs_stuck(limit=limit)
        if not stuck:
            self.stdout.write(_("no run is stuck"))
            return
        waiting = {entry.run.pk: entry.waiting for entry in stuck}
        for line in run_table_lines([entry.run for entry in stuck], waiting):
            self.stdout.write(line)
