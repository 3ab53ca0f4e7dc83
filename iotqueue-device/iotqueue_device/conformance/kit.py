"""The conformance kit: drive a device under test through docs/protocol.md's cases against a
running iotqueue, and judge what it sent.

The kit starts runs over the REST API (one-step templates of the three actions in
actions.py, each named `conformance <device> <action with - for />`), watches the device's topics on the
broker, and publishes what a server may send in the field: a command again, a command whose
token is lower than one the device saw, one whose deadline has passed. A negative case ("it
did not answer") is judged when a later command's `done` arrives: a device handles its
commands in order, so by then it has said all it will say about the earlier one.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ..protocol import CANCEL_ACTION, DONE_REJECTED, Topics
from .actions import ECHO, REJECT, SLOW
from .api import TERMINAL, Api
from .observer import Observer, Seen

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
# How long the slow action runs in the reboot case: long enough to reboot the device in the
# middle of it, short enough to keep the kit quick.
SLOW_SECONDS = 3
# A step's timeout in the kit's templates: every case ends well within it, and a device that
# never answers frees its lock (the kit also cancels such a run) without stalling the kit long.
STEP_TIMEOUT_SECONDS = 30
# How often the kit polls a run's status over REST.
POLL_SECONDS = 0.2
REPLY_KINDS = ("ack", "progress", "done")


@dataclass(frozen=True)
class CaseResult:
    name: str
    outcome: str
    detail: str = ""


class CaseFailed(Exception):
    """A case's verdict: the device did not do what the protocol asks (the message says what)."""


class Kit:
    """One session against one device; `run()` returns a row per case."""

    def __init__(
        self,
        api: Api,
        observer: Observer,
        device: str,
        *,
        reboot: Callable[[], None] | None = None,
        wait: float = 15.0,
    ) -> None:
        self.api, self.observer, self.device = api, observer, device
        self.topics: Topics = observer.topics
        self.reboot, self.wait_seconds = reboot, wait
        self.runs: list[str] = []  # the runs the kit started
        self.injected: set[str] = set()  # ids of commands the kit published itself
        self.first: tuple[Seen, Seen] | None = None  # the echo case's command and done
        self._templates: set[str] = set()

    def run(self) -> list[CaseResult]:
        cases: list[tuple[str, Callable[[], str]]] = [
            ("online: retained status", self.case_online),
            ("command: ack, progress and done shapes", self.case_shapes),
            ("duplicate command: not run again", self.case_duplicate),
            ("late command, lower token: ignored", self.case_lower_token),
            ("late command, deadline passed: ignored", self.case_deadline_passed),
            ("rejected command", self.case_rejected),
            ("cancel: stopped, both answered", self.case_cancel),
            ("reboot mid-command: jobs/get, same attempt", self.case_reboot),
            ("no stale or foreign replies", self.case_replies_current),
            ("one command at a time, none sent twice", self.case_one_at_a_time),
        ]
        results = []
        for name, case in cases:
            try:
                detail = case()
                results.append(CaseResult(name, SKIP if detail.startswith("skipped") else PASS, detail))
            except CaseFailed as exc:
                results.append(CaseResult(name, FAIL, str(exc)))
            except Exception as exc:  # the kit's own trouble (REST, broker) fails the case, not the kit
                results.append(CaseResult(name, FAIL, f"{type(exc).__name__}: {exc}"))
        return results

    # -- the cases -----------------------------------------------------------------------

    def case_online(self) -> str:
        seen = self.observer.wait(
            lambda s: s.kind == "status" and _text(s.body) == "online", self.wait_seconds
        )
        if seen is None:
            raise CaseFailed(f"no retained 'online' on {self.topics.status} within {self.wait_seconds:g}s")
        return "retained 'online' on the status topic"

    def case_shapes(self) -> str:
        run_id, command = self._run_started(ECHO, {"probe": 1})
        done = self._done_of(command)
        problems = [
            *(_ack_problems(s) for s in self._replies_of(command.id, "ack")),
            *(_progress_problems(s) for s in self._replies_of(command.id, "progress")),
            _done_problems(done.body, ok=True),
        ]
        problems = [problem for problem in problems if problem]
        if problems:
            raise CaseFailed("; ".join(problems))
        self._run_succeeded(run_id)
        self.first = (command, done)
        return f"done {_short(done.body)}"

    def case_duplicate(self) -> str:
        if self.first is None:
            return "skipped: the first command was not answered"
        command, done = self.first
        mark = self.observer.mark()
        self.observer.publish(command.topic, command.body)
        self._sentinel()
        said = [s for s in self.observer.since(mark) if s.id == command.id and s.kind in REPLY_KINDS]
        again = [s for s in said if s.kind != "done" or s.body != done.body]
        if again:
            raise CaseFailed(
                f"the command was run again: {', '.join(f'{s.kind} {_short(s.body)}' for s in again)}"
            )
        return "answered with the same done again" if said else "not answered again (allowed)"

    def case_lower_token(self) -> str:
        token = self._last_token()
        if token is None:
            return "skipped: no command with a token seen"
        return self._late_case(token - 1, datetime.now(UTC) + timedelta(minutes=5), "a lower token")

    def case_deadline_passed(self) -> str:
        token = self._last_token()
        if token is None:
            return "skipped: no command with a token seen"
        return self._late_case(token, datetime.now(UTC) - timedelta(minutes=1), "a passed deadline")

    def case_rejected(self) -> str:
        run_id, command = self._run_started(REJECT, {})
        done = self._done_of(command)
        body = done.body if isinstance(done.body, dict) else {}
        if body.get("status") != DONE_REJECTED or body.get("ok") is True:
            raise CaseFailed(f'done is not a refusal ("status": "rejected", ok not true): {_short(body)}')
        run = self._run_finished(run_id)
        steps = run.get("steps") or [{}]
        if (steps[0].get("status"), steps[0].get("attempt")) != ("rejected", 1):
            raise CaseFailed(f"the step ended {steps[0].get('status')} on attempt {steps[0].get('attempt')}")
        return f"done {_short(body)}"

    def case_cancel(self) -> str:
        run_id, command = self._run_started(SLOW, {"seconds": SLOW_SECONDS * 2})
        self._reply_of(command, "progress")
        self.api.run_cancel(run_id)
        cancel = self._wait(
            lambda s: s.kind == "cmd" and _args_id(s.body) == command.id and _action(s) == CANCEL_ACTION,
            "the cancel command (iotqueue sent none)",
            after=command.index,
        )
        cancel_done = self._done_of(cancel)
        if _done_problems(cancel_done.body, ok=True):
            raise CaseFailed(f"the cancel command's done is not ok: {_short(cancel_done.body)}")
        mark = self.observer.mark()
        self._sentinel()
        target = [s for s in self.observer.since(cancel.index) if s.id == command.id and s.kind == "done"]
        late = [s for s in self.observer.since(mark) if s.id == command.id and s.kind in ("ack", "progress")]
        if not target or target[0].body.get("ok") is not False:
            raise CaseFailed(
                f"the canceled command was not answered ok:false: {[_short(s.body) for s in target]}"
            )
        if late or any(s.body.get("ok") is True for s in target):
            raise CaseFailed("the canceled command went on after its cancel")
        return f"canceled {_short(target[0].body)}"

    def case_reboot(self) -> str:
        if self.reboot is None:
            return "skipped: no way to reboot the device (--reboot-command, or run it at a terminal)"
        run_id, command = self._run_started(SLOW, {"seconds": SLOW_SECONDS})
        progress = self._reply_of(command, "progress")
        self.reboot()
        asked = self._wait(lambda s: s.kind == "jobs/get", "jobs/get after the reboot", after=progress.index)
        done = self._wait(
            lambda s: s.kind == "done" and s.id == command.id,
            "the command's done after the reboot",
            after=asked.index,
            timeout=self.wait_seconds + SLOW_SECONDS,
        )
        if _done_problems(done.body, ok=True):
            raise CaseFailed(f"done after the reboot is not ok: {_short(done.body)}")
        run = self._run_succeeded(run_id)
        attempt = (run.get("steps") or [{}])[0].get("attempt")
        if attempt != 1:
            raise CaseFailed(f"the step needed attempt {attempt}: the device did not finish the same attempt")
        return "asked jobs/get and finished the same command"

    def case_replies_current(self) -> str:
        commands = {s.id: s for s in self.observer.log if s.kind == "cmd" and s.id}
        replies = [s for s in self.observer.log if s.kind in REPLY_KINDS]
        foreign = sorted({str(s.id) for s in replies if s.id not in commands})
        if foreign:
            raise CaseFailed(f"replies with ids iotqueue never sent: {', '.join(foreign[:5])}")
        answered = [s for s in replies if s.id in self.injected]
        if answered:
            raise CaseFailed(f"answered late commands: {', '.join(f'{s.kind} {s.id}' for s in answered[:5])}")
        after_done = []
        for reply in replies:
            first_done = next((s for s in replies if s.kind == "done" and s.id == reply.id), None)
            if reply.kind != "done" and first_done is not None and first_done.index < reply.index:
                after_done.append(reply)
        if after_done:
            raise CaseFailed(f"ack/progress after the command's done: {_short(after_done[0].body)}")
        return f"{len(replies)} replies, each for a command the device held"

    def case_one_at_a_time(self) -> str:
        commands = [
            s
            for s in self.observer.log
            if s.kind == "cmd" and s.id not in self.injected and _action(s) != CANCEL_ACTION
        ]
        per_step: dict[tuple[Any, Any], set[str]] = {}
        for command in commands:
            per_step.setdefault((command.body.get("run"), command.body.get("step")), set()).add(
                str(command.id)
            )
        twice = {key: ids for key, ids in per_step.items() if key[0] in self.runs and len(ids) > 1}
        if twice:
            raise CaseFailed(f"a step's command was sent again with a new id (a retry): {twice}")
        done_at: dict[Any, int] = {}
        for seen in self.observer.log:
            if seen.kind == "done":
                done_at.setdefault(seen.id, seen.index)
        for earlier, later in itertools.pairwise(commands):
            if earlier.id == later.id:
                continue
            finished = done_at.get(earlier.id)
            canceled = any(s.kind == "cmd" and _args_id(s.body) == earlier.id for s in self.observer.log)
            if (finished is None or finished > later.index) and not canceled and _live(earlier, later.at):
                raise CaseFailed(f"{later.id} was sent while {earlier.id} was still in flight")
        return f"{len(commands)} commands, one at a time"

    # -- helpers -------------------------------------------------------------------------

    def _late_case(self, token: int, deadline: datetime, what: str) -> str:
        command_id = f"conformance-late-{secrets.token_hex(4)}"
        self.injected.add(command_id)
        body = {
            "id": command_id,
            "run": "00000000-0000-0000-0000-000000000000",
            "step": 0,
            "attempt": 1,
            "token": token,
            "action": ECHO,
            "args": {},
            "deadline": deadline.isoformat(),
        }
        mark = self.observer.mark()
        self.observer.publish(self.topics.command(ECHO), body)
        self._sentinel()
        said = [s for s in self.observer.since(mark) if s.id == command_id and s.kind in REPLY_KINDS]
        if said:
            raise CaseFailed(f"a command with {what} was answered: {', '.join(s.kind for s in said)}")
        return f"token {token}, deadline {deadline:%H:%M:%S}: not started, not answered"

    def _template(self, action: str, args: dict[str, Any]) -> str:
        """The one-step template of this action (the slow one: one per duration)."""
        # A template's name is a segment of its URL: no "/".
        name = f"conformance {self.device} {action.replace('/', '-')}"
        if action == SLOW:
            name += f" {args['seconds']}s"
        if name not in self._templates:
            step = {
                "position": 0,
                "device": self.device,
                "action": action,
                "args": args,
                "timeout_seconds": STEP_TIMEOUT_SECONDS,
                "max_attempts": 1,
            }
            self.api.template_ensure(name, step)
            self._templates.add(name)
        return name

    def _run_started(self, action: str, args: dict[str, Any]) -> tuple[str, Seen]:
        """Start a run of the action; (its id, its command as the device was sent it)."""
        name = self._template(action, args)
        mark = self.observer.mark()
        run_id = self.api.run_start(name)
        self.runs.append(run_id)
        command = self.observer.wait(
            lambda s: s.kind == "cmd" and isinstance(s.body, dict) and s.body.get("run") == run_id,
            self.wait_seconds,
            after=mark,
        )
        if command is None:
            self.api.run_cancel(run_id)
            raise CaseFailed(
                f"iotqueue sent no command within {self.wait_seconds:g}s (is the device online?)"
            )
        return run_id, command

    def _sentinel(self) -> None:
        """Run an echo command to its done: everything the device says about earlier
        messages has been said by then."""
        run_id, command = self._run_started(ECHO, {"probe": 1})
        self._done_of(command)
        self._run_finished(run_id)

    def _replies_of(self, command_id: str, kind: str) -> list[Seen]:
        return [s for s in self.observer.since(0) if s.kind == kind and s.id == command_id]

    def _done_of(self, command: Seen) -> Seen:
        return self._reply_of(command, "done")

    def _reply_of(self, command: Seen, kind: str) -> Seen:
        """The first reply of this kind naming the command; CaseFailed (and the run canceled)
        when none comes in time, naming what came instead."""
        seen = self.observer.wait(
            lambda s: s.kind == kind and s.id == command.id, self.wait_seconds, after=command.index
        )
        if seen is not None:
            return seen
        others = [s for s in self.observer.since(command.index) if s.kind in REPLY_KINDS]
        run_id = command.body.get("run") if isinstance(command.body, dict) else None
        if run_id in self.runs:
            self.api.run_cancel(run_id)
        instead = (
            f"; instead: {', '.join(f'{s.kind} {_short(s.body)}' for s in others[:3])}" if others else ""
        )
        raise CaseFailed(
            f"no {kind} with the command's id {command.id} within {self.wait_seconds:g}s{instead}"
        )

    def _wait(
        self, predicate: Callable[[Seen], bool], what: str, *, after: int, timeout: float | None = None
    ) -> Seen:
        seen = self.observer.wait(predicate, timeout or self.wait_seconds, after=after)
        if seen is None:
            raise CaseFailed(f"no {what} within {timeout or self.wait_seconds:g}s")
        return seen

    def _run_finished(self, run_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.wait_seconds
        while True:
            run = self.api.run_get(run_id)
            if run.get("status") in TERMINAL:
                return run
            if time.monotonic() > deadline:
                self.api.run_cancel(run_id)
                raise CaseFailed(f"run {run_id} still {run.get('status')} after {self.wait_seconds:g}s")
            time.sleep(POLL_SECONDS)

    def _run_succeeded(self, run_id: str) -> dict[str, Any]:
        run = self._run_finished(run_id)
        if run.get("status") != "succeeded":
            step = (run.get("steps") or [{}])[0]
            raise CaseFailed(
                f"run {run.get('status')}: step {step.get('status')} {step.get('error') or ''}".strip()
            )
        return run

    def _last_token(self) -> int | None:
        tokens = [
            s.body.get("token")
            for s in self.observer.log
            if s.kind == "cmd" and s.id not in self.injected and isinstance(s.body.get("token"), int)
        ]
        return max(tokens) if tokens else None


def _text(body: Any) -> str:
    return str(body).strip().strip('"').lower()


def _short(body: Any, limit: int = 120) -> str:
    text = str(body)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _action(seen: Seen) -> str:
    return seen.body.get("action") if isinstance(seen.body, dict) else ""


def _args_id(body: Any) -> Any:
    args = body.get("args") if isinstance(body, dict) else None
    return args.get("id") if isinstance(args, dict) else None


def _live(command: Seen, at: float) -> bool:
    """Whether the server could still count the command in flight at `at` (epoch seconds)."""
    deadline = command.body.get("deadline") if isinstance(command.body, dict) else None
    try:
        return at < datetime.fromisoformat(str(deadline).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return True


def _ack_problems(seen: Seen) -> str:
    return (
        ""
        if isinstance(seen.body, dict) and isinstance(seen.body.get("id"), str)
        else f"ack {_short(seen.body)}"
    )


def _progress_problems(seen: Seen) -> str:
    body = seen.body if isinstance(seen.body, dict) else {}
    value = body.get("progress")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        return f"progress is not a number 0..100: {_short(seen.body)}"
    if "detail" in body and not isinstance(body["detail"], (str, dict)):
        return f"progress detail is not text: {_short(seen.body)}"
    return ""


def _done_problems(body: Any, *, ok: bool) -> str:
    if not isinstance(body, dict):
        return f"done is not a JSON object: {_short(body)}"
    if body.get("ok") is not ok:
        return f"done has ok={body.get('ok')!r}, expected {ok} (a JSON boolean): {_short(body)}"
    if ok and body.get("result") is not None and not isinstance(body["result"], dict):
        return f"done's result is not an object: {_short(body)}"
    return ""


def table(results: list[CaseResult]) -> str:
    """The results as a fixed-width table, one row per case."""
    width = max(len(result.name) for result in results)
    lines = [f"{'case':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{r.name:<{width}}  {r.outcome:<6}  {r.detail}" for r in results]
    failed = sum(result.outcome == FAIL for result in results)
    lines.append(f"{len(results) - failed} of {len(results)} cases passed or skipped, {failed} failed")
    return "\n".join(lines)
