"""The metric families the jobs app counts on /metrics (docs/operations.md, "Metrics and logs").

Declared when this module is imported (by jobs/apps.py as the app loads, and by the
modules that count); what counts as what is decided where it happens: jobs/events.py (run
and step outcomes, durations, lock waits, dropped replies), jobs/replies.py (accepted
replies), jobs/monitor.py (the monitor's work).
"""

from __future__ import annotations

from iotqueue.metrics import COUNTER, HISTOGRAM, Family, family_declare

from .deadlines import KINDS as DEADLINE_KINDS

# Step durations range from a lamp switching (tens of ms) to a database instance being
# created (scenario 3: up to 1800 s), so the buckets span both.
STEP_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A free device is dispatched within milliseconds; a busy one may keep a step waiting up
# to its queue timeout (default 600 s, longer for slow provisioning steps).
LOCK_WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800)

RUNS_STARTED = family_declare(
    Family("iotqueue_runs_started", "Runs that started (pending -> running).", COUNTER)
)
RUNS = family_declare(
    Family(
        "iotqueue_runs",
        "Runs that ended, by terminal status.",
        COUNTER,
        ("outcome",),
        ("succeeded", "failed", "timed_out", "canceled", "compensated"),
    )
)
STEPS = family_declare(
    Family(
        "iotqueue_steps",
        "Step runs (one per device of a fan-out, compensations included) that ended, by terminal status.",
        COUNTER,
        ("outcome",),
        ("succeeded", "failed", "rejected", "timed_out", "canceled", "skipped"),
    )
)
STEP_RETRIES = family_declare(
    Family("iotqueue_step_retries", "Failed attempts that will be retried after a back-off.", COUNTER)
)
STEP_DURATION = family_declare(
    Family(
        "iotqueue_step_duration_seconds",
        "Time from publishing a command to the end of that attempt, by how the attempt ended.",
        HISTOGRAM,
        ("outcome",),
        ("succeeded", "failed", "rejected", "timed_out", "retrying"),
        STEP_DURATION_BUCKETS,
    )
)
LOCK_WAIT = family_declare(
    Family(
        "iotqueue_lock_wait_seconds",
        "Time a step attempt waited for its device (lock queue, offline device, flow control) "
        "before dispatch.",
        HISTOGRAM,
        buckets=LOCK_WAIT_BUCKETS,
    )
)
MONITOR_ACTIONS = family_declare(
    Family(
        "iotqueue_monitor_actions",
        "What the monitor did: ticks, due deadlines fired (by kind), expired leases reclaimed, "
        "work re-found by the database sweep, lock rebuilds after Redis lost its data.",
        COUNTER,
        ("action",),
        # One `deadline_<kind>` per kind of the deadline set, so a new kind is declared here too.
        (
            "tick",
            *(f"deadline_{kind}" for kind in DEADLINE_KINDS),
            "lease_reclaimed",
            "reconciled",
            "locks_rebuilt",
        ),
    )
)

# What the reply handlers (jobs/replies.py) and the engine decide about a message the bridge
# received: added to the bridge's own family (iotqueue/bridge.py) when the app loads.
BRIDGE_MESSAGE_KINDS = ("accepted", "malformed", "stale", "unknown", "foreign_device")
