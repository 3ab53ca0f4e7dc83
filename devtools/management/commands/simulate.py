"""`manage.py simulate`: run simulated devices until a signal or --duration; exit 3 on a lock overlap."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from devtools.simulator import DeviceBehaviour, Simulator

log = logging.getLogger(__name__)

# How often the stats file is rewritten: the dev stack and benchmarks poll it about this often.
STATS_INTERVAL_SECONDS = 1.0
# Exit status when any device saw two commands in flight: distinct from Django's 1 (error).
EXIT_OVERLAP = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Command(BaseCommand):
    help = "Run simulated devices that answer commands over MQTT and report lock violations."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--count", type=int, default=0, help="simulate N devices named <prefix>1..N")
        parser.add_argument("--prefix", default="sim-", help="name prefix for --count (default sim-)")
        parser.add_argument("--devices", default="", help="comma-separated device names")
        parser.add_argument("--from-db", action="store_true", help="every enabled Device row, with overrides")
        parser.add_argument(
            "--own-credentials",
            action="store_true",
            help="with --from-db: each device logs in as itself, with a new password issued now "
            "(replacing its current one: for simulated devices only)",
        )
        parser.add_argument("--latency-ms", default="20,80", help="reply latency range MIN,MAX in ms")
        parser.add_argument("--failure-rate", type=float, default=0.0, help="probability of ok=false")
        parser.add_argument("--heartbeat", type=float, default=10.0, help="seconds between heartbeats")
        parser.add_argument("--stats-file", default="", help="write stats JSON here every second and at exit")
        parser.add_argument("--duration", type=float, default=0.0, help="seconds to run; 0 = until signal")
        parser.add_argument("--seed", type=int, default=None, help="random seed for latencies and failures")

    def handle(self, *args: Any, **options: Any) -> None:
        devices = self._devices(options)
        # Devices from the database may log in as themselves where iotqueue manages the
        # broker's identities: the simulator issues each a fresh password, replacing the one
        # a real device has, hence opt-in.
        own = options["from_db"] and options["own_credentials"]
        passwords = _passwords_issue(list(devices)) if own else {}
        try:
            simulator = Simulator(
                devices, passwords=passwords, heartbeat_interval=options["heartbeat"], seed=options["seed"]
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        stats_file = Path(options["stats_file"]) if options["stats_file"] else None
        stopping = threading.Event()
        previous = {}
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            previous = {signum: signal.signal(signum, lambda *_: stopping.set()) for signum in STOP_SIGNALS}
        try:
            try:
                simulator.start()
            except TimeoutError as exc:
                raise CommandError(str(exc)) from None
            log.info("simulate: %d devices online", len(devices))
            self._run(simulator, stopping, stats_file, options["duration"])
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

    def _devices(self, options: dict[str, Any]) -> dict[str, DeviceBehaviour]:
        try:
            low, high = (float(part) for part in options["latency_ms"].split(","))
            base = DeviceBehaviour(
                latency_min_ms=low, latency_max_ms=high, failure_rate=options["failure_rate"]
            )
        except ValueError as exc:
            raise CommandError(f"bad --latency-ms or --failure-rate: {exc}") from None
        names = [f"{options['prefix']}{n}" for n in range(1, options["count"] + 1)]
        names += [name.strip() for name in options["devices"].split(",") if name.strip()]
        devices = dict.fromkeys(names, base)
        if options["from_db"]:
            devices.update(_devices_from_db(base))
        if not devices:
            raise CommandError("no devices: give --count, --devices or --from-db")
        return devices

    def _run(
        self, simulator: Simulator, stopping: threading.Event, stats_file: Path | None, duration: float
    ) -> None:
        deadline = time.monotonic() + duration if duration > 0 else None
        while not stopping.is_set():
            remaining = deadline - time.monotonic() if deadline is not None else STATS_INTERVAL_SECONDS
            if remaining <= 0:
                return
            stopping.wait(min(remaining, STATS_INTERVAL_SECONDS))
            if stats_file:
                _stats_write(stats_file, simulator.stats())


def _devices_from_db(base: DeviceBehaviour) -> dict[str, DeviceBehaviour]:
    """Behaviour of every enabled Device row: its topic overrides plus config["simulator"] knobs."""
    from devices.models import Device  # lazy: the simulator itself needs no database

    behaviours = {}
    rows = Device.objects.filter(enabled=True).order_by("name")
    for name, command_topic, reply_topic, config in rows.values_list(
        "name", "command_topic", "reply_topic", "config"
    ):
        knobs = config.get("simulator") if isinstance(config, dict) else None
        try:
            behaviour = base.configured(knobs) if isinstance(knobs, dict) else base
        except ValueError as exc:
            raise CommandError(f"device {name}: config['simulator']: {exc}") from None
        behaviours[name] = replace(
            behaviour, command_topic=command_topic or "", reply_topic=reply_topic or ""
        )
    return behaviours


def _passwords_issue(names: list[str]) -> dict[str, str]:
    from devices.credentials import device_password_issue, managed  # lazy, as above
    from devices.models import Device

    if not managed():
        return {}
    return {device.name: device_password_issue(device) for device in Device.objects.filter(name__in=names)}


def _stats_write(path: Path, stats: dict[str, Any]) -> None:
    """Replace the stats file atomically, so a reader never sees half a JSON document."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(stats, indent=1, sort_keys=True))
    os.replace(temporary, path)
