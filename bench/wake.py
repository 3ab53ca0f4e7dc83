"""What one round trip to another process costs on this machine, busy and after a pause.

A hand-off crosses a dozen processes (device, broker, bridge, Redis, worker, database,
broker, device), each of which sleeps until its message arrives. On a machine whose idle
cores are slow to wake (a virtual machine's halted vCPU, deep C-states), every such wake
costs more than the work the process then does, and no change to the code removes it:
it sets a floor under the trickle and paced hand-offs that the saturated phase, where
nobody sleeps, does not pay. This measures it, so that result files from different
machines can be compared: the median of a trivial round trip (Redis `PING`, the database's
`SELECT 1`) sent back to back, and after the process slept `PAUSES_MS` milliseconds.
On SQLite the database is in this process: its figure is the floor's absence.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from django.db import connection

from iotqueue.redis_conn import redis_connection

# Pauses before each round trip: none (back to back), a few milliseconds (as between the
# stages of one hand-off at the paced rate), and about what a trickle leaves between two
# hand-offs.
PAUSES_MS = (0, 5, 40)
SAMPLES = 50


def _round_trip_ms(call: Callable[[], Any], pause_ms: int) -> float:
    """The median wall time of `call`, each made after sleeping `pause_ms`."""
    call()  # connected and warm
    times = []
    for _ in range(SAMPLES):
        if pause_ms:
            time.sleep(pause_ms / 1000)
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 3)


def _select_one() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


def round_trips_measure() -> dict[str, dict[str, float]]:
    """{"redis" | "database": {"after_<pause>ms": median ms}} for each of PAUSES_MS."""
    targets = {"redis": redis_connection().ping, "database": _select_one}
    return {
        name: {f"after_{pause}ms": _round_trip_ms(call, pause) for pause in PAUSES_MS}
        for name, call in targets.items()
    }
