"""`manage.py canvas_cancel ROOT_ID`: cancel a whole Celery canvas by its root task's id (audited)."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from iotqueue.cli_language import LocalizedCommand
from jobs.cancel import canvas_cancel
from jobs.cli import operator_name, timeline_log_quiet


class Command(LocalizedCommand):
    help = (
        "Cancel a Celery canvas by its root task id: every run of its device commands that has "
        "not ended, and its later device commands start no run."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("root_id", metavar="ROOT_ID", help="the canvas's root task id (Celery's root_id)")
        parser.add_argument("--by", help="who cancels it, for the audit trail (default: your OS user)")

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        root_id = options["root_id"]
        canceled = canvas_cancel(root_id=root_id, by=options["by"] or operator_name())
        if canceled is None:
            raise CommandError(_("no canvas with root id '%(root)s'") % {"root": root_id})
        message = ngettext(
            "canvas %(root)s canceled: %(count)d run canceled",
            "canvas %(root)s canceled: %(count)d runs canceled",
            canceled,
        )
        self.stdout.write(message % {"root": root_id, "count": canceled})
