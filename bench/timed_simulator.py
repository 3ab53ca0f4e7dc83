"""The project's device simulator, plus the one timestamp it does not keep: when `done` left.

Received commands already carry `at` (time.time() when the device got them, in the
device's network thread). TimedDevice also notes time.time() just before it publishes each
`done`, so hand-off latency is the difference of two readings of one clock in one process.
It reaches into SimulatedDevice's private `_reply`, `_received` and `_client`; a `done_at`
on the received record and TCP_NODELAY in iotqueue.mqtt.client_create would make this
module unnecessary.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import django

from devtools.simulator import DeviceBehaviour, SimulatedDevice, Simulator
from iotqueue.gcfreeze import startup_objects_freeze

# Devices answer at once: the benchmark measures the system's overhead, not device time.
# Progress messages are off (each one is a task); the protocol's ack cannot be turned off.
INSTANT = DeviceBehaviour(latency_min_ms=0.0, latency_max_ms=0.0, progress=False)


class TimedDevice(SimulatedDevice):
    """A simulated device that records when it published each command's `done`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.done_at: dict[str, float] = {}
        # Unbounded: a benchmark is finite, and a truncated history would drop samples.
        self._received = deque()

    def _reply(self, kind: str, payload: bytes) -> None:
        if kind == "done":
            self.done_at.setdefault(json.loads(payload)["id"], time.time())
        super()._reply(kind, payload)


class TimedSimulator(Simulator):
    """A Simulator whose devices are TimedDevices (TCP_NODELAY comes from client_create)."""

    def __init__(self, devices: dict[str, DeviceBehaviour], *, url: str, seed: int) -> None:
        super().__init__(devices, url=url, seed=seed)
        rng = random.Random(seed)
        self.devices = {
            name: TimedDevice(name, behaviour, timers=self._timers, rng=rng, url=url)
            for name, behaviour in devices.items()
        }


class SimulatorProcess:
    """A TimedSimulator in a child process of its own.

    A fleet does not run in the process that starts runs: in one process the hundred
    devices' network threads and the bench's own work (starting runs, polling the database)
    wait on one another for the GIL, and each database or Redis round trip of a run start
    waited up to a switch interval for it. The child is spawned (no state of this process
    is copied), sets Django up from the same environment, and answers `stats()` and
    `deliveries()` over a pipe.
    """

    def __init__(self, devices: dict[str, DeviceBehaviour], *, url: str, seed: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_simulator_serve, args=(child, devices, url, seed), name="bench-simulator", daemon=True
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._process.start()
        self._answer()  # every device connected and subscribed

    def stats(self) -> dict[str, Any]:
        return self._ask("stats")

    def deliveries(self) -> list[Delivery]:
        return self._ask("deliveries")

    def stop(self) -> None:
        if self._process.is_alive():
            try:
                self._ask("stop")
            except (EOFError, OSError):
                pass
            self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()

    def _ask(self, what: str) -> Any:
        self._conn.send(what)
        return self._answer()

    def _answer(self) -> Any:
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"bench simulator process: {value}")
        return value


def _simulator_serve(conn, devices: dict[str, DeviceBehaviour], url: str, seed: int) -> None:
    """The child's side of SimulatorProcess: run the simulator, answer until `stop`."""
    django.setup()
    simulator = TimedSimulator(devices, url=url, seed=seed)
    try:
        simulator.start()
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    # The simulated devices stand for hardware: their process's full collections (~50-80 ms
    # with everything Django imported) would show up as the system's latency.
    startup_objects_freeze("bench simulator")
    conn.send(("ok", None))
    while True:
        what = conn.recv()
        try:
            if what == "stats":
                conn.send(("ok", simulator.stats()))
            elif what == "deliveries":
                conn.send(("ok", deliveries(simulator)))
            elif what == "stop":
                simulator.stop()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown request {what!r}"))
        except Exception as exc:
            conn.send(("error", repr(exc)))


@dataclass(frozen=True)
class Delivery:
    """One command as a device saw it: when it arrived and when the device published done."""

    device: str
    run: str
    step: int
    command_id: str
    received_at: float
    done_at: float | None


def deliveries(simulator: TimedSimulator) -> list[Delivery]:
    """Every first delivery of every command, all devices, in arrival order per device."""
    found = []
    for name, device in simulator.devices.items():
        done_at = dict(device.done_at)
        for record in device.received():
            if record["duplicate"] or not isinstance(record["run"], str):
                continue
            found.append(
                Delivery(
                    name, record["run"], record["step"], record["id"], record["at"], done_at.get(record["id"])
                )
            )
    return found


def handoffs(found: list[Delivery], runs: set[str]) -> tuple[list[float], list[float]]:
    """Hand-off samples in seconds for the given runs, two ways.

    For steps n >= 1 of a run: run = step n's command arriving minus step n-1's done leaving,
    waits for a busy device included; ready = step n's command arriving minus the moment it
    could first have gone, the later of step n-1's done and the done of the command its device
    ran just before it, which leaves the wait for the device out.
    """
    by_step = {(d.run, d.step): d for d in found}  # a retried step keeps its last attempt
    previous_on_device: dict[str, float | None] = {}
    run_samples, ready_samples = [], []
    for d in sorted(found, key=lambda d: d.received_at):
        device_free = previous_on_device.get(d.device)
        previous_on_device[d.device] = d.done_at
        if d.run not in runs:
            continue
        before = by_step.get((d.run, d.step - 1))
        if before is None or before.done_at is None:
            continue  # a run's first step: its ready moment is not a device-side event
        run_samples.append(d.received_at - before.done_at)
        ready_samples.append(d.received_at - max(before.done_at, device_free or 0.0))
    return run_samples, ready_samples
