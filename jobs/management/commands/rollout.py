"""`manage.py rollout RUN_ID ACTION`: steer a fan-out in waves — pause, resume, approve, abort (audited)."""

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cli import RunNotFound, operator_name, run_find, run_short_id, timeline_log_quiet
from jobs.rollouts import ACTIONS, RolloutConflict, RolloutNotFound, rollout_act


class Command(LocalizedCommand):
    help = (
        "Steer a run's fan-out in waves: pause (no more devices start), resume, approve "
        "(open the next wave at a gate) or abort (skip the devices not started, fail the step)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("run", metavar="RUN_ID", help="the run's id or a unique prefix of it")
        parser.add_argument("action", choices=ACTIONS, help="what to do")
        parser.add_argument(
            "--step", type=int, help="the fan-out step's index (default: the latest in waves)"
        )
        parser.add_argument("--reason", default="", help="why, kept in the run's timeline")
        parser.add_argument("--by", help="who decides, for the audit trail (default: your OS user)")

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        try:
            run = run_find(options["run"])
            rollout = rollout_act(
                run=run,
                action=options["action"],
                by=options["by"] or operator_name(),
                reason=options["reason"],
                step=options["step"],
            )
        except (RunNotFound, RolloutNotFound, RolloutConflict) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            _("run %(run)s step %(step)s: wave %(wave)s of %(waves)s, %(state)s")
            % {
                "run": run_short_id(run),
                "step": rollout.index,
                "wave": rollout.wave + 1,
                "waves": len(rollout.waves),
                "state": rollout.get_state_display(),
            }
        )
