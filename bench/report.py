"""Percentiles, the machine description, and the result file under bench/results/."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BASE_DIR / "bench" / "results"


def percentile(samples: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile (fraction 0..1) of samples; None when there are none."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def spread_ms(samples: list[float]) -> dict[str, float | None]:
    """p50 / p99 / max of samples given in seconds, in milliseconds."""
    return {
        "p50": ms(percentile(samples, 0.50)),
        "p99": ms(percentile(samples, 0.99)),
        "max": ms(max(samples) if samples else None),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_mb() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return None


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=BASE_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.rstrip() if done.returncode == 0 else ""  # porcelain lines start with a space


def code_describe() -> dict[str, Any]:
    """Which code was measured: the commit, and whether files outside bench/ were modified."""
    changed = [line[3:] for line in _git("status", "--porcelain").splitlines()]
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "modified_outside_bench": sorted(p for p in changed if not p.startswith("bench/")),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_summary() -> dict[str, Any]:
    """The few facts the JSON line carries about where it was measured."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def machine_describe(
    *, redis_kind: str, mqtt_kind: str, database: str, load_at_start: list[float], code: bool = True
) -> dict[str, Any]:
    """Everything a later reader needs to compare a result file with another one.

    `code=False` leaves out the commit and modified files (no `git` is run).
    """
    return {
        **machine_summary(),
        "cpu_model": _cpu_model(),
        "memory_mb": _memory_mb(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "redis": redis_kind,
        "mqtt": mqtt_kind,
        "database": database,
        "versions": {p: _version(p) for p in ("celery", "kombu", "redis", "django", "paho-mqtt")},
        # Anything else running on the machine competes for its 2 cores: a high figure here
        # means the result understates the system.
        "load_average_at_start": load_at_start,
        "load_average_at_end": _load_average(),
        **({"code": code_describe()} if code else {}),
    }


def result_write(result: dict[str, Any], machine: dict[str, Any]) -> Path:
    """Write the result and the machine description to bench/results/<UTC timestamp>.json."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({**result, "machine": machine}, indent=2) + "\n")
    return path
