"""`manage.py run_start TEMPLATE [--param KEY=VALUE ...] [--not-before TIME] [--end-by TIME] [--wait]`:
start a run, optionally follow it."""

import json
from datetime import datetime

from django.core.management.base import CommandError
from django.utils import timezone
from django.utils.translation import gettext as _

from iotqueue.cli_language import LocalizedCommand
from jobs.cli import operator_name, run_wait, timeline_log_quiet
from jobs.models import EndBehaviour, JobTemplate, Trigger
from jobs.services import RunStartError, run_start

# Template names listed when the one asked for does not exist.
TEMPLATES_LISTED = 10


def template_get(name: str) -> JobTemplate:
    template = JobTemplate.objects.filter(name=name).first()
    if template is None:
        names = list(
            JobTemplate.objects.order_by("name").values_list("name", flat=True)[: TEMPLATES_LISTED + 1]
        )
        known = ", ".join(names[:TEMPLATES_LISTED]) + (", ..." if len(names) > TEMPLATES_LISTED else "")
        raise CommandError(
            _("no template named %(name)r; templates: %(known)s")
            % {"name": name, "known": known or _("none yet")}
        )
    return template


def parameters_parse(params_json: str | None, pairs: list[str]) -> dict:
    """--params-json's object, then each --param KEY=VALUE over it (VALUE as JSON if it parses)."""
    parameters = {}
    if params_json:
        try:
            parameters = json.loads(params_json)
        except json.JSONDecodeError as exc:
            raise CommandError(_("--params-json is not valid JSON: %(error)s") % {"error": exc}) from None
        if not isinstance(parameters, dict):
            raise CommandError(_("--params-json must be a JSON object, e.g. '{\"level\": 80}'"))
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise CommandError(_("--param %(pair)r: use KEY=VALUE, e.g. --param level=80") % {"pair": pair})
        try:
            parameters[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            parameters[key.strip()] = text  # plain text needs no quotes: --param zone=B
    return parameters


def time_parse(option: str, text: str | None) -> datetime | None:
    """An ISO 8601 time of the command line; one without an offset is the server's time zone."""
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            _("%(option)s %(text)r is not an ISO 8601 time, e.g. 2026-11-29T02:00+01:00")
            % {"option": option, "text": text}
        ) from None
    return timezone.make_aware(value) if timezone.is_naive(value) else value


class Command(LocalizedCommand):
    help = (
        "Start a run of a template and print its id. With --wait, follow it step by step until "
        "it ends; the exit status is 0 only if it succeeded."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("template", help="name of the job template")
        parser.add_argument(
            "--param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a run parameter (repeatable); VALUE is read as JSON when it parses (80, true, [1,2]), "
            "otherwise as text",
        )
        parser.add_argument("--params-json", metavar="JSON", help="parameters as one JSON object")
        parser.add_argument(
            "--priority", type=int, help="0 lowest .. 9 most urgent (default: the template's)"
        )
        parser.add_argument(
            "--idempotency-key", help="a key used again within the idempotency window returns that run"
        )
        parser.add_argument(
            "--not-before",
            metavar="TIME",
            help="time windows: start no earlier, ISO 8601 (2026-11-29T02:00+01:00)",
        )
        parser.add_argument("--end-by", metavar="TIME", help="time windows: end by, ISO 8601")
        parser.add_argument(
            "--end-behaviour",
            choices=EndBehaviour.values,
            default=EndBehaviour.CANCEL,
            help="at --end-by: cancel the run, or let commands at work finish and start nothing new",
        )
        parser.add_argument("--by", help="who starts it, for the audit trail (default: your OS user)")
        parser.add_argument(
            "--wait",
            action="store_true",
            help="follow the run until it ends; exit 1 unless it succeeded (Ctrl-C stops following only)",
        )
        parser.add_argument(
            "--timeout", type=float, help="with --wait: stop following after this many seconds (exit 2)"
        )

    def handle(self, *args, **options):
        timeline_log_quiet(options["verbosity"])
        if options["timeout"] is not None and not options["wait"]:
            raise CommandError(_("--timeout needs --wait"))
        template = template_get(options["template"])
        try:
            run, created = run_start(
                template=template,
                parameters=parameters_parse(options["params_json"], options["param"]),
                trigger=Trigger.CLI,
                triggered_by=options["by"] or operator_name(),
                priority=options["priority"],
                idempotency_key=options["idempotency_key"],
                not_before=time_parse("--not-before", options["not_before"]),
                end_by=time_parse("--end-by", options["end_by"]),
                end_behaviour=options["end_behaviour"],
            )
        except RunStartError as exc:
            raise CommandError(
                _("cannot start %(template)r: %(field)s: %(error)s")
                % {"template": template.name, "field": exc.field, "error": exc}
            ) from None
        self.stdout.write(str(run.pk))
        if not created:
            self.stderr.write(
                _("idempotency key already used by this run (%(status)s); nothing new started")
                % {"status": run.status}
            )
        if options["wait"]:
            run_wait(self, run, timeout=options["timeout"])
