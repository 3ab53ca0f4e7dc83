"""`manage.py run_cancel RUN_ID`: cancel a pending or running run (audited)."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cancel import run_cancel
from jobs.cli import RunNotFound, operator_name, run_find, run_short_id, timeline_log_quiet


class Command(LocalizedCommand):
    help = (
        "Cancel a pending or running run: queued steps leave their device queue, "
        "in-flight commands get a cancel command."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("run", metavar="RUN_ID", help="the run's id or a unique prefix of it")
        parser.add_argument("--by", help="who cancels it, for the audit trail (default: your OS user)")

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        try:
            run = run_find(options["run"])
        except RunNotFound as exc:
            raise CommandError(str(exc)) from None
        if not run_cancel(run=run, by=options["by"] or operator_name()):
            run.refresh_from_db()
            raise CommandError(
                _("run %(run)s is already %(status)s") % {"run": run_short_id(run), "status": run.status}
            )
        self.stdout.write(_("run %(run)s canceled") % {"run": run_short_id(run)})
