"""`python -m bench.soak`: memory of the bridge, the worker and Redis under a long, steady load.

The design's memory bar: the bridge and each worker process stay flat under sustained load
(RSS growth under 10 % across a 30-minute soak after warm-up), the bridge stays under 100 MB
with 10,000 devices, and Redis holds a few hundred bytes per idle device, not kilobytes.

On its own stack (bench.stack) it registers N devices and keeps them all online: a small
subset is simulated by devtools.simulator (real protocol replies), the rest are announced
(retained status, heartbeats) by a few shared MQTT connections, which the bridge cannot tell
from devices. It measures Redis before and after the devices came online and after each of
the simulated ones ran one step, then starts runs at a steady rate for the soak and samples
RSS and Redis every 30 s. Prints progress; writes bench/results/soak-<UTC timestamp>.json;
exit status 0 when every bar holds, 1 otherwise. Everything it started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .cpu import cpu_report, cpu_sample
from .memory import children_pids, rss_bytes
from .report import RESULTS_DIR, machine_describe
from .stack import BenchStack, stack_open, stop_signals_install

# The project's quality bars for a long run.
RSS_GROWTH_MAX = 0.10
BRIDGE_RSS_MAX_BYTES = 100 * 1000 * 1000
# "A few hundred bytes, not kilobytes".
REDIS_PER_DEVICE_MAX_BYTES = 1000
# Shared MQTT connections that stand in for the devices that are not simulated: a few, so
# the broker and the bridge see traffic from more than one socket, as from a fleet.
FLEET_CONNECTIONS = 4
# Retained statuses are published in chunks, and the next chunk waits while the bridge is
# this many messages behind: Mosquitto drops QoS 1 messages beyond max_queued_messages
# (1000) per subscriber, and a dropped "online" would leave a device offline forever.
STATUS_CHUNK = 250
STATUS_BACKLOG_MAX = 500
ONLINE_TIMEOUT_SECONDS = 600.0
# Heartbeats are published in small batches this often, spreading each device's beat
# evenly over the interval instead of bursting the whole fleet at once.
HEARTBEAT_TICK_SECONDS = 0.1
# Runs used to create Redis' fixed structures (metric hashes, queues) before the
# per-device measurement, so that only per-device keys remain in the difference.
WARM_DEVICES = 10
# Templates the soak's runs cycle through: enough that runs do not all meet on one device.
TEMPLATES = 100
STEPS_MAX = 3
# Redis' used_memory wobbles by a few kilobytes (client buffers): read it a few times.
REDIS_READINGS, REDIS_READING_GAP_SECONDS = 5, 0.4
# After the last run of a phase ends, the engine's follow-up (lease release, deadline
# removal, metrics flush) is given this long before Redis is read.
SETTLE_SECONDS = 5.0
PHASE_TIMEOUT_SECONDS = 300.0
DRAIN_TIMEOUT_SECONDS = 180.0
# Our processes above this many cores would make the soak a test of overload, not memory.
CORES_BUDGET = 1.6
SEED = 20240611
# The simulated devices answer like healthy hardware: ack at once, progress, done in 20-80 ms.
BEHAVIOUR_LATENCY_MS = (20.0, 80.0)


def say(line: str) -> None:
    print(line, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="soak after warm-up (default 30)")
    parser.add_argument("--warmup-minutes", type=float, default=4.0, help="load before sampling counts")
    parser.add_argument("--devices", type=int, default=10_000, help="devices registered and online")
    parser.add_argument("--active", type=int, default=200, help="of them simulated, running steps")
    parser.add_argument("--rate", type=float, default=5.0, help="runs started per second (1-3 steps)")
    parser.add_argument("--heartbeat-seconds", type=float, default=60.0, help="per device")
    parser.add_argument("--sample-seconds", type=float, default=30.0, help="between samples")
    args = parser.parse_args(argv)
    if not WARM_DEVICES < args.active <= args.devices or args.rate <= 0 or args.minutes <= 0:
        parser.error(f"need {WARM_DEVICES} < --active <= --devices, --rate > 0, --minutes > 0")
    return args


# --- processes and Redis -----------------------------------------------------------------


def processes_rss(stack: BenchStack) -> dict[str, Any]:
    """RSS of the bridge, beat, the worker's parent and each of its pool children, by PID."""
    pids = {name: child.pid for name, child in stack.supervisor.children.items() if child.alive()}
    memory = {
        name: {
            "pid": pids.get(name),
            "rss": rss_bytes(pids.get(name)),
            "anon": rss_bytes(pids.get(name), "RssAnon"),
        }
        for name in ("bridge", "beat", "worker")
    }
    children = {str(pid): rss_bytes(pid) for pid in children_pids(pids.get("worker"))}
    return {**memory, "worker_children": children}


def redis_used_memory() -> int:
    """Median of a few `INFO memory` used_memory readings, in bytes."""
    from iotqueue.redis_conn import redis_connection

    readings = []
    for i in range(REDIS_READINGS):
        if i:
            time.sleep(REDIS_READING_GAP_SECONDS)
        readings.append(int(redis_connection().info("memory")["used_memory"]))
    return int(statistics.median(readings))


def keys_census(namespace: str, devices: list[str]) -> dict[str, Any]:
    """The keys that name one of `devices` (`<prefix>:<kind>:{<shard tag>}:<device>`, see
    devices/locks.py): kinds, count, MEMORY USAGE."""
    from iotqueue.redis_conn import redis_connection

    conn, wanted = redis_connection(), set(devices)
    kinds: dict[str, int] = {}
    count = total = 0
    for key in conn.scan_iter(match=f"{namespace}*{{*}}*", count=1000):
        if key.rpartition("}:")[2] not in wanted:
            continue
        kind = key.split(":")[1] if ":" in key else key
        kinds[kind] = kinds.get(kind, 0) + 1
        count += 1
        total += conn.memory_usage(key, samples=0) or 0
    per_device = len(wanted) or 1
    return {"keys": count, "by_kind": kinds, "bytes_per_device": round(total / per_device, 1)}


# --- the fleet ---------------------------------------------------------------------------


def devices_register(count: int, active: int) -> tuple[list[str], list[str]]:
    """Create `count` offline devices; returns (simulated names, announced names)."""
    from devices.models import Device

    names = [f"soak-{i:05d}" for i in range(count)]
    Device.objects.bulk_create([Device(name=name, online=False) for name in names], batch_size=1000)
    return names[:active], names[active:]


def online_count() -> int:
    from devices.models import Device

    return Device.objects.filter(name__startswith="soak-", online=True).count()


class FleetAnnouncer:
    """Retained "online" statuses and periodic heartbeats for many devices over a few clients.

    The bridge sees exactly what it would see from the devices themselves (their topics,
    their payloads); only their last wills are missing, which the soak never exercises.
    """

    def __init__(self, names: list[str], *, url: str, heartbeat_seconds: float) -> None:
        from iotqueue.mqtt import client_connect, client_create

        self.names, self.heartbeat_seconds = names, heartbeat_seconds
        self.clients = [client_create(f"soak-fleet-{i}", url=url) for i in range(FLEET_CONNECTIONS)]
        for client in self.clients:
            client_connect(client, url=url)
        self.heartbeats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeats_run, name="soak-heartbeats", daemon=True)

    def statuses_publish(self) -> None:
        """Publish every device's retained "online", never running far ahead of the bridge."""
        from devices import protocol

        base = online_count()
        for start in range(0, len(self.names), STATUS_CHUNK):
            chunk = self.names[start : start + STATUS_CHUNK]
            for i, name in enumerate(chunk):
                client = self.clients[i % len(self.clients)]
                client.publish(protocol.device_topic(name, "status"), b"online", qos=1, retain=True)
            published = start + len(chunk)
            deadline = time.monotonic() + ONLINE_TIMEOUT_SECONDS
            while online_count() - base < published - STATUS_BACKLOG_MAX:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bridge stuck at {online_count() - base}/{published} statuses")
                time.sleep(0.2)

    def heartbeats_start(self) -> None:
        self._thread.start()

    def _heartbeats_run(self) -> None:
        from devices import protocol

        per_tick = len(self.names) * HEARTBEAT_TICK_SECONDS / self.heartbeat_seconds
        owed, index, next_tick = 0.0, 0, time.monotonic()
        while not self._stop.is_set():
            owed += per_tick
            while owed >= 1:
                name = self.names[index % len(self.names)]
                body = json.dumps({"ts": time.time()}).encode()
                self.clients[index % len(self.clients)].publish(
                    protocol.device_topic(name, "heartbeat"), body
                )
                index, owed, self.heartbeats = index + 1, owed - 1, self.heartbeats + 1
            next_tick += HEARTBEAT_TICK_SECONDS
            self._stop.wait(max(0.0, next_tick - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for client in self.clients:
            client.disconnect()
            client.loop_stop()


def fleet_online(stack: BenchStack, args: argparse.Namespace, exits: ExitStack) -> tuple[list[str], Any]:
    """Register the devices and bring them all online; returns (simulated names, simulator)."""
    from devtools.simulator import DeviceBehaviour, Simulator

    simulated, announced = devices_register(args.devices, args.active)
    say(f"fleet: {args.devices} devices, {len(simulated)} simulated, {len(announced)} announced")
    announcer = FleetAnnouncer(announced, url=stack.broker.url, heartbeat_seconds=args.heartbeat_seconds)
    exits.callback(announcer.stop)
    behaviour = DeviceBehaviour(*BEHAVIOUR_LATENCY_MS)
    simulator = Simulator(
        dict.fromkeys(simulated, behaviour),
        url=stack.broker.url,
        heartbeat_interval=args.heartbeat_seconds,
        seed=SEED,
    )
    simulator.start(wait_connected=120.0)
    exits.callback(simulator.stop)
    started = time.monotonic()
    announcer.statuses_publish()
    deadline = time.monotonic() + ONLINE_TIMEOUT_SECONDS
    while (online := online_count()) < args.devices:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {online}/{args.devices} devices online")
        time.sleep(0.5)
    say(f"  all {args.devices} online after {time.monotonic() - started:.0f} s; heartbeats start")
    announcer.heartbeats_start()
    return simulated, simulator


# --- runs ----------------------------------------------------------------------------------


def templates_per_device(names: list[str], *, tag: str) -> list[Any]:
    """One template of one step for each device."""
    from devices.models import Device
    from jobs.models import JobStep, JobTemplate

    devices = {d.name: d for d in Device.objects.filter(name__in=names)}
    templates = JobTemplate.objects.bulk_create(
        [JobTemplate(name=f"{tag}-{name}", description="soak") for name in names]
    )
    JobStep.objects.bulk_create(
        [
            JobStep(template=t, position=0, device=devices[name], action="noop")
            for t, name in zip(templates, names, strict=True)
        ]
    )
    return templates


def redis_per_device(
    stack: BenchStack, simulated: list[str], *, idle_before: int, keys_idle: int
) -> dict[str, Any]:
    """Redis bytes per online idle device, then per device that has run one step."""
    from iotqueue.redis_conn import redis_connection

    from .workload import runs_start, runs_wait

    def one_step_each(names: list[str], tag: str) -> int:
        runs_start(templates_per_device(names, tag=tag), tag=tag)
        runs_wait(tag=tag, total=len(names), timeout=PHASE_TIMEOUT_SECONDS, say=say)
        time.sleep(SETTLE_SECONDS)
        return redis_used_memory()

    idle_after, keys_online = redis_used_memory(), redis_connection().dbsize()
    warm, measured = simulated[:WARM_DEVICES], simulated[WARM_DEVICES:]
    before_step = one_step_each(warm, "warm")
    keys_before_step = redis_connection().dbsize()
    after_step = one_step_each(measured, "onestep")
    devices = online_count()
    figures = {
        "used_memory_no_devices": idle_before,
        "used_memory_devices_online": idle_after,
        "keys_no_devices": keys_idle,
        "keys_devices_online": keys_online,
        "bytes_per_idle_device": round((idle_after - idle_before) / devices, 1),
        "used_memory_before_one_step": before_step,
        "used_memory_after_one_step": after_step,
        "devices_with_one_step": len(measured),
        "bytes_per_device_after_one_step": round((after_step - before_step) / len(measured), 1),
        "keys_before_one_step": keys_before_step,
        "keys_after_one_step_total": redis_connection().dbsize(),
        "keys_after_one_step": keys_census(stack.namespace, measured),
    }
    say(
        f"redis: {figures['bytes_per_idle_device']} B per idle online device; "
        f"{figures['bytes_per_device_after_one_step']} B per device after one step "
        f"(keys: {figures['keys_after_one_step']})"
    )
    return figures


def soak_templates(simulated: list[str]) -> list[Any]:
    """TEMPLATES templates of 1..STEPS_MAX steps on random simulated devices."""
    from .workload import Fleet, templates_create

    rng, fleet = random.Random(SEED), Fleet(shared=[], spread=simulated)
    templates = []
    for steps in range(1, STEPS_MAX + 1):
        count = TEMPLATES // STEPS_MAX
        templates += templates_create(
            tag=f"soak{steps}", count=count, steps=steps, fleet=fleet, shared=0, rng=rng
        )
    rng.shuffle(templates)
    return templates


def run_counts(tag: str) -> dict[str, int]:
    from jobs.models import RUN_TERMINAL, JobRun, RunStatus

    runs = JobRun.objects.filter(triggered_by=tag)
    return {
        "terminal": runs.filter(status__in=RUN_TERMINAL).count(),
        "failed": runs.filter(status__in=RUN_TERMINAL).exclude(status=RunStatus.SUCCEEDED).count(),
    }


def sample_take(stack: BenchStack, *, started: float, warmup: bool, runs_started: int) -> dict[str, Any]:
    from iotqueue.redis_conn import redis_connection

    info = redis_connection().info("memory")
    return {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "minute": round((time.monotonic() - started) / 60, 2),
        "warmup": warmup,
        **processes_rss(stack),
        "redis_used_memory": int(info["used_memory"]),
        "redis_rss": int(info["used_memory_rss"]),
        "celery_queue": redis_connection().llen(stack.namespace),
        "runs_started": runs_started,
        "runs": run_counts("soak"),
    }


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def sample_say(sample: dict[str, Any]) -> None:
    children = " ".join(_mb(rss) for rss in sample["worker_children"].values())
    cpu = sample.get("cpu", {})
    say(
        f"  {sample['minute']:5.1f} min{' (warm-up)' if sample['warmup'] else ''}: MB bridge "
        f"{_mb(sample['bridge']['rss'])} worker {_mb(sample['worker']['rss'])} children {children} "
        f"beat {_mb(sample['beat']['rss'])} redis {_mb(sample['redis_used_memory'])}; runs "
        f"{sample['runs']['terminal']}/{sample['runs_started']} failed {sample['runs']['failed']} "
        f"queue {sample['celery_queue']}; cores ours {cpu.get('ours_cores', '-')} "
        f"others {cpu.get('others_cores', '-')}"
    )


def soak_run(stack: BenchStack, args: argparse.Namespace, simulated: list[str]) -> list[dict[str, Any]]:
    """Start runs at args.rate for warm-up + soak, sampling every args.sample_seconds."""
    from jobs.services import run_start

    templates = soak_templates(simulated)
    warmup_s, total_s = args.warmup_minutes * 60, (args.warmup_minutes + args.minutes) * 60
    say(
        f"soak: {args.rate} runs/s of 1-{STEPS_MAX} steps on {len(simulated)} devices; {args.warmup_minutes} "
        f"min warm-up, then {args.minutes} min sampled every {args.sample_seconds:.0f} s"
    )
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    next_run, next_sample, runs_started = started, started, 0
    cpu_before = cpu_sample(stack.cpu_roots())
    while (now := time.monotonic()) < started + total_s:
        if now >= next_sample:
            sample = sample_take(
                stack, started=started, warmup=now - started < warmup_s, runs_started=runs_started
            )
            cpu_now = cpu_sample(stack.cpu_roots())
            if samples:
                sample["cpu"] = cpu_report(cpu_before, cpu_now, steps=0)
                sample["cpu"].pop("ms_per_step")
            cpu_before = cpu_now
            samples.append(sample)
            sample_say(sample)
            next_sample += args.sample_seconds
        if now >= next_run:
            run_start(template=templates[runs_started % len(templates)], trigger="cli", triggered_by="soak")
            runs_started += 1
            # Behind by more than a second (the database was busy): carry on, do not burst.
            next_run = max(next_run + 1 / args.rate, now - 1.0)
        time.sleep(max(0.0, min(next_run, next_sample) - time.monotonic()))
    samples.append(sample_take(stack, started=started, warmup=False, runs_started=runs_started))
    sample_say(samples[-1])
    return samples


# --- the verdict ---------------------------------------------------------------------------


def _growth(first: int | None, last: int | None, values: list[int | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    growth = None if not first or last is None else round((last - first) / first, 4)
    return {"start": first, "end": last, "max": max(known, default=None), "growth": growth}


def summary_build(samples: list[dict[str, Any]], redis: dict[str, Any]) -> dict[str, Any]:
    """Growth per process from the first post-warm-up sample to the last, and the bars."""
    sampled = [s for s in samples if not s["warmup"]]
    first, last = sampled[0], sampled[-1]
    processes = {
        name: _growth(first[name]["rss"], last[name]["rss"], [s[name]["rss"] for s in sampled])
        for name in ("bridge", "worker", "beat")
    }
    children = {
        pid: _growth(rss, last["worker_children"].get(pid), [s["worker_children"].get(pid) for s in sampled])
        for pid, rss in first["worker_children"].items()
    }
    replaced = sorted(set().union(*(s["worker_children"] for s in sampled)) - set(first["worker_children"]))
    pid_changes = [n for n in ("bridge", "worker") if first[n]["pid"] != last[n]["pid"]]
    flat = [processes["bridge"], processes["worker"], *children.values()]
    bars = {
        "rss_growth_under_10pct": all(p["growth"] is not None and p["growth"] < RSS_GROWTH_MAX for p in flat)
        and not replaced
        and not pid_changes,
        "bridge_under_100mb": max(s["bridge"]["rss"] or 0 for s in samples) < BRIDGE_RSS_MAX_BYTES,
        "redis_idle_device_few_hundred_bytes": redis["bytes_per_idle_device"] < REDIS_PER_DEVICE_MAX_BYTES
        and redis["bytes_per_device_after_one_step"] < REDIS_PER_DEVICE_MAX_BYTES,
    }
    cores = [s["cpu"]["ours_cores"] for s in samples if "cpu" in s]
    return {
        "sampled_minutes": round(last["minute"] - first["minute"], 2),
        "processes": processes,
        "worker_children": children,
        "worker_children_replaced": replaced,
        "pid_changes": pid_changes,
        "redis_used_memory": _growth(
            first["redis_used_memory"], last["redis_used_memory"], [s["redis_used_memory"] for s in sampled]
        ),
        "ours_cores_max": max(cores, default=None),
        "bars": bars,
    }


def summary_say(summary: dict[str, Any], redis: dict[str, Any]) -> None:
    def line(name: str, p: dict[str, Any]) -> None:
        growth = "-" if p["growth"] is None else f"{p['growth']:+.1%}"
        say(
            f"  {name:<14} start {_mb(p['start'])} MB, end {_mb(p['end'])} MB, "
            f"max {_mb(p['max'])} MB, growth {growth}"
        )

    say(f"result over {summary['sampled_minutes']} min after warm-up:")
    for name, p in summary["processes"].items():
        line(name, p)
    for pid, p in summary["worker_children"].items():
        line(f"child {pid}", p)
    line("redis used", summary["redis_used_memory"])
    say(
        f"  redis per idle device {redis['bytes_per_idle_device']} B, after one step "
        f"{redis['bytes_per_device_after_one_step']} B"
    )
    for bar, held in summary["bars"].items():
        say(f"  {bar}: {'met' if held else 'NOT MET'}")
    if (summary["ours_cores_max"] or 0) > CORES_BUDGET:
        say(f"  WARNING: our processes used up to {summary['ours_cores_max']} cores; lower --rate")


def result_write(result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"soak-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    stop_signals_install("soak")
    with ExitStack() as exits:
        stack = stack_open(exits)
        say(f"soak: scratch {stack.workdir}; redis {stack.redis.kind}; mqtt {stack.broker.kind}")
        from iotqueue.redis_conn import redis_connection

        try:
            stack.engine_start()
            time.sleep(SETTLE_SECONDS)
            idle_before = redis_used_memory()
            keys_idle = redis_connection().dbsize()
            simulated, simulator = fleet_online(stack, args, exits)
            time.sleep(SETTLE_SECONDS)
            redis = redis_per_device(stack, simulated, idle_before=idle_before, keys_idle=keys_idle)
            samples = soak_run(stack, args, simulated)
            say("drain: waiting for the runs still open")
            from .workload import runs_wait

            runs_wait(tag="soak", total=samples[-1]["runs_started"], timeout=DRAIN_TIMEOUT_SECONDS, say=say)
        except (TimeoutError, RuntimeError) as exc:
            say(f"soak: {exc}")
            stack.errors_say(say)
            return 1
        oracle = simulator.stats()["totals"]
        summary = summary_build(samples, redis)
        summary["runs"] = {**run_counts("soak"), "started": samples[-1]["runs_started"]}
        summary["simulator"] = oracle
        summary_say(summary, redis)
        machine = machine_describe(
            redis_kind=stack.redis.kind,
            mqtt_kind=stack.broker.kind,
            database=stack.database,
            load_at_start=load_at_start,
        )
        result = {
            "arguments": vars(args),
            "summary": summary,
            "redis": redis,
            "samples": samples,
            "machine": machine,
        }
        path = result_write(result)
        say(f"soak: wrote {path}; logs in {stack.log_dir()}")
    return 0 if all(summary["bars"].values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("soak: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)
