"""Count the SQL statements and commits of a Django process, without touching product code.

    python -m bench.sql_count celery -A iotqueue worker --pool=prefork ...   # = python -m celery ...
    python -m bench.sql_count /path/to/manage.py bridge                      # = python manage.py ...
    python -m bench.sql_count --component NAME PROGRAM ARGS...

PROGRAM is a module run as `python -m PROGRAM` would run it, or a script path run as
`python PATH` would; ARGS reach it unchanged. Before it starts, a `connection_created` receiver
is installed, so every database connection the process (or a prefork child of it) opens gets:

- an execute wrapper counting the statements Django sends through its cursors (queries,
  SAVEPOINT / RELEASE / ROLLBACK TO). Not counted: the `BEGIN` Django sends itself on SQLite
  (psycopg sends it unseen on PostgreSQL, so counting it would make the two incomparable),
  connection set-up, and `executemany` rows beyond the first call. Several statements sent
  in one text (the engine's grouped writes on PostgreSQL, `jobs.rows.Writes`, whose head
  comment says how many) count one each, as an `executemany` counts once, though the group
  costs one round trip. A statement run in autocommit mode outside
  an atomic block is also counted as a commit of its own;
- a wrapper around `connection.commit`: the explicit commits (outermost atomic blocks);
- on PostgreSQL, a wrapper around `is_usable`: the `SELECT 1` health checks Django runs on a
  reused connection (CONN_HEALTH_CHECKS) outside its cursors, counted apart.

Counts are kept in the process and added to Redis (INCRBY, one pipeline) by a thread at most
every FLUSH_SECONDS, and once more when the process or a pool child exits, under
`<IOTQUEUE_REDIS_KEY_PREFIX>:bench:sql:<component>:<field>`. The component is `--component`, or
the first word of ARGS that is not an option (`worker`, `bridge`). `counts_read` and
`counts_report` are the bench's side.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import runpy
import sys
import threading
import time
from typing import Any

# The most a count waits in a process before it reaches Redis; a reader waits FLUSH_SETTLE.
FLUSH_SECONDS = 0.2
FLUSH_SETTLE_SECONDS = 0.5
FIELDS = ("statements", "commits", "autocommits", "health_checks")
# Options of `celery` / `manage.py` that take a value: their value is not the component.
_VALUED_OPTIONS = {"-A", "--app", "-b", "--broker", "--result-backend", "--loader", "--config", "--workdir"}

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pending = dict.fromkeys(FIELDS, 0)
_component = "unknown"
_flusher_started = False
_client: Any = None


def counter_key(prefix: str, component: str, field: str) -> str:
    return f"{prefix}:bench:sql:{component}:{field}"


# --- in the counted process -------------------------------------------------------------------


def _add(*fields: str, n: int = 1) -> None:
    global _flusher_started
    with _lock:
        for field in fields:
            _pending[field] += n
        if not _flusher_started:  # first count in this process, or in a freshly forked child
            _flusher_started = True
            threading.Thread(target=_flush_loop, name="bench-sql-count", daemon=True).start()


def _flush_loop() -> None:
    while True:
        time.sleep(FLUSH_SECONDS)
        _flush()


def _redis():
    global _client
    if _client is None:
        import redis
        from django.conf import settings

        _client = (
            redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0),
            settings.IOTQUEUE_REDIS_KEY_PREFIX,
        )
    return _client


def _flush(*args: object, **kwargs: object) -> None:
    """Add what was counted since the last flush to Redis; on failure keep it for the next."""
    with _lock:
        taken = {field: n for field, n in _pending.items() if n}
        for field in taken:
            _pending[field] = 0
    if not taken:
        return
    try:
        client, prefix = _redis()
        pipe = client.pipeline(transaction=False)
        for field, n in taken.items():
            pipe.incrby(counter_key(prefix, _component, field), n)
        pipe.execute()
    except Exception:
        log.warning("bench.sql_count: could not write counts to Redis; retrying", exc_info=True)
        with _lock:
            for field, n in taken.items():
                _pending[field] += n


def _after_fork() -> None:
    """A prefork child starts from zero (its parent flushes its own counts) with its own thread."""
    global _lock, _flusher_started, _client
    _lock = threading.Lock()  # another thread may have held the parent's at fork time
    for field in FIELDS:
        _pending[field] = 0
    _flusher_started = False
    _client = None
    _profile_start()


# BENCH_PROFILE_DIR=<dir>: each process forked from a counted one (prefork children) runs
# under cProfile and writes <dir>/<component>-<pid>.prof when it exits; read them with
# `python -m pstats`. It times each function's CPU (thread time), not its wall time: for
# finding where a step's CPU goes, not for the reported figures.
_profile = None


def _profile_start() -> None:
    global _profile
    directory = os.environ.get("BENCH_PROFILE_DIR")
    if not directory:
        return
    import cProfile

    _profile = cProfile.Profile(time.thread_time)
    _profile.enable()


def _profile_write(**kwargs: Any) -> None:
    if _profile is not None:
        _profile.disable()
        _profile.dump_stats(os.path.join(os.environ["BENCH_PROFILE_DIR"], f"{_component}-{os.getpid()}.prof"))


def _statement(execute, sql, params, many, context):
    """Execute wrapper: one statement; a commit too when autocommit applies it on its own."""
    if not (isinstance(sql, str) and sql.startswith("BEGIN")):
        connection = context["connection"]
        if _log_directory:
            _statement_log(connection, sql)
        # A grouped text (jobs.rows.Writes on PostgreSQL) counts its statements, each once
        # as an executemany counts once, though the group costs one round trip.
        grouped = _GROUPED.match(sql) if isinstance(sql, str) else None
        n = int(grouped.group(1)) if grouped else 1
        if connection.autocommit and not connection.in_atomic_block:
            _add("autocommits")
            _add("statements", n=n)
        else:
            _add("statements", n=n)
    return execute(sql, params, many, context)


_GROUPED = re.compile(r"/\* grouped: (\d+) statements")
_log_directory = os.environ.get("BENCH_SQL_LOG_DIR", "")


def _statement_log(connection: Any, sql: str) -> None:
    """BENCH_SQL_LOG_DIR: one line per statement (time, pid, in a transaction, the SQL's head)."""
    mode = "atomic" if connection.in_atomic_block else "auto"
    path = os.path.join(_log_directory, f"{_component}-{os.getpid()}.sql")
    with open(path, "a") as out:
        out.write(f"{time.time():.6f} {mode} {' '.join(str(sql).split())[:160]}\n")


def _connection_created(sender: object, connection: Any, **kwargs: object) -> None:
    """Install the counters on a connection object, once (it reconnects with the same object)."""
    if getattr(connection, "_bench_sql_counted", False):
        return
    connection._bench_sql_counted = True
    connection.execute_wrappers.append(_statement)
    commit = connection.commit

    def counted_commit() -> None:
        commit()
        _add("commits")

    connection.commit = counted_commit
    if connection.vendor != "sqlite":  # SQLite's is_usable() runs no query
        is_usable = connection.is_usable

        def counted_is_usable() -> bool:
            _add("health_checks")
            return is_usable()

        connection.is_usable = counted_is_usable


def install(component: str) -> None:
    """Count in this process and every child forked from it, under `component`."""
    global _component
    from django.db.backends.signals import connection_created

    _component = component
    connection_created.connect(_connection_created, weak=False, dispatch_uid="bench.sql_count")
    os.register_at_fork(after_in_child=_after_fork)
    atexit.register(_flush)
    try:  # prefork children leave through os._exit: atexit does not run there
        from celery.signals import worker_process_shutdown
    except ImportError:
        return
    worker_process_shutdown.connect(_flush, weak=False, dispatch_uid="bench.sql_count")
    worker_process_shutdown.connect(_profile_write, weak=False, dispatch_uid="bench.sql_count.profile")


def component_guess(args: list[str]) -> str:
    """The first word that is neither an option nor an option's value: `worker`, `bridge`."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUED_OPTIONS:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    component = None
    if argv[:1] == ["--component"] and len(argv) > 1:
        component, argv = argv[1], argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    program, args = argv[0], argv[1:]
    install(component or component_guess(args))
    sys.argv = [program, *args]
    if program.endswith(".py") or os.sep in program:
        # As `python PATH`: the script's directory first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
        runpy.run_path(program, run_name="__main__")
    else:
        runpy.run_module(program, run_name="__main__", alter_sys=True)


# --- in the bench -------------------------------------------------------------------------------


def counts_read(components: tuple[str, ...], *, settle: bool = True) -> dict[str, dict[str, int]]:
    """Current totals per component; `settle` first waits for the processes' last flush."""
    from django.conf import settings

    from iotqueue.redis_conn import redis_connection

    if settle:
        time.sleep(FLUSH_SETTLE_SECONDS)
    prefix = settings.IOTQUEUE_REDIS_KEY_PREFIX
    keys = [counter_key(prefix, c, f) for c in components for f in FIELDS]
    values = iter(redis_connection().mget(keys))
    return {c: {f: int(next(values) or 0) for f in FIELDS} for c in components}


def counts_report(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], *, steps: int
) -> dict[str, Any]:
    """Totals per component over a phase, and per step for all of them together.

    `commits` = explicit commits + statements that autocommit applied on their own.
    """
    used = {c: {f: after[c][f] - before[c][f] for f in FIELDS} for c in after}
    for counts in used.values():
        counts["commits_total"] = counts["commits"] + counts["autocommits"]
    per = max(steps, 1)

    def per_step(field: str) -> float:
        return round(sum(c[field] for c in used.values()) / per, 2)

    return {
        "by_component": used,
        "statements_per_step": per_step("statements"),
        "commits_per_step": per_step("commits_total"),
        "explicit_commits_per_step": per_step("commits"),
        "autocommits_per_step": per_step("autocommits"),
        "health_checks_per_step": per_step("health_checks"),
        "by_component_per_step": {
            c: {f: round(n / per, 2) for f, n in counts.items()} for c, counts in used.items()
        },
    }


if __name__ == "__main__":
    # Run as `python -m`, this file is `__main__`: count through the importable module instead,
    # so that its state is the one any other import of bench.sql_count sees.
    from bench import sql_count

    sql_count.main()
