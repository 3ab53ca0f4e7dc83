"""`manage.py runs [--status S ...] [--template T] [--device D]`: a table of recent runs."""

from django.core.management.base import CommandError
from django.http import QueryDict
from django.utils.translation import gettext as _
from redis.exceptions import RedisError
from rest_framework.exceptions import ValidationError

from iotqueue.cli_language import LocalizedCommand
from jobs.api import runs_filter
from jobs.cli import run_table_lines
from jobs.models import JobRun, RunStatus
from jobs.waiting import runs_waiting


class Command(LocalizedCommand):
    help = "List recent runs, newest first (the filters of GET /api/runs/)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--status", action="append", choices=RunStatus.values, help="repeatable")
        parser.add_argument("--template", help="template name")
        parser.add_argument("--device", help="runs with a step on this device")
        parser.add_argument("--since", metavar="ISO", help="created at or after, e.g. 2026-11-22T02:00:00Z")
        parser.add_argument("--until", metavar="ISO", help="created before")
        parser.add_argument("--limit", type=int, default=20, help="at most this many runs (default 20)")

    def handle(self, *args, **options):
        if options["limit"] < 1:
            raise CommandError(_("--limit must be at least 1"))
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
