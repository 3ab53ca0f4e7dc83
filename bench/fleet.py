"""`python -m bench.fleet`: one fan-out step over 10,000 online devices, 2 bridges, 2 workers.

On its own stack (bench.stack: Redis, Mosquitto with its dynamic security plugin, a scratch
PostgreSQL database) it starts 2 bridge replicas in one MQTT shared group (distinct client
ids, persistent sessions), 2 Celery worker processes and beat, registers N devices
(bulk_create) and brings them online through the light fleet simulator (bench.fleet_sim:
retained statuses, heartbeats). Then it runs one template of ONE fan-out step over all of them
(a label target, `max_in_flight`, the default rollout settings) twice: once undisturbed, and
once with one bridge SIGKILLed when half the devices have succeeded and started again at once
(as a supervisor's restart policy would). It reports devices/s, the time to the last device,
command-to-recorded latency, each process's peak RSS, Redis memory, and the oracle: every
device succeeded, none commanded twice, nothing left stuck (no open row, no lock held, no
waiter, nothing in the engine's inbox). Before the runs it reports how fast the bridges
recorded the fleet's retained statuses (`presence`, statuses/s); `--presence-only` stops
there, after timing a restarted bridge's replay of them.

Prints progress; the last line of stdout is the result as one JSON object, also written to
bench/results/fleet-<UTC timestamp>.json. Exit status 0 when both runs lost nothing (every
device succeeded, none commanded twice, nothing stuck), 1 otherwise; the speed and memory
targets are reported as booleans, not enforced. Everything it started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .cpu import cpu_report, cpu_sample
from .fleet_checks import latencies, leftovers, leftovers_settle, rows_created, status_counts
from .memory import MB, Sampler, children_pids, redis_memory
from .report import RESULTS_DIR, machine_describe
from .stack import BenchStack, sql_counted, stack_open, stop_signals_install

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
# As deploy/mosquitto.conf: a bridge replica that is away (killed, restarting) has its share
# of the replies and every retained status queued for it; Mosquitto's default of 1000 would
# drop the excess and leave those devices' steps to time out.
MOSQUITTO_OPTIONS = ("max_queued_messages 100000",)
WORKERS = ("worker-1", "worker-2")
BRIDGES = ("bridge-a", "bridge-b")
KILLED_BRIDGE = "bridge-b"
READY = {"worker": r"@\S+ ready\.", "bridge": r"bridge: connected", "beat": r"beat: Starting"}
READY_TIMEOUT_SECONDS = 90.0
EPOCH_TIMEOUT_SECONDS = 30.0
ONLINE_TIMEOUT_SECONDS = 600.0
# The targets of issue 15 on the 2-core machine.
TARGET_SECONDS = 120.0
TARGET_DEVICES_PER_S = 85.0
TARGET_BRIDGE_MB = 150.0
WORKER_GROWTH_MAX = 0.10
POLL_SECONDS = 0.5
PROGRESS_SECONDS = 5.0
SAMPLE_SECONDS = 1.0
# No device finished for this long: the engine is stuck; give up on the run.
STALL_SECONDS = 120.0
ACTION = "firmware/check"
OPEN_STATUSES = ("pending", "queued", "dispatched", "in_progress", "retrying")
FAILED_STATUSES = ("failed", "timed_out", "rejected", "canceled", "skipped")
LABEL = {"fleet": "bench"}


def say(line: str) -> None:
    print(line, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000, help="devices online and fanned out to")
    parser.add_argument("--max-in-flight", type=int, default=200, help="the fan-out step's max_in_flight")
    parser.add_argument("--connections", type=int, default=24, help="MQTT connections of the simulator")
    parser.add_argument("--heartbeat-seconds", type=float, default=60.0, help="per device (0: none)")
    parser.add_argument("--timeout-seconds", type=float, default=900.0, help="limit for each run")
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=STALL_SECONDS,
        help="give a run up when no device ended for this long (its start counts)",
    )
    parser.add_argument("--skip-kill", action="store_true", help="only the undisturbed run")
    parser.add_argument(
        "--presence-only", action="store_true", help="bring the fleet online, report presence, run no fan-out"
    )
    parser.add_argument(
        "--no-sql-count", action="store_true", help="run workers and bridges without bench.sql_count"
    )
    parser.add_argument(
        "--profile-dir",
        default="",
        help="run each worker's pool child under cProfile, writing <dir>/worker-N-<pid>.prof "
        "(figures then not comparable)",
    )
    parser.add_argument(
        "--database-url",
        default=DEFAULT_DATABASE_URL,
        help="PostgreSQL server to create (and drop) a scratch database on "
        f"(default {DEFAULT_DATABASE_URL}); 'sqlite' for a SQLite file",
    )
    args = parser.parse_args(argv)
    if args.devices < 2 or args.max_in_flight < 0 or args.connections < 1:
        parser.error("need --devices >= 2, --max-in-flight >= 0, --connections >= 1")
    return args


# --- processes ------------------------------------------------------------------------------


def child_start(stack: BenchStack, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Start a child (or start it again with its argv) and wait until its log says it is ready."""
    offset = stack.supervisor.log_size(name)
    stack.supervisor.start(name, argv, extra_env=env)
    kind = next(kind for kind in READY if kind in name)
    stack.supervisor.wait_for_log(name, READY[kind], timeout=READY_TIMEOUT_SECONDS, since=offset)


def engine_start(stack: BenchStack, args: argparse.Namespace) -> None:
    """2 workers (prefork, one pool child each), 2 bridges in one shared group, beat."""
    from devices.locks import lock_epoch_exists
    from devtools.processes import beat_argv, manage_argv, worker_argv

    counted = not args.no_sql_count or bool(args.profile_dir)
    profile = {"BENCH_PROFILE_DIR": args.profile_dir} if args.profile_dir else {}
    for name in WORKERS:
        argv = worker_argv(concurrency=1, hostname=f"{stack.namespace}-{name}")
        child_start(stack, name, sql_counted(argv, name) if counted else argv, profile)
    for name in BRIDGES:
        argv = manage_argv("bridge")
        env = {
            "MQTT_SHARED_GROUP": f"{stack.namespace}-bridges",
            "MQTT_BRIDGE_CLIENT_ID": f"{stack.namespace}-{name}",
        }
        child_start(stack, name, sql_counted(argv, name) if counted else argv, env)
    child_start(stack, "beat", beat_argv(stack.workdir, scheduler="celery.beat:PersistentScheduler"))
    deadline = time.monotonic() + EPOCH_TIMEOUT_SECONDS
    while not lock_epoch_exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no monitor tick opened the lock epoch within {EPOCH_TIMEOUT_SECONDS}s")
        time.sleep(0.05)


def process_pids(stack: BenchStack) -> dict[str, int]:
    """PIDs of every process measured, by name (a worker's pool child as `<worker>-child`)."""
    pids = {name: child.pid for name, child in stack.supervisor.children.items() if child.alive()}
    for name in WORKERS:
        for i, pid in enumerate(children_pids(pids.get(name))):
            pids[f"{name}-child{'' if i == 0 else i + 1}"] = pid
    pids |= {"redis": stack.redis.process.pid, "mosquitto": stack.broker.process.pid}
    pids["bench (simulator)"] = os.getpid()
    return pids


# --- the fleet ------------------------------------------------------------------------------


def fleet_identity(namespace: str) -> tuple[str | None, str | None]:
    """A bench-only broker identity whose role may play every device of the namespace.

    The devices' own identities (one role per device, bench-irrelevant) are never written:
    bulk_create sends no post_save. What a device may do is proven by
    tests/devices/test_broker_security.py, not here. Without dynsec: the URL's user.
    """
    from django.conf import settings

    from devices.credentials import managed
    from iotqueue.dynsec import control, password_new

    if not managed():
        return None, None
    prefix = settings.IOTQUEUE_TOPIC_PREFIX
    username, role, password = f"{namespace}-fleet", f"{namespace}-fleet", password_new()
    publish = [f"{prefix}/+/{kind}" for kind in ("ack", "progress", "done", "status", "heartbeat")]
    acls = [{"acltype": "publishClientSend", "topic": t, "allow": True} for t in publish]
    acls.append({"acltype": "subscribePattern", "topic": f"{prefix}/+/cmd/#", "allow": True})
    control.execute_checked(
        [
            {"command": "createRole", "rolename": role, "acls": acls},
            {"command": "createClient", "username": username, "password": password},
            {"command": "addClientRole", "username": username, "rolename": role},
        ]
    )
    return username, password


def devices_register(count: int) -> list[str]:
    """`count` offline devices with the fleet's label (bulk_create: no broker identity each)."""
    from devices.models import Device

    names = [f"fleet-{i:05d}" for i in range(count)]
    Device.objects.bulk_create([Device(name=n, online=False, labels=LABEL) for n in names], batch_size=2000)
    return names


def online_count() -> int:
    from devices.models import Device

    return Device.objects.filter(name__startswith="fleet-", online=True).count()


def fleet_online(stack: BenchStack, args: argparse.Namespace, names: list[str], exits: ExitStack):
    """Connect the simulator, publish every device's retained `online` and wait until the bridges
    recorded them all; returns (simulator, presence figures)."""
    from django.conf import settings

    from .fleet_sim import FleetSimulator

    username, password = fleet_identity(stack.namespace)
    sim = FleetSimulator(
        names,
        url=stack.broker.url,
        prefix=settings.IOTQUEUE_TOPIC_PREFIX,
        username=username,
        password=password,
        connections=args.connections,
        heartbeat_seconds=args.heartbeat_seconds,
    )
    exits.callback(sim.stop)
    started = time.monotonic()
    sim.start()
    say(f"fleet: {len(sim.clients)} connections subscribed to {len(names)} devices' commands")
    first_status = time.monotonic()
    sim.statuses_publish(online_count)
    deadline = time.monotonic() + ONLINE_TIMEOUT_SECONDS
    while (online := online_count()) < len(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {online}/{len(names)} devices online")
        time.sleep(0.2)
    recorded = time.monotonic()
    say(f"  all {len(names)} online after {recorded - started:.1f} s; heartbeats start")
    sim.heartbeats_start()
    statuses_s = recorded - first_status
    presence = {
        "online_seconds": round(recorded - started, 1),
        # From the first status published to the last one recorded (the faster bridge's row
        # write counts; both bridges receive every status).
        "statuses_seconds": round(statuses_s, 2),
        "statuses_per_s": round(len(names) / statuses_s, 1) if statuses_s > 0 else None,
    }
    say(f"  presence: {len(names)} statuses recorded in {statuses_s:.1f} s ({presence['statuses_per_s']}/s)")
    return sim, presence


REPLAY_PROBE = "replay-probe"
# After the restarted bridge says it is connected, the probe waits this long so that its
# subscriptions (sent before that line) are in the broker before the probe's status.
REPLAY_PROBE_DELAY_SECONDS = 0.5


def presence_replay(stack: BenchStack, sim) -> dict[str, Any]:
    """A restarted bridge's replay of every retained status, timed (--presence-only).

    The other bridge stops (its session keeps its messages) and the killed one starts again:
    on subscribing it receives every device's retained status once more, before anything
    published after that in its session. A probe device's status published then is recorded
    once the replay is through: how long a reply sent at the restart waits behind it.
    """
    from django.conf import settings

    from devices.models import Device

    Device.objects.bulk_create([Device(name=REPLAY_PROBE, online=False)])
    supervisor = stack.supervisor
    supervisor.stop(BRIDGES[0])
    offset = supervisor.log_size(KILLED_BRIDGE)
    supervisor.kill(KILLED_BRIDGE)
    supervisor.start(KILLED_BRIDGE, supervisor.children[KILLED_BRIDGE].argv)
    supervisor.wait_for_log(KILLED_BRIDGE, READY["bridge"], timeout=READY_TIMEOUT_SECONDS, since=offset)
    connected = time.monotonic()
    time.sleep(REPLAY_PROBE_DELAY_SECONDS)
    topic = f"{settings.IOTQUEUE_TOPIC_PREFIX}/{REPLAY_PROBE}/status"
    sim.clients[0].publish(topic, b"online", qos=1).wait_for_publish(READY_TIMEOUT_SECONDS)
    deadline = time.monotonic() + ONLINE_TIMEOUT_SECONDS
    while not Device.objects.filter(name=REPLAY_PROBE, online=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the probe's status, sent after a bridge restart, was never recorded")
        time.sleep(0.05)
    seconds = time.monotonic() - connected
    say(f"  replay: a status sent as {KILLED_BRIDGE} came back was recorded {seconds:.1f} s later")
    return {"bridge": KILLED_BRIDGE, "probe_recorded_after_s": round(seconds, 2)}


def fanout_template(max_in_flight: int):
    """One template of one fan-out step over the fleet's label; every other setting default."""
    from jobs.models import JobStep, JobTemplate

    template = JobTemplate.objects.create(name="fleet-fanout", description="bench.fleet")
    JobStep.objects.create(
        template=template, position=0, device=None, labels=LABEL, action=ACTION, max_in_flight=max_in_flight
    )
    return template


# --- one run --------------------------------------------------------------------------------


def _succeeded(counts: dict[str, int]) -> int:
    return counts.get("succeeded", 0)


class BridgeKill:
    """SIGKILL one bridge at half-way and start it again at once, noting when it is back."""

    def __init__(self, stack: BenchStack, name: str, at_devices: int) -> None:
        self.stack, self.name, self.at_devices = stack, name, at_devices
        self.killed_at: float | None = None
        self.back_after: float | None = None
        self._offset = 0

    def poll(self, succeeded: int) -> None:
        supervisor = self.stack.supervisor
        if self.killed_at is None and succeeded >= self.at_devices:
            self._offset = supervisor.log_size(self.name)
            self.killed_at = time.monotonic()
            supervisor.kill(self.name)
            supervisor.start(self.name, supervisor.children[self.name].argv)
            say(f"  SIGKILLed {self.name} at {succeeded} devices succeeded; started it again")
        elif self.killed_at is not None and self.back_after is None:
            log = supervisor.children[self.name].log_text()[self._offset :]
            if re.search(READY["bridge"], log):
                self.back_after = round(time.monotonic() - self.killed_at, 2)
                say(f"  {self.name} connected again {self.back_after} s after the kill")

    def report(self) -> dict[str, Any]:
        return {"bridge": self.name, "at_devices_succeeded": self.at_devices, "back_after_s": self.back_after}


def run_drive(
    run, total: int, *, timeout: float, stall: float = STALL_SECONDS, kill: BridgeKill | None
) -> tuple[dict[str, int], str]:
    """Poll the run's rows until it is terminal; returns (rows by status, how it ended)."""
    started = time.monotonic()
    last_progress = last_change = started
    done_before = -1
    while True:
        run.refresh_from_db()
        counts = status_counts(run)
        succeeded = _succeeded(counts)
        if kill is not None:
            kill.poll(succeeded)
        now = time.monotonic()
        ended = sum(n for status, n in counts.items() if status not in OPEN_STATUSES)
        if ended != done_before:
            done_before, last_change = ended, now
        if now - last_progress >= PROGRESS_SECONDS:
            last_progress = now
            say(f"  {now - started:6.1f} s: {succeeded}/{total} succeeded; {dict(sorted(counts.items()))}")
        if run.is_terminal:
            return counts, "terminal"
        if now - started > timeout:
            return counts, f"timeout after {timeout:.0f} s"
        if now - last_change > stall:
            return counts, f"stalled: no device ended for {stall:.0f} s"
        time.sleep(POLL_SECONDS)


def sql_counts(components: tuple[str, ...]) -> dict[str, dict[str, int]]:
    from .sql_count import counts_read

    return counts_read(components)


def fleet_run(
    stack: BenchStack,
    sim,
    template,
    names: list[str],
    *,
    tag: str,
    args: argparse.Namespace,
    kill: bool,
) -> dict[str, Any]:
    """Start the fan-out once, drive it to the end (killing a bridge half-way if asked), measure."""
    from jobs.services import run_start

    total = len(names)
    components = (*WORKERS, *BRIDGES)
    counted = not args.no_sql_count or bool(args.profile_dir)
    sql_before = sql_counts(components) if counted else None
    killer = BridgeKill(stack, KILLED_BRIDGE, total // 2) if kill else None
    say(f"run {tag}: one fan-out step to {total} devices, max_in_flight {args.max_in_flight}")
    cpu_before = cpu_sample(stack.cpu_roots())
    with Sampler(lambda: process_pids(stack), interval=SAMPLE_SECONDS) as sampler:
        started_wall = time.time()
        run, _ = run_start(template=template, trigger="cli", triggered_by=f"fleet-{tag}")
        counts, ending = run_drive(
            run, total, timeout=args.timeout_seconds, stall=args.stall_seconds, kill=killer
        )
        cpu_after = cpu_sample(stack.cpu_roots())
    run.refresh_from_db()
    elapsed = round(time.time() - started_wall, 1)
    left = leftovers_settle(run, names) if run.is_terminal else leftovers(run, names)
    oracle = sim.oracle(str(run.id))
    from django.db.models import Max

    from jobs.models import StepRun

    last = StepRun.objects.filter(run=run).aggregate(last=Max("finished_at"))["last"]
    succeeded = _succeeded(counts)
    # A run cut short by --timeout-seconds has no time to its last device; its rate is what
    # it did until its last finished row.
    to_last = round(last.timestamp() - started_wall, 2) if last else None
    seconds = to_last if run.is_terminal else None
    rate = round(succeeded / to_last, 1) if to_last else None
    peaks = sampler.peak_mb()
    bridge_max = max((mb for name, mb in peaks.items() if name.startswith("bridge")), default=None)
    result: dict[str, Any] = {
        "devices": total,
        "ended": ending,
        "run_status": run.status,
        "devices_per_s": rate,
        "seconds": seconds,
        "elapsed_s": elapsed,
        "succeeded_devices": succeeded,
        # Every device not succeeded once the run ended; of a run cut short, those that failed.
        "failed_devices": total - succeeded
        if run.is_terminal
        else sum(n for status, n in counts.items() if status in FAILED_STATUSES),
        "unfinished_devices": 0
        if run.is_terminal
        else sum(n for st, n in counts.items() if st in OPEN_STATUSES),
        "rows_by_status": dict(sorted(counts.items())),
        "double_commands": oracle["double_commands"],
        "oracle": oracle,
        "command_to_recorded_ms": latencies(run, sim.first_arrival(str(run.id))),
        "bridge_rss_mb_max": bridge_max,
        "rss_mb_peak": peaks,
        "rss_mb_quarter": sampler.at_mb(0.25),
        "rss_mb_end": sampler.at_mb(1.0),
        "redis_used_memory_mb_max": round((sampler.redis_max() or 0) / MB, 2),
        "leftovers": left,
        "stuck": any(left.values()),
        "rows_created": rows_created(run),
        "cpu": cpu_report(cpu_before, cpu_after, steps=max(succeeded, 1)),
        "heartbeats_sent_total": sim.heartbeats,
    }
    if sql_before is not None:
        sql_after = sql_counts(components)
        statements = {c: sql_after[c]["statements"] - sql_before[c]["statements"] for c in components}
        result["sql_statements"] = statements
        result["sql_statements_per_device"] = round(sum(statements.values()) / max(succeeded, 1), 2)
    if killer is not None:
        result["kill"] = killer.report()
    say(
        f"  {tag}: {succeeded}/{total} succeeded in {seconds} s ({rate}/s, {ending}); failed "
        f"{result['failed_devices']}, unfinished {result['unfinished_devices']}; commanded twice "
        f"{oracle['double_commands']}; redeliveries {oracle['redeliveries']}; leftovers {left}; "
        f"bridge max {bridge_max} MB"
    )
    return result


# --- the verdict ----------------------------------------------------------------------------


def lost_nothing(run: dict[str, Any]) -> bool:
    return run["failed_devices"] == 0 and run["double_commands"] == 0 and not run["stuck"]


def workers_growth(before_mb: dict[str, float], after_mb: dict[str, float]) -> dict[str, float | None]:
    """Each worker process's RSS growth from `before_mb` to `after_mb`."""
    growth = {}
    for name, before in before_mb.items():
        after = after_mb.get(name)
        if name.startswith("worker"):
            growth[name] = round((after - before) / before, 4) if after and before else None
    return growth


def targets(plain: dict[str, Any], killed: dict[str, Any] | None) -> dict[str, Any]:
    runs = [plain, *([killed] if killed else [])]
    result = {
        "under_120_s": plain["seconds"] is not None and plain["seconds"] < TARGET_SECONDS,
        "at_least_85_devices_per_s": (plain["devices_per_s"] or 0) >= TARGET_DEVICES_PER_S,
        "bridges_under_150_mb": all((r["bridge_rss_mb_max"] or 0) < TARGET_BRIDGE_MB for r in runs),
        "lost_nothing": all(lost_nothing(r) for r in runs),
    }
    # Flat: from the end of the first run to the end of the second; with one run, from a
    # quarter of it (imports and connections done) to its end.
    if killed:
        growth = workers_growth(plain["rss_mb_end"], killed["rss_mb_end"])
    else:
        growth = workers_growth(plain["rss_mb_quarter"], plain["rss_mb_end"])
    result["workers_rss_growth"] = growth
    result["workers_flat"] = bool(growth) and all(
        g is not None and g < WORKER_GROWTH_MAX for g in growth.values()
    )
    return result


def result_write(result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"fleet-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _machine(stack: BenchStack, load_at_start: list[float]) -> dict[str, Any]:
    """The machine and servers a result was measured on (code: not recorded here)."""
    return machine_describe(
        redis_kind=stack.redis.kind,
        mqtt_kind=stack.broker.kind,
        database=stack.database,
        load_at_start=load_at_start,
        code=False,
    )


def presence_report(
    args: argparse.Namespace, stack: BenchStack, presence: dict[str, Any], load_at_start: list[float]
) -> int:
    """--presence-only: the presence figures as the result (file and last line); 0."""
    machine = _machine(stack, load_at_start)
    result = {"devices": args.devices, "presence": presence, "arguments": vars(args), "machine": machine}
    path = result_write(result)
    say(f"fleet: wrote {path}; logs in {stack.log_dir()}")
    relative = str(path.relative_to(RESULTS_DIR.parent.parent))
    line = {"devices": args.devices, "presence": presence, "result_file": relative}
    print(json.dumps(line), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    stop_signals_install("fleet")
    database_url = None if args.database_url == "sqlite" else args.database_url
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    with ExitStack() as exits:
        stack = stack_open(exits, database_url=database_url, mosquitto_options=MOSQUITTO_OPTIONS)
        say(f"fleet: scratch {stack.workdir}; database {stack.database}; mqtt {stack.broker.kind}")
        try:
            engine_start(stack, args)
            redis_before = redis_memory()
            names = devices_register(args.devices)
            sim, presence = fleet_online(stack, args, names, exits)
            if args.presence_only:
                presence["replay"] = presence_replay(stack, sim)
                return presence_report(args, stack, presence, load_at_start)
            time.sleep(2.0)  # the last statuses' row updates and heartbeats' first round settle
            redis_online = redis_memory()
            template = fanout_template(args.max_in_flight)
            plain = fleet_run(stack, sim, template, names, tag="plain", args=args, kill=False)
            redis_after = redis_memory()
            killed = None
            if not args.skip_kill and plain["ended"] == "terminal":
                killed = fleet_run(stack, sim, template, names, tag="bridge_killed", args=args, kill=True)
        except (TimeoutError, RuntimeError) as exc:
            say(f"fleet: {exc}")
            stack.errors_say(say)
            return 1
        machine = _machine(stack, load_at_start)
        redis = {
            "used_memory_mb_no_devices": round(redis_before / MB, 2),
            "used_memory_mb_devices_online": round(redis_online / MB, 2),
            "used_memory_mb_after_run": round(redis_after / MB, 2),
            "used_memory_mb_max_in_run": plain["redis_used_memory_mb_max"],
            "bytes_per_online_device": round((redis_online - redis_before) / args.devices, 1),
            "bytes_per_device_after_one_step": round((redis_after - redis_online) / args.devices, 1),
            "bytes_per_in_flight_device_max": round(
                (plain["redis_used_memory_mb_max"] * MB - redis_online) / max(args.max_in_flight, 1), 1
            )
            if args.max_in_flight
            else None,
        }
        summary = {
            key: plain[key] for key in ("devices", "devices_per_s", "seconds", "failed_devices", "ended")
        }
        result = {
            **summary,
            "double_commands": plain["double_commands"],
            "bridge_rss_mb_max": plain["bridge_rss_mb_max"],
            "command_to_recorded_ms": plain["command_to_recorded_ms"],
            "rss_mb_peak": plain["rss_mb_peak"],
            "redis": redis,
            "targets": targets(plain, killed),
            "arguments": vars(args),
            "online_seconds": presence["online_seconds"],
            "presence": presence,
            "plain": plain,
            "bridge_killed": killed,
            "machine": machine,
        }
        path = result_write(result)
        say(f"fleet: wrote {path}; logs in {stack.log_dir()}")
        ok = lost_nothing(plain) and (killed is None or lost_nothing(killed))
    line = {key: value for key, value in result.items() if key not in ("plain", "machine", "arguments")}
    line["bridge_killed"] = (
        None
        if killed is None
        else {
            key: killed[key]
            for key in (
                "devices_per_s",
                "seconds",
                "failed_devices",
                "double_commands",
                "bridge_rss_mb_max",
                "command_to_recorded_ms",
                "rss_mb_peak",
                "leftovers",
                "stuck",
                "kill",
            )
        }
    )
    line["result_file"] = str(path.relative_to(RESULTS_DIR.parent.parent))
    print(json.dumps(line), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("fleet: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)
