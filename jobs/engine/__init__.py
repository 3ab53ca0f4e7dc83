"""The step engine: a database state machine advanced by tasks, laid out along a step's life.

Read top to bottom, the modules follow one `done` from the bridge to the next publish:

    batch.py     replies that arrived together, applied in one transaction and one Redis
                 call: end the attempts, move the runs on, start and dispatch the next
                 steps, hand freed devices to their next waiters, then publish; and
                 the other transitions' entry points (deadlines, cancels, hand-offs)
    preempt.py   an urgent step taking its busy device from a lower-priority command in
                 flight (the command canceled and its row queued again), as a plan
    executor.py  carrying a plan out: its writes, the lock call, the commit, the undo
    planner.py   what such a batch decides (run starts, every reply, due deadlines,
                 cancels, runs moving on), as a plan (effects.py) of writes, lock
                 operations, deadlines and commands; no I/O
    planner_locks.py  the plan's next rows, their lock call's order and answers, and
                 the hand-offs; no I/O
    effects.py   the plan itself: what one transition writes, takes and publishes
    progress.py  what a step row keeps of an ack or progress, and which are events
    runs.py      how a step's final outcome decides its run (`run_next`, which the planner
                 asks), and ending a run
    attempts.py  how an attempt ends (`attempt_outcome`) or is extended
                 (`attempt_extension`)
    start.py     starting the step at a run's cursor by kind, for the steps a plan does
                 not name (kinds.py): its device and args, or why it is refused; its
                 row is made as a plan (`batch.row_create`)
    publish.py   sending attempts (`attempts_send`): the commands a task published
                 without waiting for the broker, confirmed before it ends (`Publications`)
    dispatch.py  a new attempt's fields and deadlines (`attempt_new`), a command's message,
                 the `cancel` command
    kinds.py     the kinds' registry: what each step kind, row owner, failure policy and
                 deadline kind declared; the stages ask it instead of testing a kind
    holds.py     whether a queued row may ask for its device now: its time windows
                 (maintenance windows, quiet hours; an urgent step is never held)
    plan.py      what a step row executes (spec, target, args, ids); no writes

Each kind declares itself with a decorator of kinds.py where it is defined: the command in
command.py, delay and wait_online in waits.py, the group / label fan-out in fanout.py (its
start, pump and stop) and fanout_progress.py (what a row's end decides), a registered Celery
task as a step in taskstep.py, the `rollback` failure policy and its compensation rows in
rollback.py; due.py handles the deadline kinds a plan does not. The fan-out's modules, lowest
first: rollout_pace.py (its arithmetic, pure), continuous_open.py (a continuous fan-out's
record), fanout.py, wave_gates.py (a rollout's waves as it runs), fanout_progress.py, then
continuous.py (joining and closing) and fanout_rollback.py.
The kind modules sit above batch.py: a row they make takes its lock through it. jobs/apps.py
imports those modules (`KIND_MODULES`) when the app loads and checks that every kind is
declared once (`kinds.kinds_check`); importing this package loads nothing.
Imports point down this list (a module imports only those below it, never the reverse),
so there is no cycle.

Step:  pending -> queued -> dispatched -> in_progress -> succeeded | failed | rejected | timed_out
       (retrying between attempts; canceled from any non-final state; skipped when a
       fan-out is aborted; see docs/architecture.md)
"""
