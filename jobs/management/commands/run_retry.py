"""`manage.py run_retry RUN_ID [--wait]`: start a new run from the step a failed run stopped on."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cli import RunNotFound, operator_name, run_find, run_wait, timeline_log_quiet
from jobs.models import Trigger
from jobs.retry import RetryError, run_retry


class Command(LocalizedCommand):
    help = (
        "Retry a failed, timed-out or canceled run from the step it stopped on (earlier steps are "
        "carried over, not re-sent); prints the new run's id."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("run", metavar="RUN_ID", help="the run's id or a unique prefix of it")
        parser.add_argument("--by", help="who retries it, for the audit trail (default: your OS user)")
        parser.add_argument(
            "--wait", action="store_true", help="follow the new run; exit 1 unless it succeeded"
        )
        parser.add_argument(
            "--timeout", type=float, help="with --wait: stop following after this many seconds (exit 2)"
        )

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        if options["timeout"] is not None and not options["wait"]:
            raise CommandError(_("--timeout needs --wait"))
        try:
            run = run_find(options["run"])
        except RunNotFound as exc:
            raise CommandError(str(exc)) from None
        try:
            retry = run_retry(run=run, by=options["by"] or operator_name(), trigger=Trigger.CLI)
        except RetryError as exc:
            raise CommandError(_("cannot retry: %(error)s") % {"error": exc}) from None
        self.stdout.write(str(retry.pk))
        if options["wait"]:
            run_wait(self, retry, timeout=options["timeout"])
