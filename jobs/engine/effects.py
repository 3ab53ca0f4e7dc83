"""The effect plan of one transition: what it writes, takes and publishes, built stage by
stage by the planner (jobs/engine/planner.py, jobs/engine/planner_locks.py) and carried out
by the executor (jobs/engine/executor.py) or the unit tier's in-memory world.

`RowWrite` is a compare-and-set UPDATE, `NewRow` a row a kind's start asks for, `Later`
one-at-a-time work after the commit; `Plan` holds them with the events, the lock call's
operations, the deadlines and the commands to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Model

from devices.locks import Grant, LockBatch
from devices.models import Device

from ..deadlines import Deadline, by_shard, deadline_score
from ..events import EventLog
from ..limits import Limit
from ..models import (
    JobRun,
    Phase,
    StepRun,
)
from .attempts import Outcome
from .dispatch import Attempt


@dataclass
class RowWrite:
    """A compare-and-set UPDATE of `rows`' `fields` while their status is one of `status_in`
    (and `match` still holds the value the row has); `conflict` says what moved when a row
    count falls short. `after_locks`: a conflict found after the lock call (undo it first)."""

    model: type[Model]
    rows: list
    fields: list[str]
    status_in: tuple
    match: str = ""
    conflict: str = ""
    after_locks: bool = False


@dataclass
class Later:
    """One-at-a-time work after the commit, for what a plan does not decide: `what` names
    it (LATER_WORK in jobs/engine/batch.py), `args` are its keyword arguments."""

    what: str
    args: dict[str, Any]


@dataclass(frozen=True)
class NewRow:
    """A row a kind's start asks a plan to make (`batch.row_create`): the step at `index`
    on `device` (None: a task step with no target), queued, asking for its device's lock
    when `acquire`."""

    run: JobRun
    index: int
    device: Device | None
    action: str
    args: dict
    phase: str = Phase.FORWARD
    acquire: bool = True


@dataclass
class Plan:
    """What one transition writes, takes and publishes, built stage by stage."""

    now: datetime
    events: EventLog = field(default_factory=EventLog)
    # Compare-and-set writes sent before the lock call, in order.
    writes: list[RowWrite] = field(default_factory=list)
    later: list[Later] = field(default_factory=list)
    locks: LockBatch = field(default_factory=LockBatch)
    releases: dict[int, StepRun] = field(default_factory=dict)  # lock op index -> ended row
    dequeues: set[int] = field(default_factory=set)  # lock op indexes: rows leaving a queue
    extends: set[int] = field(default_factory=set)  # lock op indexes: leases extended
    acquires: dict[int, tuple[StepRun, Attempt]] = field(default_factory=dict)  # op -> new row
    lockless: list[tuple[StepRun, Attempt]] = field(default_factory=list)  # rows with no device
    acks: dict[int, StepRun] = field(default_factory=dict)
    ended: list[tuple[StepRun, Outcome]] = field(default_factory=list)
    starting: list[JobRun] = field(default_factory=list)  # runs whose next row is named
    naming: list[tuple[JobRun, dict, str]] = field(default_factory=list)  # (run, spec, device)
    creating: list[NewRow] = field(default_factory=list)  # rows a kind's start asked for
    new_rows: list[StepRun] = field(default_factory=list)  # inserted whole at the end
    handed: list[tuple[str, Grant]] = field(default_factory=list)
    dispatches: list[StepRun] = field(default_factory=list)  # published after the commit
    cancels: list[StepRun] = field(default_factory=list)  # their device is sent a `cancel`
    queued: dict[str, StepRun] = field(default_factory=dict)  # device -> a row that joined its queue
    run_deadlines: dict[Deadline, datetime] = field(default_factory=dict)  # after the commit
    rebuild: bool = False  # Redis lost the locks: rebuild them after the commit
    quiet: bool = False  # no `step.waiting` events (the monitor's sweep asking again)
    # Facts: seconds until each flow-controlled device may get its next command (the
    # executor reads them for the devices a stage may dispatch to: devices.flow).
    waits: dict[str, float] = field(default_factory=dict)
    # The enabled shared concurrency limits (jobs/limits.py), read by the executor: the
    # slots each acquire asks for with its device's lock.
    limits: list[Limit] = field(default_factory=list)
    flow_sent: list[Device] = field(default_factory=list)  # flow-controlled, sent to now
    unplanned: list[Deadline] = field(default_factory=list)  # for jobs/engine/due.py's handlers
    # Facts: the group names of devices whose run has group maintenance windows (holds.py).
    groups: dict[str, frozenset[str]] = field(default_factory=dict)
    held: RowWrite | None = None  # held rows' new queue deadlines (`_held`)

    def write(self, model: type[Model], rows: list, fields: list[str], **guard: Any) -> None:
        if rows:
            self.writes.append(RowWrite(model, list(rows), fields, **guard))

    def later_add(self, what: str, **args: Any) -> None:
        self.later.append(Later(what, args))

    def zset_add(self, entries: dict[Deadline, datetime]) -> None:
        """Deadlines the lock call writes whatever its outcomes, each in its shard."""
        for shard, group in by_shard(entries).items():
            self.locks.zset_add({d.member: deadline_score(entries[d]) for d in group}, shard=shard)

    def zset_remove(self, deadlines: list[Deadline]) -> None:
        for shard, group in by_shard(deadlines).items():
            self.locks.zset_remove([d.member for d in group], shard=shard)
