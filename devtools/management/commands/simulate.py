"""`manage.py simulate`: run simulated devices until a signal or --duration; exit 3 on a lock overlap.

With --from-db it follows the Device table (devtools/fleet.py): devices created later are
played too, deleted or disabled ones dropped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from devtools.fleet import FleetFollower
from devtools.simulator import DeviceBehaviour, Simulator

log = logging.getLogger(__name__)

# How often the stats file is rewritten: the dev stack and benchmarks poll it about this often.
STATS_INTERVAL_SECONDS = 1.0
# Exit status when any device saw two commands in flight: distinct from Django's 1 (error).
EXIT_OVERLAP = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How often --from-db looks at the Device table (one aggregate query): a device created in the
# admin is online within about this long, and an idle table costs next to nothing.
FOLLOW_SECONDS = 2.0
# How long the devices in the table at start get to subscribe before the command gives up.
CONNECT_SECONDS = 10.0


class Command(BaseCommand):
    help = "Run simulated devices that answer commands over MQTT and report lock violations."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--count", type=int, default=0, help="simulate N devices named <prefix>1..N")
        parser.add_argument("--prefix", default="sim-", help="name prefix for --count (default sim-)")
        parser.add_argument("--devices", default="", help="comma-separated device names")
        parser.add_argument(
            "--from-db",
            action="store_true",
            help="every enabled Device row, with overrides, following the table: devices created "
            "later are played too, deleted or disabled ones dropped",
        )
        parser.add_argument(
            "--follow-seconds",
            type=float,
            default=FOLLOW_SECONDS,
            help=f"with --from-db: how often to look for changed devices (default {FOLLOW_SECONDS:g}; "
            "0 = read the table once at start)",
        )
        parser.add_argument(
            "--own-credentials",
            action="store_true",
            help="with --from-db: each device logs in as itself, with a new password issued when "
            "it starts being played (replacing its current one: for simulated devices only)",
        )
        parser.add_argument("--latency-ms", default="20,80", help="reply latency range MIN,MAX in ms")
        parser.add_argument("--failure-rate", type=float, default=0.0, help="probability of ok=false")
        parser.add_argument("--heartbeat", type=float, default=10.0, help="seconds between heartbeats")
        parser.add_argument("--stats-file", default="", help="write stats JSON here every second and at exit")
        parser.add_argument("--duration", type=float, default=0.0, help="seconds to run; 0 = until signal")
        parser.add_argument("--seed", type=int, default=None, help="random seed for latencies and failures")

    def handle(self, *args: Any, **options: Any) -> None:
        base = self._base(options)
        devices = self._named(options, base)
        if not devices and not options["from_db"]:
            raise CommandError("no devices: give --count, --devices or --from-db")
        try:
            simulator = Simulator(devices, heartbeat_interval=options["heartbeat"], seed=options["seed"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        # Devices from the database may log in as themselves where iotqueue manages the
        # broker's identities: the simulator issues each a fresh password, replacing the one
        # a real device has, hence opt-in.
        follower = None
        if options["from_db"]:
            follower = FleetFollower(simulator, base, own_credentials=options["own_credentials"])
        stats_file = Path(options["stats_file"]) if options["stats_file"] else None
        stopping = threading.Event()
        previous = {}
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            previous = {signum: signal.signal(signum, lambda *_: stopping.set()) for signum in STOP_SIGNALS}
        try:
            self._start(simulator, follower, options["follow_seconds"])
            follow = follower if options["follow_seconds"] > 0 else None
            self._run(simulator, stopping, stats_file, options["duration"], follow, options["follow_seconds"])
        finally:
            simulator.stop(graceful=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        stats = simulator.stats()
        if stats_file:
            _stats_write(stats_file, stats)
        totals = stats["totals"]
        self.stdout.write(
            f"simulate: {totals['devices']} devices, {totals['commands']} commands, "
            f"{totals['overlaps']} overlaps, {totals['token_regressions']} token regressions, "
            f"{totals['duplicates']} duplicates, {totals['failures']} failures, {totals['canceled']} canceled"
        )
        if totals["overlaps"]:
            sys.exit(EXIT_OVERLAP)

    def _start(self, simulator: Simulator, follower: FleetFollower | None, follow_seconds: float) -> None:
        """Connect the named devices, then those in the table, and wait for their SUBACKs."""
        try:
            simulator.start(wait_connected=CONNECT_SECONDS)
        except TimeoutError as exc:
            raise CommandError(str(exc)) from None
        if follower is not None:
            played = follower.sync().added
            missing = simulator.wait_subscribed(played, CONNECT_SECONDS)
            if missing:
                raise CommandError(
                    f"{len(missing)} simulated devices not subscribed after {CONNECT_SECONDS:g}s: "
                    f"{', '.join(missing[:10])}"
                )
            if not simulator.devices and follow_seconds <= 0:
                raise CommandError("no devices: no enabled Device row (and --follow-seconds 0)")
        # The dev stack waits for this line; with --from-db more devices may follow.
        log.info("simulate: %d devices online", len(simulator.devices))

    def _base(self, options: dict[str, Any]) -> DeviceBehaviour:
        try:
            low, high = (float(part) for part in options["latency_ms"].split(","))
            return DeviceBehaviour(
                latency_min_ms=low, latency_max_ms=high, failure_rate=options["failure_rate"]
            )
        except ValueError as exc:
            raise CommandError(f"bad --latency-ms or --failure-rate: {exc}") from None

    def _named(self, options: dict[str, Any], base: DeviceBehaviour) -> dict[str, DeviceBehaviour]:
        """The devices given by --count and --devices (not in the table, or not followed)."""
        names = [f"{options['prefix']}{n}" for n in range(1, options["count"] + 1)]
        names += [name.strip() for name in options["devices"].split(",") if name.strip()]
        return dict.fromkeys(names, base)

    def _run(
        self,
        simulator: Simulator,
        stopping: threading.Event,
        stats_file: Path | None,
        duration: float,
        follower: FleetFollower | None,
        follow_seconds: float,
    ) -> None:
        deadline = time.monotonic() + duration if duration > 0 else None
        tick = min(STATS_INTERVAL_SECONDS, follow_seconds) if follower else STATS_INTERVAL_SECONDS
        next_follow = time.monotonic() + follow_seconds
        while not stopping.is_set():
            remaining = deadline - time.monotonic() if deadline is not None else tick
            if remaining <= 0:
                return
            stopping.wait(min(remaining, tick))
            if follower is not None and time.monotonic() >= next_follow:
                follower.poll()
                next_follow = time.monotonic() + follow_seconds
            if stats_file:
                _stats_write(stats_file, simulator.stats())


def _stats_write(path: Path, stats: dict[str, Any]) -> None:
    """Replace the stats file atomically, so a reader never sees half a JSON document."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(stats, indent=1, sort_keys=True))
    os.replace(temporary, path)
