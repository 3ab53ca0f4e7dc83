"""Plain-text views of runs for the management commands, and following a run live.

Following only reads the database (the run and step rows are the truth about where a run
stands), so any number of terminals can watch a run, and stopping one never touches it.
"""

from __future__ import annotations

import getpass
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

import wcwidth
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection
from django.db.models import Prefetch
from django.utils import timezone
from django.utils.translation import gettext as _
from redis.exceptions import RedisError

from .engine.plan import spec_is_fanout
from .models import (
    STEP_IN_FLIGHT,
    STEP_TERMINAL,
    JobRun,
    Phase,
    Rollout,
    RunEvent,
    RunStatus,
    StepKind,
    StepRun,
    StepStatus,
)
from .services import plan_step_target
from .waiting import Waiting, run_current_row, runs_steps_waiting

# How often following re-reads the run. A healthy device answers within tens of
# milliseconds, so some states flash past unseen; a quarter second still shows a slow
# device's progress as it comes, for two or three small queries per tick.
POLL_SECONDS = 0.25
BAR_WIDTH = 10
# Shortest run id prefix accepted: with fewer hex digits nearly every prefix is ambiguous.
RUN_PREFIX_MIN = 4
# Exit statuses of --wait / --follow besides 0 (the run succeeded).
EXIT_RUN_UNSUCCESSFUL = 1
EXIT_STILL_RUNNING = 2
EXIT_INTERRUPTED = 130  # the shell's convention for "ended by Ctrl-C" (128 + SIGINT)
# ANSI: move the cursor to the start of the line N lines up; erase the whole line.
CURSOR_UP = "\x1b[{}F"
ERASE_LINE = "\x1b[2K"


class RunNotFound(LookupError):
    """No run, or more than one, matches the id given."""


class FollowTimeout(Exception):
    """The run had not ended when following gave up; `run` is how it stood."""

    def __init__(self, run: JobRun) -> None:
        super().__init__(
            _("run %(run)s is still %(status)s") % {"run": run_short_id(run), "status": run.status}
        )
        self.run = run


class Output(Protocol):
    def write(self, msg: str = "", style_func: Any = None, ending: str | None = None) -> None: ...

    def flush(self) -> None: ...


def operator_name() -> str:
    """Who is at the keyboard, for the audit trail: the OS user, or "cli" when unknown."""
    try:
        return getpass.getuser()
    except Exception:  # no login name in a bare container: getpass raises OSError or KeyError
        return "cli"


def run_short_id(run: JobRun) -> str:
    return str(run.pk)[:8]


def run_find(ident: str) -> JobRun:
    """The run whose id is `ident` or starts with it (e.g. the 8 characters shown in lists)."""
    text = ident.strip().lower()
    digits = text.replace("-", "")
    if len(digits) < RUN_PREFIX_MIN or any(c not in "0123456789abcdef" for c in digits):
        raise RunNotFound(
            _("%(ident)r is not a run id (give the id or at least its first %(count)s characters)")
            % {"ident": ident, "count": RUN_PREFIX_MIN}
        )
    matches = list(
        JobRun.objects.select_related("template").filter(id__startswith=text).order_by("-created_at")[:5]
    )
    if not matches:
        raise RunNotFound(_("no run with id %(ident)r") % {"ident": ident})
    if len(matches) > 1:
        listed = ", ".join(f"{m.pk} ({m.template.name})" for m in matches)
        raise RunNotFound(
            _("%(ident)r matches several runs: %(runs)s; give more characters")
            % {"ident": ident, "runs": listed}
        )
    return matches[0]


def run_load(run_id: Any) -> JobRun:
    """The run read afresh, with its template and step rows (devices joined)."""
    rows = StepRun.objects.select_related("device").order_by("index", "device__name", "pk")
    return (
        JobRun.objects.select_related("template", "template_version")
        .prefetch_related(Prefetch("step_runs", queryset=rows))
        .get(pk=run_id)
    )


# --- formatting -------------------------------------------------------------------------


def display_width(text: str) -> int:
    """Columns `text` takes in a terminal: a CJK character takes two (wcwidth)."""
    return wcwidth.width(text)


def printable(text: str) -> str:
    """Text safe to print in a table: a control character (an escape sequence from a device's
    error, a newline) would move the cursor and break the row, so it shows as "?"."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def pad(text: str, width: int, *, right: bool = False) -> str:
    """`text` padded to `width` display columns (left-aligned unless `right`); never cut."""
    text = printable(text)
    return wcwidth.rjust(text, width) if right else wcwidth.ljust(text, width)


def cell(text: str, width: int, *, right: bool = False) -> str:
    """`text` in exactly `width` display columns: cut when longer, padded when shorter.

    A wide character that would straddle the edge is left out (a space takes its place).
    """
    text = printable(text)
    if display_width(text) > width:
        text = wcwidth.clip(text, 0, width)
    return pad(text, width, right=right)


def progress_bar(percent: int | None) -> str:
    """`[###-------]  30%`; an empty bar when there is nothing to measure yet."""
    if percent is None:
        return f"[{' ' * BAR_WIDTH}]     "
    filled = round(BAR_WIDTH * percent / 100)
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {percent:>3}%"


def duration_text(delta: timedelta) -> str:
    seconds = max(delta.total_seconds(), 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def time_text(when: datetime | None, *, with_date: bool = False) -> str:
    """A time in TIME_ZONE (the zone the columns are labelled with)."""
    if when is None:
        return "-"
    return timezone.localtime(when).strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")


def run_duration(run: JobRun) -> str:
    start = run.started_at or run.created_at
    return duration_text((run.finished_at or timezone.now()) - start)


def run_headline(run: JobRun) -> str:
    """`Morning 0a1b2c3d  running  step 2/3`: no clock in it, so it changes only with the run."""
    step = _("step %(position)s") % {"position": run_position(run)}
    return f"{run.template.name} {run_short_id(run)}  {run.status}  {step}"


def timeline_log_quiet(verbosity: int) -> None:
    """The command prints what happens; the timeline's INFO lines would repeat it on stderr
    (they are still written at -v 2 and above)."""
    if verbosity < 2:
        logging.getLogger("jobs.timeline").setLevel(logging.WARNING)


def trigger_label(run: JobRun) -> str:
    """`cli demo`, `schedule nightly`: schedules and rules already name their trigger first."""
    by = run.triggered_by or "anonymous"
    return by if by.split(" ", 1)[0] == run.trigger else f"{run.trigger} {by}"


def run_position(run: JobRun) -> str:
    """`2/3`: the step the run is on, or stopped on (the cursor moves past the last on success)."""
    return f"{min(run.cursor + 1, len(run.plan))}/{len(run.plan)}"


def _step_action(spec: dict) -> str:
    if spec.get("kind") == StepKind.DELAY:
        return _("delay %(seconds)ss") % {"seconds": f"{spec.get('delay_seconds', 0):g}"}
    if spec.get("kind") == StepKind.WAIT_ONLINE:
        return _("wait online")
    return spec.get("action") or "-"


def _row_percent(row: StepRun) -> int | None:
    if row.progress is not None:
        return row.progress
    if row.status in STEP_IN_FLIGHT:
        return 0
    return None


def _line(label: str, bar: str, status: str, detail: str, what: str, note: str = "") -> str:
    """Fixed-width columns first, names last: a narrow terminal cuts names, not the bar."""
    line = f"  {pad(label, 7, right=True)}  {bar}  {pad(status, 11)} {pad(detail, 7)}  {printable(what)}"
    return f"{line}: {printable(note)}" if note else line


def _row_line(label: str, row: StepRun, spec: dict, waiting: Waiting | None = None) -> str:
    """A step on one device: its status, attempt, progress and why it waits, or once it
    failed, why it failed."""
    attempts = {"attempt": row.attempt, "max": spec.get("max_attempts", 1)}
    tries = _("try %(attempt)s/%(max)s") % attempts if row.attempt else ""
    note = row.error[:80] if row.is_terminal and row.error else ""
    if waiting is not None and not row.is_terminal:
        note = waiting.message
    what = f"{row.device_name or plan_step_target(spec)} {_step_action(spec)}"
    return _line(label, progress_bar(_row_percent(row)), row.status, tries, what, note)


def _fanout_line(label: str, rows: list[StepRun], spec: dict, waiting: Waiting | None = None) -> str:
    """A step sent to many devices: how many have finished, the status breakdown, and why
    its oldest unfinished device waits."""
    counts = Counter(row.status for row in rows)
    finished = sum(n for status, n in counts.items() if status in STEP_TERMINAL)
    if finished == len(rows):
        overall = "succeeded" if counts.keys() == {StepStatus.SUCCEEDED} else "done"
    else:
        overall = "pending" if counts[StepStatus.PENDING] == len(rows) else "running"
    breakdown = ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
    what = f"{plan_step_target(spec)} {_step_action(spec)}"
    note = f"{breakdown}; {waiting.message}" if waiting is not None else breakdown
    return _line(
        label, progress_bar(finished * 100 // len(rows)), overall, f"{finished}/{len(rows)}", what, note
    )


def step_lines(run: JobRun, waiting: Mapping[int, Waiting] | None = None) -> dict[str, str]:
    """One line per step of the run's plan, then one per compensation (rollback) row (a
    fan-out's rollback on many devices: one line with their counts); keyed
    by what the line is about, so a follower can tell which line changed. With `waiting`
    (by row pk: `run_waiting_read`), a waiting row's line says why it waits."""
    waiting = waiting or {}
    forward: dict[int, list[StepRun]] = {}
    compensations = []
    for row in run.step_runs.all():
        if row.phase == Phase.FORWARD:
            forward.setdefault(row.index, []).append(row)
        else:
            compensations.append(row)
    lines = {}
    for index, spec in enumerate(run.plan):
        rows, label = forward.get(index, []), f"#{index}"
        if spec_is_fanout(spec):
            current = run_current_row(rows)
            told = waiting.get(current.pk) if current is not None else None
            if rows:
                lines[label] = _fanout_line(label, rows, spec, told)
            elif run.cursor > index:  # devices_from with no device of its outcome
                what = f"{plan_step_target(spec)} {_step_action(spec)}"
                lines[label] = _line(
                    label, progress_bar(100), "succeeded", "0/0", what, _("no device to target")
                )
            else:
                lines[label] = _not_started_line(run, label, spec)
        elif rows:
            lines.update(
                (f"{label}/{row.pk}", _row_line(label, row, spec, waiting.get(row.pk))) for row in rows
            )
        else:
            lines[label] = _not_started_line(run, label, spec)
    undone: dict[int, list[StepRun]] = {}
    for row in sorted(compensations, key=lambda r: r.pk):
        undone.setdefault(row.index, []).append(row)
    for index, rows in undone.items():
        label = _("undo #%(step)s") % {"step": index}
        if len(rows) > 1:  # a fan-out's rollback: one line, as its rollout's
            current = run_current_row(rows)
            told = waiting.get(current.pk) if current is not None else None
            spec = {**run.plan[index], "action": rows[0].action}
            lines[f"undo/#{index}"] = _fanout_line(label, rows, spec, told)
            continue
        for row in rows:
            lines[f"undo/{row.pk}"] = _row_line(label, row, {"action": row.action}, waiting.get(row.pk))
    return lines


def run_waiting_read(run: JobRun) -> tuple[Waiting | None, dict[int, Waiting]]:
    """Why the run (loaded by `run_load`) and each of its rows wait: one Redis round trip.

    Redis out of reach: no reasons (the lines show the rows as they are), never a crash.
    """
    try:
        by_run, by_row = runs_steps_waiting([run], run.step_runs.all())
    except RedisError:
        return None, {}
    return by_run.get(run.pk), by_row


def _not_started_line(run: JobRun, label: str, spec: dict) -> str:
    status = _("not run") if run.is_terminal else "pending"
    return _line(label, progress_bar(None), status, "", f"{plan_step_target(spec)} {_step_action(spec)}")


def event_line(event: RunEvent) -> str:
    when = timezone.localtime(event.created_at).strftime("%H:%M:%S.%f")[:-3]
    return f"  {when}  {pad(event.kind, 24)} {pad(event.device or '-', 20)} {printable(event.message)}"


def timeline_lines(run: JobRun, *, limit: int) -> list[str]:
    """The run's events, oldest first; with a limit, the latest `limit` and a note of the rest."""
    events = run.events.order_by("-id")
    total = events.count()
    shown = list(events[:limit] if limit else events)[::-1]
    lines = [event_line(event) for event in shown]
    if total > len(shown):
        hidden = _("%(count)s earlier events not shown (--events 0 shows all)") % {
            "count": total - len(shown)
        }
        lines.insert(0, f"  ... {hidden}")
    return lines


def run_detail_lines(run: JobRun, waiting: Waiting | None = None) -> list[str]:
    """The header block of `run_show`: what the run is, who started it, how it ended, and
    while it goes on, what it waits for."""
    zone = timezone.get_current_timezone_name()
    times = {
        "created": time_text(run.created_at, with_date=True),
        "zone": zone,
        "started": time_text(run.started_at),
        "finished": time_text(run.finished_at),
        "took": run_duration(run),
    }
    by = {"trigger": run.trigger, "by": run.triggered_by or _("anonymous"), "priority": run.priority}
    fields = [(_("run"), f"{run.pk}  ({run.template.name})")]
    if run.template_version_id:
        fields.append(
            (_("version"), _("v%(number)s of the template") % {"number": run.template_version.number})
        )
    fields.append((_("status"), run.status + (f": {run.error}" if run.error else "")))
    if waiting is not None:
        fields.append((_("waiting"), f"{waiting.reason}: {waiting.message}"))
    if any(spec.get("waves") for spec in run.plan or []):
        fields += [(_("waves"), _rollout_text(rollout)) for rollout in run.rollouts.order_by("index")]
    fields += [
        (_("trigger"), _("%(trigger)s by %(by)s, priority %(priority)s") % by),
        (
            _("created"),
            _("%(created)s %(zone)s   started %(started)s   finished %(finished)s   took %(took)s") % times,
        ),
        (_("parameters"), json.dumps(run.parameters)),
    ]
    if run.retry_of_id:
        fields.append((_("retry of"), str(run.retry_of_id)))
    if run.idempotency_key:
        fields.append((_("idem. key"), run.idempotency_key))
    return [f"{pad(label, DETAIL_LABEL_WIDTH - 1)} {printable(value)}" for label, value in fields]


def _rollout_text(rollout: Rollout) -> str:
    """A fan-out in waves for run_show's header: where it stands, why, who decided."""
    text = _("step %(step)s: wave %(wave)s of %(waves)s, %(state)s") % {
        "step": rollout.index,
        "wave": rollout.wave + 1,
        "waves": len(rollout.waves),
        "state": rollout.get_state_display(),
    }
    if rollout.reason:
        text += f" ({rollout.reason})"
    if rollout.decided_by:
        text += " " + _("decided by %(who)s") % {"who": rollout.decided_by}
    return text


# run_show's header: labels in a column this wide (display columns), values after them.
DETAIL_LABEL_WIDTH = 12


# The columns of `runs`: display width and alignment (True: right), the last one unbounded.
RUN_TABLE_COLUMNS = ((8, False), (20, False), (12, False), (5, True), (20, False), (19, False), (7, True))
# The WAITING column holds a reason code (jobs/waiting.py REASONS; the longest is 17).
WAITING_WIDTH = 17
# The last column: why an active run waits, or why a finished one failed (cut: an error can
# be a whole fan-out's breakdown).
ERROR_CHARS = 80


def table_row(cells: list[str], columns: tuple[tuple[int, bool], ...], last: str = "") -> str:
    """One row of a table whose columns are (width, right-aligned); aligned by display width,
    so CJK names line up; the `last` column is not padded."""
    parts = [cell(text, width, right=right) for text, (width, right) in zip(cells, columns, strict=True)]
    return "  ".join([*parts, printable(last)]).rstrip()


def run_table_lines(runs: list[JobRun], waiting: Mapping[Any, Waiting] | None = None) -> list[str]:
    """The `runs` table; `waiting` (jobs.waiting.runs_waiting of the runs) fills WAITING."""
    waiting = waiting or {}
    zone = timezone.get_current_timezone_name()
    columns = (*RUN_TABLE_COLUMNS, (WAITING_WIDTH, False))
    header = [
        _("ID"),
        _("TEMPLATE"),
        _("STATUS"),
        _("STEP"),
        _("TRIGGER"),
        _("CREATED (%(zone)s)") % {"zone": zone},
        _("TOOK"),
        _("WAITING"),
    ]
    lines = [table_row(header, columns, _("WHY / ERROR"))]
    for run in runs:
        took = run_duration(run) if run.started_at else "-"
        told = waiting.get(run.pk)
        cells = [
            run_short_id(run),
            run.template.name,
            run.status,
            run_position(run),
            trigger_label(run),
            time_text(run.created_at, with_date=True),
            took,
            told.reason if told else "-",
        ]
        lines.append(table_row(cells, columns, told.message if told else run.error[:ERROR_CHARS]))
    return lines


# --- following --------------------------------------------------------------------------


class LogView:
    """For logs and pipes: prints a timestamped line whenever the run or a step changes."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.shown: dict[str, str] = {}

    def show(self, run: JobRun) -> None:
        stamp = time.strftime("%H:%M:%S")
        lines = step_lines(run, run_waiting_read(run)[1])
        for key, line in {"run": run_headline(run), **lines}.items():
            if self.shown.get(key) != line:
                self.shown[key] = line
                self.out.write(f"{stamp}  {line.strip() if key == 'run' else line}")
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(f"{time.strftime('%H:%M:%S')}  {text}")


class TerminalView:
    """For a terminal: redraws the run's block in place (cursor up, erase, rewrite)."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.drawn = 0
        self.width = shutil.get_terminal_size().columns - 1

    def show(self, run: JobRun) -> None:
        last = run.events.order_by("-id").first()
        lines = [
            f"{run_headline(run)}  {run_duration(run)}",
            *step_lines(run, run_waiting_read(run)[1]).values(),
            "  " + _("last event: %(event)s") % {"event": event_line(last).strip()} if last else "",
        ]
        lines += [""] * (self.drawn - len(lines))  # never leave a stale line of a longer frame
        # Lines longer than the terminal would wrap and spoil the count of lines to go up.
        frame = [ERASE_LINE + line[: self.width] for line in lines]
        if self.drawn:
            self.out.write(CURSOR_UP.format(self.drawn), ending="")
        self.out.write("\n".join(frame))
        self.drawn = len(frame)
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(text)
        self.drawn = 0


def run_follow(run: JobRun, *, view: LogView | TerminalView, timeout: float | None = None) -> JobRun:
    """Show the run until it ends and return it; FollowTimeout after `timeout` seconds.

    A database that stops answering is reported once and retried every tick, so a restart
    of the database does not end the watch. Ctrl-C raises KeyboardInterrupt here and
    leaves the run alone.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    database_down = False
    while True:
        try:
            run = run_load(run.pk)
        except DatabaseError as exc:
            if not database_down:
                view.note(_("database unavailable (%(error)s); still trying") % {"error": exc})
            database_down = True
            connection.close()  # a broken connection is not reused; the next tick opens a new one
        else:
            database_down = False
            view.show(run)
            if run.is_terminal:
                return run
        if deadline is not None and time.monotonic() > deadline:
            raise FollowTimeout(run)
        time.sleep(POLL_SECONDS)


def run_wait(command: BaseCommand, run: JobRun, *, timeout: float | None = None) -> None:
    """Follow `run` on the command's stdout; return if it succeeded, else raise CommandError.

    Exit status 1 when it ended otherwise, 2 when it is still going after `timeout`,
    130 on Ctrl-C (which stops following only: the run goes on).
    """
    out = command.stdout
    view = TerminalView(out) if out.isatty() else LogView(out)
    short = run_short_id(run)
    try:
        run = run_follow(run, view=view, timeout=timeout)
    except FollowTimeout as exc:
        raise CommandError(
            _(
                "run %(run)s is still %(status)s after %(seconds)ss; it goes on "
                "(manage.py run_show %(run)s --follow to watch it again)"
            )
            % {"run": short, "status": exc.run.status, "seconds": f"{timeout:g}"},
            returncode=EXIT_STILL_RUNNING,
        ) from None
    except KeyboardInterrupt:
        raise CommandError(
            _(
                "stopped following; run %(run)s was NOT canceled and goes on "
                "(manage.py run_show %(run)s --follow to watch it, manage.py run_cancel %(run)s to cancel it)"
            )
            % {"run": short},
            returncode=EXIT_INTERRUPTED,
        ) from None
    if run.status != RunStatus.SUCCEEDED:
        reason = f": {run.error}" if run.error else ""
        ended = _("run %(run)s %(status)s after %(took)s") % {
            "run": short,
            "status": run.status,
            "took": run_duration(run),
        }
        raise CommandError(ended + reason, returncode=EXIT_RUN_UNSUCCESSFUL)
    succeeded = _("run %(run)s succeeded in %(took)s") % {"run": short, "took": run_duration(run)}
    out.write(succeeded, style_func=command.style.SUCCESS)
