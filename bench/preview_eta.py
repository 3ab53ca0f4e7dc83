"""`python -m bench.preview_eta`: the preview's finish estimate for a ramped fan-out, measured.

Issue 36 asks for "a preview whose ETA is within 25 % of the measured finish for a 500-device
ramp". A timing comparison does not belong in the test suite (shared, noisy machines), so it
lives here. On its own stack (bench.stack: Redis, Mosquitto, a fresh SQLite file by default,
a Celery worker with 2 pool processes, the bridge, beat ticking the monitor every second) it
registers N devices with one label and brings them online through the light fleet simulator
(bench.fleet_sim), each answering a command's `ack` at once and its `done` `--command-seconds`
later. One template has ONE fan-out step over the label with an exponential ramp. The preview
is asked through the real REST endpoint (`POST /api/runs/preview/`, Django's test client in
this process, as a superuser), the run is started at once (`jobs.services.run_start`) and
awaited, and the estimate is set beside the measured finish (the run's `started_at` to its
`finished_at`), with where the time went: when the rows started (the replayed and the
measured milestones), the pumps, the commands' own durations.

Prints progress; the last line of stdout is the result as one JSON object, also written to
bench/results/preview-eta-<UTC timestamp>.json. Exit status 0 when every device succeeded and
the estimate is within `--tolerance` of the measured finish (PASS), 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .report import RESULTS_DIR, machine_describe
from .stack import BenchStack, stack_open, stop_signals_install

# The target: the estimate within this fraction of the measured finish.
TOLERANCE = 0.25
ACTION = "firmware/eta-flash"
TEMPLATE = "preview-eta"
# Rows started by the time the bench compares the replay with the run (and the last one).
MILESTONES = (1, 50, 100, 200, 300, 400)
POLL_SECONDS = 0.2
PROGRESS_SECONDS = 10.0
# No row ended for this long: the engine is stuck; give up on the run.
STALL_SECONDS = 60.0
ONLINE_TIMEOUT_SECONDS = 120.0
# Rows queued within this of one another were started by one pump.
PUMP_INSTANT_SECONDS = 0.005


def say(line: str) -> None:
    print(line, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.preview_eta", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=500, help="devices online and fanned out to (500)")
    parser.add_argument("--rate", type=int, default=120, help="rollout_per_minute, the ramp's base (120)")
    parser.add_argument("--factor", type=float, default=2.0, help="rollout_increment_factor (2)")
    parser.add_argument("--every", type=int, default=50, help="rollout_increment_every, successes (50)")
    parser.add_argument("--max-rate", type=int, default=1200, help="rollout_max_per_minute (1200)")
    parser.add_argument("--max-in-flight", type=int, default=0, help="the step's max_in_flight (0: none)")
    parser.add_argument("--command-seconds", type=float, default=2.0, help="a device's ack -> done (2)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="PASS within this fraction (0.25)")
    parser.add_argument("--connections", type=int, default=8, help="MQTT connections of the simulator")
    parser.add_argument("--timeout-seconds", type=float, default=300.0, help="limit for the run")
    parser.add_argument(
        "--database-url", default=None, help="a PostgreSQL server for a scratch database (default: SQLite)"
    )
    args = parser.parse_args(argv)
    if args.devices < 1 or args.rate < 1 or args.command_seconds <= 0 or args.connections < 1:
        parser.error("need --devices >= 1, --rate >= 1, --command-seconds > 0, --connections >= 1")
    return args


# --- the fleet and the template ------------------------------------------------------------------


def fleet_online(stack: BenchStack, args: argparse.Namespace, exits: ExitStack):
    """Register the devices (bench.fleet's label), connect the simulator, bring them online."""
    from django.conf import settings

    from .fleet import devices_register, fleet_identity, online_count
    from .fleet_sim import FleetSimulator

    names = devices_register(args.devices)
    username, password = fleet_identity(stack.namespace)
    sim = FleetSimulator(
        names,
        url=stack.broker.url,
        prefix=settings.IOTQUEUE_TOPIC_PREFIX,
        username=username,
        password=password,
        connections=min(args.connections, len(names)),
        heartbeat_seconds=60.0,
        done_after_seconds=args.command_seconds,
    )
    exits.callback(sim.stop)
    sim.start()
    sim.statuses_publish(online_count)
    deadline = time.monotonic() + ONLINE_TIMEOUT_SECONDS
    while online_count() < len(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {online_count()}/{len(names)} devices online")
        time.sleep(0.2)
    sim.heartbeats_start()
    say(f"fleet: {len(names)} devices online, answering `done` {args.command_seconds:g} s after `ack`")
    return sim, names


def template_create(args: argparse.Namespace):
    """One template of one ramped fan-out step over the fleet's label; its first version recorded."""
    from jobs.models import JobStep, JobTemplate
    from jobs.services import template_version_record

    from .fleet import LABEL

    template = JobTemplate.objects.create(name=TEMPLATE, description="bench.preview_eta")
    JobStep.objects.create(
        template=template,
        position=0,
        device=None,
        labels=LABEL,
        action=ACTION,
        max_in_flight=args.max_in_flight,
        rollout_per_minute=args.rate,
        rollout_increment_factor=args.factor,
        rollout_increment_every=args.every,
        rollout_max_per_minute=args.max_rate,
    )
    template_version_record(template=template)
    return template


# --- the preview, the run ------------------------------------------------------------------------


def preview_ask(template) -> dict[str, Any]:
    """`POST /api/runs/preview/` through Django's URLs, middleware, view and serializer."""
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    user = get_user_model().objects.create_superuser("bench-eta", "bench-eta@example.invalid", None)
    client = APIClient(HTTP_HOST="localhost")
    client.force_authenticate(user)
    # secure: with DEBUG off the settings redirect plain HTTP to HTTPS.
    response = client.post("/api/runs/preview/", {"template": template.name}, format="json", secure=True)
    if response.status_code != 200:
        raise RuntimeError(f"preview answered {response.status_code}: {response.content[:500]!r}")
    return response.json()


def run_await(run, total: int, *, timeout: float):
    """Poll until the run is terminal; returns it (raises TimeoutError when stuck or too long)."""
    from .fleet_checks import status_counts

    started = time.monotonic()
    next_line, moved_at, ended_before = started + PROGRESS_SECONDS, started, -1
    while True:
        run.refresh_from_db()
        if run.is_terminal:
            return run
        now = time.monotonic()
        counts = status_counts(run)
        ended = sum(n for status, n in counts.items() if status in ("succeeded", "failed", "timed_out"))
        if ended != ended_before:
            ended_before, moved_at = ended, now
        if now >= next_line:
            next_line = now + PROGRESS_SECONDS
            say(f"  {now - started:6.1f} s: {dict(sorted(counts.items()))} of {total}")
        if now - started > timeout:
            raise TimeoutError(f"run not finished after {timeout:.0f} s: {counts}")
        if now - moved_at > STALL_SECONDS:
            raise TimeoutError(f"no row ended for {STALL_SECONDS:.0f} s: {counts}")
        time.sleep(POLL_SECONDS)


# --- where the time went -------------------------------------------------------------------------


def _seconds(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def replayed_starts(spec: dict[str, Any], rows, counts: tuple[int, ...]) -> dict[int, float | None]:
    """When the preview's replay starts its k-th row: the replay of the first k rows ends k's
    row last (the rows beyond k change no earlier pump), `seconds` after it started."""
    from jobs.estimate import fanout_expected_seconds
    from jobs.preview import monitor_interval

    starts = {}
    for k in counts:
        end = fanout_expected_seconds(spec, rows[:k], tick=monitor_interval())
        starts[k] = None if end is None else round(end - rows[k - 1].seconds, 2)
    return starts


def time_breakdown(run, estimate: dict[str, Any]) -> dict[str, Any]:
    """The rows' measured milestones beside the replay's, the pumps, each leg of a row."""
    from jobs.estimate import RowTiming, fanout_expected_seconds
    from jobs.models import StepRun
    from jobs.preview import monitor_interval

    rows = list(
        StepRun.objects.filter(run=run)
        .order_by("queued_at")
        .values_list("queued_at", "dispatched_at", "acked_at", "finished_at")
    )
    t0 = run.started_at.timestamp()
    queued = [q.timestamp() - t0 for q, _d, _a, _f in rows if q]
    finished = [f.timestamp() - t0 for _q, _d, _a, f in rows if f]
    durations = [(f - d).total_seconds() for _q, d, _a, f in rows if d and f]
    to_dispatch = [(d - q).total_seconds() for q, d, _a, _f in rows if q and d]
    pumps = [queued[0]] if queued else []
    for at in queued[1:]:
        if at - pumps[-1] > PUMP_INSTANT_SECONDS:
            pumps.append(at)
    gaps = [b - a for a, b in itertools.pairwise(pumps)]
    counts = tuple(k for k in (*MILESTONES, len(rows)) if k <= len(rows))
    spec = run.plan[0]
    typical = estimate["typical_seconds"]
    replayed = replayed_starts(spec, [RowTiming(typical)] * len(rows), counts)
    measured_typical = statistics.median(durations) if durations else typical
    return {
        "first_row_queued_s": round(queued[0], 3) if queued else None,
        "last_row_queued_s": round(queued[-1], 3) if queued else None,
        "last_row_finished_s": round(max(finished), 3) if finished else None,
        "row_started": {
            str(k): {"replayed_s": replayed[k], "measured_s": round(queued[k - 1], 2)} for k in counts
        },
        "pumps": len(pumps),
        "pump_gap_s": _seconds(gaps),
        "queued_to_dispatched_s": _seconds(to_dispatch),
        "dispatched_to_finished_s": _seconds(durations),
        # What the same replay says with the commands' measured median duration (what a
        # second preview would use: the action's recent succeeded rows).
        "estimate_with_measured_duration_s": fanout_expected_seconds(
            spec, [RowTiming(measured_typical)] * len(rows), tick=monitor_interval()
        ),
    }


# --- the result ----------------------------------------------------------------------------------


def result_write(result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"preview-eta-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    stop_signals_install("preview_eta")
    with ExitStack() as exits:
        stack = stack_open(exits, database_url=args.database_url)
        say(f"preview_eta: scratch {stack.workdir}; database {stack.database}; mqtt {stack.broker.kind}")
        try:
            stack.engine_start()
            _sim, names = fleet_online(stack, args, exits)
            template = template_create(args)
            from jobs.services import run_start

            preview = preview_ask(template)
            step = preview["steps"][0]
            estimated = preview["estimate"]["seconds"]
            say(
                f"preview: {step['devices']['online']}/{step['devices']['matched']} online, "
                f"typical {step['estimate']['typical_seconds']} s ({step['estimate']['typical_source']}), "
                f"ETA {estimated} s"
            )
            if estimated is None:
                raise RuntimeError(f"the preview gave no estimate: {preview['problems']}")
            started_wall = time.time()
            run, _ = run_start(template=template, trigger="cli", triggered_by="bench-eta")
            run = run_await(run, len(names), timeout=args.timeout_seconds)
            ended_wall = time.time()
        except (TimeoutError, RuntimeError) as exc:
            say(f"preview_eta: {exc}")
            stack.errors_say(say)
            return 1
        from .fleet_checks import status_counts

        counts = status_counts(run)
        measured = (run.finished_at - run.started_at).total_seconds()
        ratio = estimated / measured
        within = abs(estimated - measured) <= args.tolerance * measured
        succeeded = counts.get("succeeded", 0)
        breakdown = time_breakdown(run, step["estimate"])
        machine = machine_describe(
            redis_kind=stack.redis.kind,
            mqtt_kind=stack.broker.kind,
            database=stack.database,
            load_at_start=load_at_start,
        )
        result = {
            "devices": len(names),
            "estimate_s": round(estimated, 2),
            "measured_s": round(measured, 2),
            "ratio": round(ratio, 3),
            "tolerance": args.tolerance,
            "within_tolerance": within,
            "run_status": run.status,
            "succeeded_devices": succeeded,
            "rows_by_status": dict(sorted(counts.items())),
            # run_start called -> the poll saw the run ended (includes the poll's interval).
            "wall_s": round(ended_wall - started_wall, 2),
            "typical_seconds": step["estimate"]["typical_seconds"],
            "typical_source": step["estimate"]["typical_source"],
            "rollout": step["rollout"],
            "breakdown": breakdown,
            "arguments": vars(args),
            "machine": machine,
        }
        path = result_write(result)
        say(f"preview_eta: wrote {path}; logs in {stack.log_dir()}")
    verdict = "PASS" if within and succeeded == len(names) else "FAIL"
    say(
        f"{verdict}: estimate {estimated:.1f} s, measured {measured:.1f} s, ratio {ratio:.2f} "
        f"(target within ±{args.tolerance:.0%}); {succeeded}/{len(names)} succeeded"
    )
    line = {key: value for key, value in result.items() if key not in ("machine", "arguments", "rollout")}
    line["verdict"] = verdict
    line["result_file"] = str(path.relative_to(RESULTS_DIR.parent.parent))
    print(json.dumps(line), flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("preview_eta: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)
