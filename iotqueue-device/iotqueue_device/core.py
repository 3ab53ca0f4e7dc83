"""What a device does with each command and jobs/current answer: the protocol's rules, pure.

`CommandBook` holds what a device knows (the highest token seen, the commands in flight, the
ids it finished and the `done` it sent for each) and turns every incoming command or answer
into a `Decision`: run it, a duplicate, stale (a lower token), expired (its deadline passed),
or a cancel; a command that runs may supersede those in flight with a lower token. It opens
no socket, reads no clock (the caller passes `now`) and writes no file (`snapshot` and
`restore` give the state as JSON-safe values), so the MQTT `Agent`, iotqueue's simulator and
the unit tests share one implementation of docs/protocol.md ("Late commands", "Asking for the
current command", "Cancel").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .protocol import Command, ProtocolError, command_parse

# Finished command ids remembered to tell a redelivery from a new command. QoS 1 redelivery
# and the server's re-sends come within one lease, i.e. a handful of commands.
FINISHED_KEPT = 64
# The snapshot's format: restore() refuses another (a state file from a newer library).
SNAPSHOT_VERSION = 1


class Verdict(StrEnum):
    """What to do with an incoming command."""

    RUN = "run"  # start it (resume it, when `Decision.resumed`)
    DUPLICATE = "duplicate"  # seen already: carry on, or send `Decision.replay` again
    STALE = "stale"  # its token is lower than one seen: do not start it, do not answer it
    EXPIRED = "expired"  # its deadline has passed: do not start it, do not answer it
    CANCEL = "cancel"  # abort `Decision.target` if it is in flight, then answer both
    IDLE = "idle"  # a jobs/current answer naming nothing (or nothing new)


@dataclass(frozen=True)
class Decision:
    """A verdict on one command, with what else changed.

    superseded: commands in flight that stop here without a `done` (a higher token came, or
    jobs/current says the server no longer counts them); live: the commands in flight whose
    deadline had not passed when this one arrived (before any was superseded); replay: for a
    finished duplicate, the `done` to send again (None: send nothing); resumed: the command
    was known before a reboot or named by jobs/current.
    """

    verdict: Verdict
    command: Command | None
    reason: str = ""
    superseded: tuple[str, ...] = ()
    live: tuple[str, ...] = ()
    replay: dict[str, Any] | None = None
    resumed: bool = False
    target: str | None = None


@dataclass
class Flight:
    """A command the device executes (or executed before a reboot: `running` False until
    jobs/current or a redelivery confirms it). live_until: its deadline, later once the device
    asked for more time; None: no usable deadline."""

    command: Command
    running: bool
    live_until: float | None
    seq: int

    def live(self, now: float | None) -> bool:
        return now is None or self.live_until is None or now < self.live_until


@dataclass
class CommandBook:
    """One device's protocol state and the decisions drawn from it (not thread-safe: the
    caller serialises calls, e.g. under its own lock)."""

    fence: int | None = None
    flights: dict[str, Flight] = field(default_factory=dict)
    finished: OrderedDict[str, dict[str, Any] | None] = field(default_factory=OrderedDict)
    asked_seq: int = -1
    seq: int = 0

    def command(self, command: Command, now: float | None, *, resumed: bool = False) -> Decision:
        """Decide on a command from P/D/cmd/... (`now`: epoch seconds; None for a device whose
        clock is not set, which then skips the deadline rule)."""
        if command.cancel_target is not None:
            return self._cancel(command)
        known = self._known(command, resumed=resumed)
        if known is not None:
            return known
        if command.token is not None and self.fence is not None and command.token < self.fence:
            self.remember(command.id, None)
            return Decision(Verdict.STALE, command, f"token {command.token} below {self.fence}")
        if command.token is not None:
            self.fence = command.token
        if now is not None and command.deadline is not None and now >= command.deadline:
            self.remember(command.id, None)
            return Decision(Verdict.EXPIRED, command, f"deadline {command.body.get('deadline')} passed")
        live = tuple(command_id for command_id, flight in self.flights.items() if flight.live(now))
        superseded = self._supersede(command.token)
        self.flights[command.id] = Flight(command, True, command.deadline, self._next_seq())
        return Decision(Verdict.RUN, command, superseded=superseded, live=live, resumed=resumed)

    def current(self, command: Command | None, now: float | None) -> Decision:
        """Decide on a jobs/current answer. Naming nothing: the commands in flight since before
        the last question (asked()) have ended on the server, so they stop without a `done`;
        those that came after it may be newer than the answer and go on."""
        if command is None:
            ended = tuple(cid for cid, flight in self.flights.items() if flight.seq < self.asked_seq)
            for command_id in ended:
                self.abandon(command_id)
            return Decision(Verdict.IDLE, None, "nothing in flight on the server", superseded=ended)
        return self.command(command, now, resumed=True)

    def asked(self) -> None:
        """Note that jobs/get was published: commands in flight before it are what the answer
        is about."""
        self.asked_seq = self._next_seq()

    def extend(self, command_id: str, until: float) -> None:
        """The device asked for more time: count the command live until `until` at least."""
        flight = self.flights.get(command_id)
        if flight is not None and flight.live_until is not None:
            flight.live_until = max(flight.live_until, until)

    def finish(self, command_id: str, done: dict[str, Any]) -> bool:
        """The command is done; True when it was still in flight, so its `done` is to be sent
        (False: it was superseded, canceled or abandoned meanwhile; send nothing)."""
        if self.flights.pop(command_id, None) is None:
            return False
        self.remember(command_id, done)
        return True

    def abandon(self, command_id: str, done: dict[str, Any] | None = None) -> bool:
        """Stop a command in flight without running it further; `done` is what a redelivery
        of it is answered with (None: nothing). True when it was in flight."""
        if self.flights.pop(command_id, None) is None:
            return False
        self.remember(command_id, done)
        return True

    def forget_flights(self) -> list[str]:
        """A power cut without a state file: the commands in hand are forgotten (not finished),
        so jobs/current can hand them back. Returns their ids."""
        forgotten = list(self.flights)
        self.flights.clear()
        return forgotten

    def remember(self, command_id: str, done: dict[str, Any] | None) -> None:
        self.finished[command_id] = done
        self.finished.move_to_end(command_id)
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)

    def live(self, now: float | None) -> list[str]:
        """The commands in flight whose deadline has not passed."""
        return [command_id for command_id, flight in self.flights.items() if flight.live(now)]

    def snapshot(self) -> dict[str, Any]:
        """The state as JSON-safe values, for a state file (restore() reads it back)."""
        return {
            "version": SNAPSHOT_VERSION,
            "fence": self.fence,
            "flights": [
                {
                    "command": flight.command.body,
                    "action": flight.command.action,
                    "live_until": flight.live_until,
                }
                for flight in self.flights.values()
            ],
            "finished": [[command_id, done] for command_id, done in self.finished.items()],
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> CommandBook:
        """The state a snapshot recorded, after a reboot: its commands in flight wait for
        jobs/current (or a redelivery) to say they are still current before they run again.

        Raises ValueError for a snapshot this version cannot read.
        """
        if not isinstance(data, dict) or data.get("version") != SNAPSHOT_VERSION:
            raise ValueError("not a state snapshot of this version")
        book = cls(fence=data.get("fence") if isinstance(data.get("fence"), int) else None)
        for entry in data.get("flights") or []:
            try:
                command = command_parse(entry["command"], action=entry.get("action", ""))
            except (KeyError, TypeError, ProtocolError) as exc:
                raise ValueError(f"a command in the snapshot is unreadable: {exc}") from None
            book.flights[command.id] = Flight(command, False, entry.get("live_until"), book._next_seq())
        for command_id, done in data.get("finished") or []:
            book.remember(str(command_id), done if isinstance(done, dict) else None)
        return book

    def _known(self, command: Command, *, resumed: bool) -> Decision | None:
        """The decision for an id seen already: one in flight goes on (one restored from a
        state file starts again, confirmed), a finished one is answered again."""
        flight = self.flights.get(command.id)
        if flight is not None:
            if flight.running:
                return Decision(Verdict.DUPLICATE, command, "in flight already")
            flight.running, flight.command = True, command
            if command.deadline is not None:
                flight.live_until = max(command.deadline, flight.live_until or command.deadline)
            if command.token is not None and (self.fence is None or command.token > self.fence):
                self.fence = command.token
            return Decision(Verdict.RUN, command, "known before a reboot", resumed=True)
        if command.id in self.finished:
            return Decision(Verdict.DUPLICATE, command, "finished already", replay=self.finished[command.id])
        return None

    def _cancel(self, command: Command) -> Decision:
        if command.id in self.finished:
            return Decision(Verdict.DUPLICATE, command, "finished already", replay=self.finished[command.id])
        return Decision(Verdict.CANCEL, command, target=command.cancel_target)

    def _supersede(self, token: int | None) -> tuple[str, ...]:
        """Abandon the commands in flight with a lower token: the server grants a higher one
        only once their attempts ended, so their `done` would be recorded as stale."""
        if token is None:
            return ()
        lower = [cid for cid, flight in self.flights.items() if flight.command.token is not None]
        lower = [cid for cid in lower if self.flights[cid].command.token < token]
        for command_id in lower:
            self.abandon(command_id)
        return tuple(lower)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq
