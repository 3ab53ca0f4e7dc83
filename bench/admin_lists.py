"""`python -m bench.admin_lists`: the admin's lists and run page, timed over a million step runs.

A measurement tool, not a test. It creates a PostgreSQL database of its own (default
`iotqueue_adminbench` on 127.0.0.1:5432), fills it with a history in the issue's proportions
(per 1,000,000 step runs: 100,000 runs and 3,000,000 events, spread over two years) plus one
scenario-4 rollout run (2,000 pumps, 10,000 events), then times each admin page with Django's
test client logged in as a superuser and prints a table: median wall time, SQL statements,
and the slowest statement. The database is dropped at the end unless `--keep` is given;
`--reuse` measures a database kept earlier without filling it again.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from devtools.processes import BASE_DIR
from devtools.servers import redis_start

from .stack import stop_signals_install

SCRATCH_ROOT = BASE_DIR / "var" / "bench"
DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"
DEFAULT_DATABASE = "iotqueue_adminbench"
# The proportions: a run has ten step rows on average, a step row three events
# (queued, dispatched, finished) - 1,000,000 step runs, 100,000 runs, 3,000,000 events.
STEPS_PER_RUN = 10
EVENTS_PER_STEP = 3
# Scenario 4's Berlin pump fleet; ordinary runs use templates of ten pumps each.
PUMPS = 2_000
TEMPLATES = 20
# History length: two years, so the date hierarchy has more than one year to offer.
HISTORY_DAYS = 730
# Runs still running at the end of the history (the newest ones), with one step in flight.
ACTIVE_RUNS = 50
# Runs per INSERT round: bounds each statement's memory and prints progress on the way.
FILL_CHUNK_RUNS = 10_000
# Scenario 4's rollout: one row per pump, five events per row.
FANOUT_EVENTS_PER_ROW = 5
# Pumps whose lock a rollout step holds, so the device list's holder column links to runs.
LOCKS_HELD = 20
# Every page is fetched once to warm caches, then this many times; the median is shown.
REPEATS = 3
SQL_SHOWN = 70


def say(line: str) -> None:
    print(line, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.admin_lists", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=1_000_000, help="step runs of the history (default 1,000,000)"
    )
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, help=f"PostgreSQL server (default {DEFAULT_SERVER})"
    )
    parser.add_argument(
        "--database", default=DEFAULT_DATABASE, help=f"database name (default {DEFAULT_DATABASE})"
    )
    parser.add_argument("--keep", action="store_true", help="leave the database for a later --reuse")
    parser.add_argument("--reuse", action="store_true", help="measure the kept database, do not fill it")
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help=f"timed fetches per page (default {REPEATS})"
    )
    args = parser.parse_args(argv)
    if args.rows < STEPS_PER_RUN * TEMPLATES or args.repeats < 1:
        parser.error(f"need --rows >= {STEPS_PER_RUN * TEMPLATES} and --repeats >= 1")
    if urlsplit(args.server).scheme not in ("postgres", "postgresql"):
        parser.error("--server takes a postgres:// URL: the question is how PostgreSQL copes")
    if args.database in ("test", "test_test", "postgres"):
        parser.error(f"--database {args.database!r} belongs to someone else; pick another name")
    return args


# --- the database and this process's settings ---------------------------------------------------


def database_open(exits: ExitStack, args: argparse.Namespace) -> None:
    """Create (or, with --reuse, find) the database, start Redis, then set up Django and migrate.

    Must run before anything imports Django settings: they are read from os.environ once.
    """
    import psycopg

    with psycopg.connect(args.server, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [args.database]).fetchone()
        if args.reuse and not exists:
            raise SystemExit(f"--reuse: no database {args.database!r}; run once with --keep first")
        if not args.reuse:
            if exists:
                raise SystemExit(f"database {args.database!r} exists: --reuse it, or drop it first")
            conn.execute(f'CREATE DATABASE "{args.database}"')
    if not args.keep:
        exits.callback(_database_drop, args.server, args.database)

    workdir = SCRATCH_ROOT / f"admin-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    workdir.mkdir(parents=True)
    redis = redis_start(workdir)
    exits.callback(redis.stop)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
            "DATABASE_URL": urlunsplit(urlsplit(args.server)._replace(path=f"/{args.database}")),
            "REDIS_URL": redis.url,
            "CELERY_BROKER_URL": redis.url,
            "IOTQUEUE_REDIS_KEY_PREFIX": f"adminbench{uuid.uuid4().hex[:8]}",
            # As in production: DEBUG would keep every SQL statement in memory and show
            # debug pages; the statements are captured per page below instead. Without DEBUG
            # the settings want a real secret key and hosts: a throwaway one, the test client's.
            "DEBUG": "false",
            "SECRET_KEY": secrets.token_urlsafe(50),
            "ALLOWED_HOSTS": "testserver",
        }
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def _database_drop(server: str, name: str) -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    say(f"dropped database {name}")


# --- the history ------------------------------------------------------------------------------


def fleet_create() -> tuple[list[int], list[int], list[str]]:
    """The pumps and the ordinary templates: (pump ids, template ids, each template's plan as JSON).

    Template k has ten command steps on pumps 10k .. 10k+9.
    """
    from devices.models import Device
    from jobs.models import JobStep, JobTemplate
    from jobs.services import template_plan

    pumps = Device.objects.bulk_create(
        Device(name=f"pump-{n:04d}", labels={"site": "berlin", "kind": "pump"}, online=n % 50 != 0)
        for n in range(PUMPS)
    )
    ids, plans = [], []
    for k in range(TEMPLATES):
        template = JobTemplate.objects.create(name=f"Pump round {k:02d}")
        JobStep.objects.bulk_create(
            JobStep(template=template, position=j, device=pumps[k * STEPS_PER_RUN + j], action=f"valve/{j}")
            for j in range(STEPS_PER_RUN)
        )
        ids.append(template.pk)
        plans.append(json.dumps(template_plan(template), default=str))
    return [pump.pk for pump in pumps], ids, plans


# Run i: template i % TEMPLATES, created HISTORY_DAYS ago .. now in creation order; a few
# runs failed at step 4 or were canceled at step 2, the newest ACTIVE_RUNS are running at
# step 5. A run has step rows only for the steps it reached, as the engine creates them.
RUNS_SQL = """
INSERT INTO jobs_jobrun (id, template_id, parameters, plan, status, cursor, trigger, triggered_by,
                         priority, error, created_at, started_at, finished_at)
SELECT md5('run-' || i)::uuid,
       (%(templates)s::bigint[])[1 + i %% %(template_count)s],
       '{"reason": "weekly round"}', (%(plans)s::jsonb[])[1 + i %% %(template_count)s],
       s.status, s.last_index, CASE WHEN i %% 3 = 0 THEN 'schedule' ELSE 'rest' END, 'ops',
       5, CASE s.status WHEN 'failed' THEN 'step 4 failed on its pump' ELSE '' END,
       t.created, t.created + interval '1 second',
       CASE WHEN s.status = 'running' THEN NULL ELSE t.created + interval '40 seconds' END
FROM generate_series(%(first)s, %(last)s) AS i,
     LATERAL (SELECT now() - make_interval(secs => (%(runs)s - i) * %(spacing)s) AS created) AS t,
     LATERAL (SELECT CASE WHEN i >= %(runs)s - %(active)s THEN 'running'
                          WHEN i %% 100 = 7 THEN 'failed'
                          WHEN i %% 500 = 3 THEN 'canceled'
                          ELSE 'succeeded' END AS status) AS st,
     LATERAL (SELECT st.status, CASE st.status WHEN 'running' THEN 5 WHEN 'failed' THEN 4
                                               WHEN 'canceled' THEN 2
                                               ELSE %(steps)s - 1 END AS last_index) AS s
"""

STEPS_SQL = """
INSERT INTO jobs_steprun (run_id, index, phase, device_id, action, args, status, attempt, command_id,
                          deadline, result, error, queued_at, dispatched_at, acked_at, finished_at)
SELECT r.id, j, 'forward', (%(pumps)s::bigint[])[1 + (i %% %(template_count)s) * %(steps)s + j],
       'valve/' || j, '{}', st.status, 1, 'cmd-' || i || '-' || j,
       CASE WHEN st.status = 'dispatched' THEN now() + interval '60 seconds' END,
       CASE WHEN st.status = 'succeeded' THEN '{"ok": true}'::jsonb END,
       CASE WHEN st.status = 'failed' THEN 'valve stuck' ELSE '' END,
       q.queued, q.queued + interval '50 milliseconds', q.queued + interval '60 milliseconds',
       CASE WHEN st.status = 'dispatched' THEN NULL ELSE q.queued + interval '2 seconds' END
FROM generate_series(%(first)s, %(last)s) AS i
JOIN jobs_jobrun r ON r.id = md5('run-' || i)::uuid
CROSS JOIN generate_series(0, %(steps)s - 1) AS j,
     LATERAL (SELECT r.started_at + make_interval(secs => j * 3) AS queued) AS q,
     LATERAL (SELECT CASE WHEN j < r.cursor OR r.status = 'succeeded' THEN 'succeeded'
                          WHEN r.status = 'running' THEN 'dispatched'
                          ELSE r.status END AS status) AS st
WHERE j <= r.cursor
ORDER BY i, j
"""

# Three events per step row; every 997th row's third event is a stale reply instead.
EVENTS_SQL = """
INSERT INTO jobs_runevent (run_id, step_run_id, kind, device, message, data, created_at)
SELECT s.run_id, s.id,
       CASE k WHEN 0 THEN 'step.queued' WHEN 1 THEN 'step.dispatched'
              ELSE CASE WHEN s.id %% 997 = 0 THEN 'reply.stale' ELSE 'step.' || s.status END END,
       d.name, s.action || ' #' || k, '{}', s.queued_at + make_interval(secs => k)
FROM jobs_steprun s
JOIN devices_device d ON d.id = s.device_id
CROSS JOIN generate_series(0, %(events)s - 1) AS k
WHERE s.id > %(after)s
ORDER BY s.id, k
"""

# Messages that matched no run: one per thousand step rows, from that row's pump.
STRAYS_SQL = """
INSERT INTO jobs_runevent (run_id, step_run_id, kind, device, message, data, created_at)
SELECT NULL, NULL, 'message.dropped', d.name, 'malformed JSON', '{}', s.queued_at
FROM jobs_steprun s JOIN devices_device d ON d.id = s.device_id
WHERE s.id > %(after)s AND s.id %% 1000 = 0
ORDER BY s.id
"""


def history_fill(rows: int, pumps: list[int], templates: list[int], plans: list[str]) -> None:
    """Runs, their step rows and events, in chunks of FILL_CHUNK_RUNS runs, generated by the server."""
    from django.db import connection, transaction

    runs = rows // STEPS_PER_RUN
    common = {
        "runs": runs,
        "spacing": HISTORY_DAYS * 86_400 / runs,
        "active": ACTIVE_RUNS,
        "steps": STEPS_PER_RUN,
        "events": EVENTS_PER_STEP,
        "templates": templates,
        "template_count": len(templates),
        "plans": plans,
        "pumps": pumps,
    }
    started = time.monotonic()
    for first in range(0, runs, FILL_CHUNK_RUNS):
        last = min(first + FILL_CHUNK_RUNS, runs) - 1
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT coalesce(max(id), 0) FROM jobs_steprun")
            after = cursor.fetchone()[0]
            chunk = {**common, "first": first, "last": last, "after": after}
            for sql in (RUNS_SQL, STEPS_SQL, EVENTS_SQL, STRAYS_SQL):
                cursor.execute(sql, chunk)
        say(f"  runs {last + 1:,} / {runs:,}  ({time.monotonic() - started:.0f} s)")


def rollout_create(pumps: list[int]) -> str:
    """Scenario 4's nightly firmware check, 50 minutes in: 2,000 rows, 10,000 events; its id.

    1,500 pumps done, 30 failed, 20 in flight, the rest queued behind the rollout limits.
    """
    from django.db import connection

    from jobs.models import JobRun, JobStep, JobTemplate, RunStatus
    from jobs.services import template_plan

    template = JobTemplate.objects.create(name="Nightly firmware check")
    JobStep.objects.create(
        template=template,
        position=0,
        labels={"site": "berlin", "kind": "pump"},
        action="firmware/check",
        rollout_per_minute=50,
        max_in_flight=20,
        abort_failure_percent=10,
        abort_min_devices=100,
    )
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.RUNNING, trigger="schedule"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE jobs_jobrun SET created_at = now() - interval '50 minutes',
                                   started_at = now() - interval '50 minutes' WHERE id = %(run)s;
            INSERT INTO jobs_steprun (run_id, index, phase, device_id, action, args, status, attempt,
                                      command_id, deadline, result, error, queued_at, dispatched_at,
                                      finished_at)
            SELECT %(run)s, 0, 'forward', p.id, 'firmware/check', '{}', st.status, 1, 'fw-' || p.n,
                   CASE WHEN st.status = 'dispatched' THEN now() + interval '5 minutes' END,
                   CASE WHEN st.status = 'succeeded' THEN '{"version": "2.4.1"}'::jsonb END,
                   CASE WHEN st.status = 'failed' THEN 'checksum mismatch' ELSE '' END,
                   t.queued,
                   CASE WHEN p.n <= 1550 THEN t.queued + interval '1 minute' END,
                   CASE WHEN p.n <= 1530 THEN t.queued + interval '2 minutes' END
            FROM unnest(%(pumps)s::bigint[]) WITH ORDINALITY AS p(id, n),
                 LATERAL (SELECT now() - interval '50 minutes' + make_interval(secs => p.n * 1.2)
                          AS queued) AS t,
                 LATERAL (SELECT CASE WHEN p.n <= 1500 THEN 'succeeded' WHEN p.n <= 1530 THEN 'failed'
                                      WHEN p.n <= 1550 THEN 'dispatched' ELSE 'queued' END AS status) AS st
            ORDER BY p.n;
            INSERT INTO jobs_runevent (run_id, step_run_id, kind, device, message, data, created_at)
            SELECT s.run_id, s.id,
                   (ARRAY['step.queued', 'step.dispatched', 'reply.ack', 'reply.progress',
                          CASE WHEN s.id %% 200 = 0 THEN 'reply.stale' ELSE 'step.' || s.status END])[k + 1],
                   d.name, 'firmware/check', '{}', s.queued_at + make_interval(secs => k)
            FROM jobs_steprun s JOIN devices_device d ON d.id = s.device_id
            CROSS JOIN generate_series(0, %(events)s - 1) AS k
            WHERE s.run_id = %(run)s ORDER BY s.id, k;
            INSERT INTO jobs_runevent (run_id, step_run_id, kind, device, message, data, created_at)
            SELECT NULL, NULL, 'message.dropped', d.name, 'malformed JSON', '{}', s.queued_at
            FROM jobs_steprun s JOIN devices_device d ON d.id = s.device_id
            WHERE s.run_id = %(run)s AND s.id %% 40 = 0;
            """,
            {"run": run.pk, "pumps": pumps, "events": FANOUT_EVENTS_PER_ROW},
        )
    return str(run.pk)


def history_create(rows: int) -> None:
    from django.db import connection

    say(f"filling: {PUMPS:,} pumps, {rows // STEPS_PER_RUN:,} runs of {STEPS_PER_RUN} steps, their events")
    started = time.monotonic()
    pumps, templates, plans = fleet_create()
    history_fill(rows, pumps, templates, plans)
    rollout_create(pumps)
    say(f"  VACUUM ANALYZE ({time.monotonic() - started:.0f} s so far)")
    with connection.cursor() as cursor:
        for table in ("jobs_jobrun", "jobs_steprun", "jobs_runevent", "devices_device"):
            cursor.execute(f"VACUUM ANALYZE {table}")
    say(f"filled in {time.monotonic() - started:.0f} s")


# --- the pages --------------------------------------------------------------------------------


def locks_take(rollout_id: str) -> None:
    """Rollout steps in flight hold their pumps' locks, and a few rows wait in their queues."""
    from devices.locks import device_lock_acquire, lock_epoch_start
    from jobs.models import StepRun, StepStatus

    lock_epoch_start()
    in_flight = StepRun.objects.filter(run_id=rollout_id, status=StepStatus.DISPATCHED)
    for row in in_flight.select_related("device")[:LOCKS_HELD]:
        device_lock_acquire(row.device.name, holder=f"step:{row.pk}", priority=5, lease_seconds=600)
        device_lock_acquire(row.device.name, holder=f"step:{row.pk + 10**9}", priority=5, lease_seconds=600)


def pages(rollout_id: str) -> list[tuple[str, str]]:
    """(label, URL) of every page measured: the lists plainly, filtered, searched; the run page."""
    from django.utils import timezone

    from jobs.models import JobRun, JobTemplate, StepRun

    template = JobTemplate.objects.order_by("name").values_list("pk", flat=True).first()
    old_run = JobRun.objects.order_by("created_at").values_list("pk", flat=True).first()
    old_step = StepRun.objects.order_by("id").values_list("pk", "command_id").first()
    today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    # What the list's "Past 7 days" choice links to.
    week = urlencode({"created_at__gte": today - timedelta(days=6), "created_at__lt": today + timedelta(1)})
    deep = max(1, min(50, JobRun.objects.count() // 100))  # a page well past the first ones
    return [
        ("runs", "/admin/jobs/jobrun/"),
        ("runs ?status=failed", "/admin/jobs/jobrun/?status__exact=failed"),
        ("runs ?template", f"/admin/jobs/jobrun/?template__id__exact={template}"),
        ("runs, past 7 days", f"/admin/jobs/jobrun/?{week}"),
        ("runs ?q=<run id prefix>", f"/admin/jobs/jobrun/?q={str(old_run)[:8]}"),
        (f"runs, page {deep}", f"/admin/jobs/jobrun/?p={deep}"),
        ("step runs", "/admin/jobs/steprun/"),
        ("step runs ?status=failed", "/admin/jobs/steprun/?status__exact=failed"),
        ("step runs ?status=dispatched", "/admin/jobs/steprun/?status__exact=dispatched"),
        ("step runs ?q=<pump>", "/admin/jobs/steprun/?q=pump-0042"),
        ("step runs ?q=<command id>", f"/admin/jobs/steprun/?q={old_step[1]}"),
        ("step runs ?run=<old run>", f"/admin/jobs/steprun/?run__id__exact={old_run}"),
        ("step runs ?run=<rollout>", f"/admin/jobs/steprun/?run__id__exact={rollout_id}"),
        ("step run page", f"/admin/jobs/steprun/{old_step[0]}/change/"),
        ("events", "/admin/jobs/runevent/"),
        ("events ?tone=attention", "/admin/jobs/runevent/?tone=attention"),
        ("events ?tone=failure", "/admin/jobs/runevent/?tone=failure"),
        ("events ?tone=step.", "/admin/jobs/runevent/?tone=step."),
        ("events ?q=<pump>", "/admin/jobs/runevent/?q=pump-0042"),
        ("events ?q=reply.stale", "/admin/jobs/runevent/?q=reply.stale"),
        ("events ?run=<rollout>", f"/admin/jobs/runevent/?run__id__exact={rollout_id}"),
        ("devices", "/admin/devices/device/"),
        ("devices ?q=pump-01", "/admin/devices/device/?q=pump-01"),
        ("run page, rollout", f"/admin/jobs/jobrun/{rollout_id}/change/"),
        ("run timeline refresh, rollout", f"/admin/jobs/jobrun/{rollout_id}/timeline/"),
        ("run page, old run", f"/admin/jobs/jobrun/{old_run}/change/"),
    ]


def page_time(client, url: str, repeats: int) -> dict[str, Any]:
    """Median wall time of `repeats` fetches after a warm-up one, and the last fetch's SQL."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)
    times = []
    for _ in range(repeats):
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            response = client.get(url)
            times.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}")
    slowest = max(queries.captured_queries, key=lambda q: float(q["time"]))
    return {
        "ms": round(statistics.median(times) * 1000, 1),
        "queries": len(queries.captured_queries),
        "sql_ms": round(sum(float(q["time"]) for q in queries.captured_queries) * 1000, 1),
        "slowest_ms": round(float(slowest["time"]) * 1000, 1),
        "slowest_sql": " ".join(slowest["sql"].split())[:SQL_SHOWN],
    }


def table_print(results: list[tuple[str, dict[str, Any]]]) -> None:
    width = max(len(label) for label, _ in results)
    say(f"{'page':<{width}}  {'ms':>8}  {'queries':>7}  {'sql ms':>8}  {'slowest':>8}  slowest statement")
    for label, r in results:
        say(
            f"{label:<{width}}  {r['ms']:>8.1f}  {r['queries']:>7}  {r['sql_ms']:>8.1f}  "
            f"{r['slowest_ms']:>8.1f}  {r['slowest_sql']}"
        )


def table_sizes() -> str:
    from devices.models import Device
    from jobs.models import JobRun, RunEvent, StepRun

    models = (JobRun, StepRun, RunEvent, Device)
    return ", ".join(f"{model.objects.count():,} {model._meta.verbose_name_plural}" for model in models)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    stop_signals_install("admin_lists")
    with ExitStack() as exits:
        database_open(exits, args)
        from django.contrib.auth.models import User
        from django.test import Client

        from jobs.models import JobRun

        if not args.reuse:
            history_create(args.rows)
        rollout_id = str(JobRun.objects.get(template__name="Nightly firmware check").pk)
        locks_take(rollout_id)
        user = User.objects.filter(username="bench").first()
        user = user or User.objects.create_superuser("bench", "", None)
        client = Client()
        client.force_login(user)
        say(f"database {args.database}: {table_sizes()}")
        say(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (2 shared cores: figures move)")
        results = []
        for label, url in pages(rollout_id):
            results.append((label, page_time(client, url, args.repeats)))
            say(f"  {label}: {results[-1][1]['ms']} ms")
        table_print(results)
        if args.keep:
            say(f"kept database {args.database}; measure again with --reuse, drop with dropdb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
