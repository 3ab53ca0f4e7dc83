"""`manage.py fanout_close RUN_ID [--step STEP]`: close a run's open continuous fan-out (audited)."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cli import RunNotFound, operator_name, run_find, run_short_id, timeline_log_quiet
from jobs.engine.continuous import fanout_close, plan_step_index


class Command(LocalizedCommand):
    help = (
        "Close a run's open continuous fan-out: no device joins it any more, and once its "
        "devices have ended its success criterion decides the step."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("run", metavar="RUN_ID", help="the run's id or a unique prefix of it")
        parser.add_argument(
            "--step", help="the fan-out step, by index (from 0) or name (default: the open one)"
        )
        parser.add_argument("--by", help="who closes it, for the audit trail (default: your OS user)")

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        try:
            run = run_find(options["run"])
        except RunNotFound as exc:
            raise CommandError(str(exc)) from None
        index = None
        if options["step"]:
            index = plan_step_index(run.plan, options["step"])
            if index is None:
                raise CommandError(
                    _("run %(run)s has no step %(step)s")
                    % {"run": run_short_id(run), "step": options["step"]}
                )
        closed = fanout_close(run=run, index=index, by=options["by"] or operator_name())
        if closed is None:
            raise CommandError(_("run %(run)s has no open continuous fan-out") % {"run": run_short_id(run)})
        self.stdout.write(
            _("run %(run)s: continuous fan-out of step %(index)d closed")
            % {"run": run_short_id(run), "index": closed}
        )
