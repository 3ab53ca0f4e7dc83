"""The step engine: a database state machine advanced by tasks, laid out along a step's life.

Read top to bottom, the modules follow one `done` from the bridge to the next publish:

    batch.py     replies that arrived together, applied in one transaction and one Redis
                 call: end the attempts, move the runs on, start and dispatch the next
                 steps, hand freed devices to their next waiters, then publish
    reply.py     the general path for one reply (unknown, foreign, stale replies)
    runs.py      continuing runs: a step row's outcome moves its run on, rolls it back or
                 ends it (kinds and policies plug in through registries)
    attempts.py  ending an attempt: succeeded, retrying (back-off), failed, timed out
    start.py     starting the step at a run's cursor, by kind (registry)
    publish.py   the commands a task published without waiting for the broker, confirmed
                 before it ends (`Publications`)
    dispatch.py  taking the device lock, committing the attempt, publishing the command
    plan.py      what a step row executes (spec, target, args, ids); no writes

Step kinds other than a plain command register themselves: waits.py (delay,
wait_online), fanout.py (group / label fan-out), taskstep.py (a registered Celery task as
a step), rollback.py (the `rollback` failure policy and its compensation rows). due.py
maps each deadline kind to its handler.
Imports point down this list (a module imports only those below it, never the reverse),
so there is no cycle; importing this package loads every kind so the registries are full.

Step:  pending -> queued -> dispatched -> in_progress -> succeeded | failed | rejected | timed_out
       (retrying between attempts; canceled from any non-final state; skipped when a
       fan-out is aborted; see docs/architecture.md)
"""

from . import batch, due, fanout, rollback, taskstep, waits  # noqa: F401  (kinds register on import)
