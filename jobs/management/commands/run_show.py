"""`manage.py run_show RUN_ID [--follow]`: a run's header, steps and event timeline."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cli import (
    EXIT_RUN_UNSUCCESSFUL,
    RunNotFound,
    run_detail_lines,
    run_find,
    run_load,
    run_short_id,
    run_wait,
    run_waiting_read,
    step_lines,
    timeline_lines,
)
from jobs.models import RunStatus


class Command(LocalizedCommand):
    help = (
        "Show a run: who started it and how it ended, each step, and the event timeline. "
        "RUN_ID may be the first characters of the id, as `runs` shows them."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("run", metavar="RUN_ID", help="the run's id or a unique prefix of it")
        parser.add_argument(
            "--follow",
            action="store_true",
            help="follow it live until it ends, then show the timeline; exit 1 unless it succeeded",
        )
        parser.add_argument("--events", type=int, default=100, help="show the latest N events (0: all)")

    def handle(self, *args, **options):
        if options["events"] < 0:
            raise CommandError(_("--events must be 0 (all) or more"))
        try:
            run = run_find(options["run"])
        except RunNotFound as exc:
            raise CommandError(str(exc)) from None
        if options["follow"] and not run.is_terminal:
            self._follow(run, options["events"])
            return
        self._show(run, options["events"])
        if options["follow"] and run.status != RunStatus.SUCCEEDED:
            ended = _("run %(run)s %(status)s") % {"run": run_short_id(run), "status": run.status}
            raise CommandError(ended, returncode=EXIT_RUN_UNSUCCESSFUL)

    def _follow(self, run, events: int) -> None:
        """Follow it live, then show how it ended (but not after a timeout or Ctrl-C)."""
        try:
            run_wait(self, run)
        except CommandError as exc:
            if exc.returncode == EXIT_RUN_UNSUCCESSFUL:
                self._show(run, events)
            raise
        self._show(run, events)

    def _show(self, run, events: int) -> None:
        run = run_load(run.pk)
        waiting, steps_waiting = run_waiting_read(run)
        for line in run_detail_lines(run, waiting):
            self.stdout.write(line)
        self.stdout.write("\nsteps")
        for line in step_lines(run, steps_waiting).values():
            self.stdout.write(line)
        self.stdout.write("\ntimeline")
        for line in timeline_lines(run, limit=events):
            self.stdout.write(line)
