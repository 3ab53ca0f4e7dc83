"""Where kinds plug into the engine: step kinds, row owners, failure policies, deadline kinds.

Each kind declares what it does with a decorator beside its own definition (Zulip's
`@assign_queue`): `@step_kind(StepKind.DELAY)` on the function that starts a delay step,
`@row_ended(Phase.COMPENSATION)`, `@failure_policy(OnFailure.ROLLBACK)`,
`@attempt_sender(StepKind.TASK)`, `@row_deadline(StepKind.DELAY)`,
`@row_resume(StepKind.WAIT_ONLINE)`, `@deadline_handler("queue")`, `@run_deadline("run")`,
`@step_compensation(FANOUT)`.
The generic code asks here (`spec_behaviour`, `row_behaviour`, `row_ended_handler`, …)
instead of testing a kind.

jobs/apps.py imports the modules that declare kinds (its `KIND_MODULES`) when the app loads
and calls `kinds_check`: a kind with no registration, or one registered twice, stops the
app with ImproperlyConfigured naming it, instead of a KeyError mid-run. This module is the
engine's lowest but for plan.py: it imports no stage, so every stage may ask it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured

from ..deadlines import KINDS, RUN_KINDS
from ..models import JobRun, OnFailure, Phase, StepKind, StepRun
from .plan import FANOUT, spec_kind, step_spec

# Failure policies the run's continuation handles itself (jobs/engine/runs.py).
BUILT_IN_POLICIES = (OnFailure.ABORT, OnFailure.CONTINUE)
# Deadline kinds the planner decides for every row (jobs/engine/planner.py `dues_plan`):
# an attempt's `ack` and `done`, a back-off's `retry`, a spaced or lost `dispatch`, a
# `queue` wait, a held command's `window`. They have no handler; a kind that takes its
# rows' deadlines over (`row_deadline`: a delay) still gets them.
PLANNED_DEADLINES = ("ack", "done", "retry", "dispatch", "queue", "window")

StepStarter = Callable[[JobRun, int], None]  # raises start.StepRefused
RowEnded = Callable[[StepRun], None]
RowResume = Callable[..., Any]  # (step_run=...)
FailurePolicy = Callable[[JobRun, str], None]  # (run, reason)
AttemptSender = Callable[..., bool]  # (step_run=...) -> sent
DeadlineHandler = Callable[[StepRun, Any], None]  # (step_run, deadlines.Deadline)
RunDeadlineHandler = Callable[[str], None]  # (run id)
StepCompensation = Callable[[JobRun, int], bool]  # (run, index) -> still at work on that step
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class StepKindBehaviour:
    """What the generic stages ask about a step kind; the defaults are a plain command's
    except where batching is concerned (a kind opts in)."""

    start: StepStarter
    # A plan names the step's row itself when the run moves on to it (planner_locks.rows_name);
    # other kinds start the general way (`start`), their rows made as a plan too.
    batched_start: bool = False
    # A plan may dispatch the kind's rows when they have their lock (or need none), and
    # the executor sends their attempts after the commit (a command, or the kind's
    # `attempt_sender`); a kind whose rows dispatch nothing (delay, wait_online) says no.
    batched_dispatch: bool = False
    # How a row fails that waited past its queue deadline (planner.dues_plan).
    queue_timeout_error: str = "waited {seconds}s for device {device} ({why})"
    # Why a device's request to extend an attempt is refused whatever it asks; "" = it may.
    extend_refused: str = ""
    # Whether a rollback undoes the step with its compensation (jobs/engine/rollback.py).
    compensable: bool = True


@dataclass
class KindRegistry:
    """Every registration, by table and key; `doubled` lists keys registered twice."""

    step_kinds: dict[str, StepKindBehaviour] = field(default_factory=dict)
    row_ended: dict[str, RowEnded] = field(default_factory=dict)
    failure_policies: dict[str, FailurePolicy] = field(default_factory=dict)
    attempt_senders: dict[str, AttemptSender] = field(default_factory=dict)
    row_deadlines: dict[str, DeadlineHandler] = field(default_factory=dict)
    row_resumers: dict[str, RowResume] = field(default_factory=dict)
    deadline_handlers: dict[str, DeadlineHandler] = field(default_factory=dict)
    run_deadlines: dict[str, RunDeadlineHandler] = field(default_factory=dict)
    compensations: dict[str, StepCompensation] = field(default_factory=dict)
    doubled: list[str] = field(default_factory=list)

    def add(self, table: str, key: str, value: Any) -> None:
        entries = getattr(self, table)
        if key in entries and _origin(entries[key]) != _origin(value):
            self.doubled.append(f"{table} {key!r} ({_origin(entries[key])} and {_origin(value)})")
        # The same definition again (its module re-imported) replaces itself.
        entries[key] = value

    def copy(self) -> KindRegistry:
        tables = {name: dict(getattr(self, name)) for name in TABLES}
        return KindRegistry(**tables, doubled=list(self.doubled))


TABLES = (
    "step_kinds",
    "row_ended",
    "failure_policies",
    "attempt_senders",
    "row_deadlines",
    "row_resumers",
    "deadline_handlers",
    "run_deadlines",
    "compensations",
)
REGISTRY = KindRegistry()


def _origin(value: Any) -> str:
    function = value.start if isinstance(value, StepKindBehaviour) else value
    return f"{function.__module__}.{function.__qualname__}"


def _registering(table: str, *keys: str, make: Callable[[Any], Any] = lambda f: f) -> Callable[[F], F]:
    def register(function: F) -> F:
        for key in keys:
            REGISTRY.add(table, str(key), make(function))
        return function

    return register


def step_kind(kind: str, **behaviour: Any) -> Callable[[F], F]:
    """Decorates how a step of `kind` starts; `behaviour` sets StepKindBehaviour's fields."""
    return _registering("step_kinds", kind, make=lambda start: StepKindBehaviour(start=start, **behaviour))


def row_ended(owner: str) -> Callable[[F], F]:
    """Decorates who moves a run on when a row ended for good that is not its step's whole
    outcome: rows of a phase other than forward, or forward rows of a step kind (a fan-out)."""
    return _registering("row_ended", owner)


def failure_policy(policy: str) -> Callable[[F], F]:
    """Decorates what a step's failure does under an on_failure policy other than abort/continue."""
    return _registering("failure_policies", policy)


def attempt_sender(kind: str) -> Callable[[F], F]:
    """Decorates how an attempt of `kind` is sent when it is not an MQTT command to its device."""
    return _registering("attempt_senders", kind)


def row_deadline(kind: str) -> Callable[[F], F]:
    """Decorates what any due deadline of a row of step `kind` does, whatever its deadline kind."""
    return _registering("row_deadlines", kind)


def row_resume(kind: str) -> Callable[[F], F]:
    """Decorates what a queued row of step `kind` does when it gets another chance (its device
    came online, the monitor's sweep, a lock rebuild); by default it asks for its device's lock."""
    return _registering("row_resumers", kind)


def deadline_handler(*kinds: str) -> Callable[[F], F]:
    """Decorates what a due deadline of a step row of these kinds (jobs/deadlines.py) does."""
    return _registering("deadline_handlers", *kinds)


def run_deadline(kind: str) -> Callable[[F], F]:
    """Decorates what a due deadline that names a run (deadlines.RUN_KINDS) does."""
    return _registering("run_deadlines", kind)


def step_compensation(kind: str) -> Callable[[F], F]:
    """Decorates how a rollback undoes a step of `kind` when it is not one compensation row
    on the step's device (jobs/engine/rollback.py): a fan-out undoes it on each device."""
    return _registering("compensations", kind)


def spec_behaviour(spec: dict[str, Any]) -> StepKindBehaviour:
    """The behaviour of the step kind a plan entry starts as."""
    return REGISTRY.step_kinds[spec_kind(spec)]


def row_behaviour(step_run: StepRun) -> StepKindBehaviour:
    """The behaviour of the kind a row executes (a compensation: a command or a task)."""
    return REGISTRY.step_kinds[spec_kind(step_spec(step_run))]


def row_batched(step_run: StepRun) -> bool:
    """Whether the batched path may dispatch the row when it has its lock."""
    return row_behaviour(step_run).batched_dispatch


def row_commanded(step_run: StepRun) -> bool:
    """Whether the row's attempts are MQTT commands to its device: a kind that sends its
    attempts its own way (`attempt_sender`, a task step) sends the device nothing."""
    return spec_kind(step_spec(step_run)) not in REGISTRY.attempt_senders


def row_deadline_handler(step_run: StepRun) -> Callable | None:
    """What every due deadline of the row does when its kind takes them over, or None."""
    return REGISTRY.row_deadlines.get(spec_kind(step_spec(step_run)))


def row_resume_handler(step_run: StepRun) -> RowResume | None:
    """What a queued row does when it gets another chance, or None: it asks for the lock."""
    return REGISTRY.row_resumers.get(spec_kind(step_spec(step_run)))


def row_ended_handler(step_run: StepRun) -> RowEnded | None:
    """Who moves the run on when this row ended, or None when the row is its step's outcome."""
    if step_run.phase != Phase.FORWARD:
        return REGISTRY.row_ended[step_run.phase]
    return REGISTRY.row_ended.get(spec_kind(step_run.run.plan[step_run.index]))


def step_compensation_handler(spec: dict[str, Any]) -> StepCompensation | None:
    """How a rollback undoes the step a plan entry starts as, or None: one compensation row."""
    return REGISTRY.compensations.get(spec_kind(spec))


def failure_policy_handler(policy: str) -> FailurePolicy | None:
    """What a step's failure does under `policy`, or None for abort and continue."""
    return REGISTRY.failure_policies.get(policy)


def kinds_expected() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per table, the keys it must hold and the keys it may hold: the choices the models
    and the deadline set offer."""
    steps = (*StepKind.values, FANOUT)
    phases = tuple(phase for phase in Phase.values if phase != Phase.FORWARD)
    policies = tuple(policy for policy in OnFailure.values if policy not in BUILT_IN_POLICIES)
    step_deadlines = tuple(kind for kind in KINDS if kind not in (*RUN_KINDS, *PLANNED_DEADLINES))
    return {
        "step_kinds": (steps, steps),
        "row_ended": (phases, (*phases, *steps)),
        "failure_policies": (policies, policies),
        "attempt_senders": ((), steps),  # a plain command by default
        "row_deadlines": ((), steps),
        "row_resumers": ((), steps),
        "deadline_handlers": (step_deadlines, step_deadlines),
        "run_deadlines": (RUN_KINDS, RUN_KINDS),
        "compensations": ((), steps),  # one compensation row by default
    }


def kinds_check(registry: KindRegistry | None = None) -> None:
    """Raise ImproperlyConfigured naming every kind without a registration, registered for
    nothing the models or the deadline set know, or registered twice (the app's registry
    unless given)."""
    registry = REGISTRY if registry is None else registry
    problems = [f"registered twice: {doubled}" for doubled in registry.doubled]
    for table, (required, allowed) in kinds_expected().items():
        entries = getattr(registry, table)
        problems += [f"no {table} entry for {key!r}" for key in required if key not in entries]
        problems += [f"{table} entry {key!r} is no such kind" for key in entries if key not in allowed]
    if problems:
        where = "declare each with its decorator in a module of jobs.apps.KIND_MODULES"
        raise ImproperlyConfigured(f"step engine kinds: {'; '.join(problems)} ({where})")
