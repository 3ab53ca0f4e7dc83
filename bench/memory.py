"""Measuring the bench's processes: resident memory from /proc, Redis's used_memory, and a
sampler that reads both every second in a thread (bench.fleet; bench.soak reads them itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MB = 1e6


def rss_bytes(pid: int | None, field: str = "VmRSS") -> int | None:
    """Resident memory of one process from /proc (VmRSS, or RssAnon: its own heap, no
    shared libraries); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, TypeError):
        pass
    return None


def children_pids(parent: int | None) -> list[int]:
    """PIDs whose parent is `parent` (a prefork worker's pool), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return sorted(found)


def redis_memory() -> int:
    from iotqueue.redis_conn import redis_connection

    return int(redis_connection().info("memory")["used_memory"])


class Sampler:
    """VmRSS of every process `pids()` names and Redis used_memory, every `interval`
    seconds, in a thread."""

    def __init__(self, pids: Callable[[], dict[str, int]], *, interval: float = 1.0) -> None:
        self.pids, self.interval = pids, interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        pids = self.pids()
        rss = {name: rss_bytes(pid) for name, pid in pids.items()}
        try:
            memory = redis_memory()
        except Exception:  # a sample, not a verdict: Redis may be busy
            memory = None
        self.samples.append({"at": time.time(), "pids": pids, "rss": rss, "redis_used_memory": memory})

    def peak_mb(self) -> dict[str, float]:
        peaks: dict[str, float] = {}
        for sample in self.samples:
            for name, value in sample["rss"].items():
                if value is not None:
                    peaks[name] = max(peaks.get(name, 0.0), round(value / MB, 1))
        return dict(sorted(peaks.items()))

    def at_mb(self, fraction: float) -> dict[str, float]:
        """Every process's RSS in the sample at `fraction` (0..1) of the run (1: the last)."""
        if not self.samples:
            return {}
        rss = self.samples[min(len(self.samples) - 1, int(fraction * len(self.samples)))]["rss"]
        return {name: round(value / MB, 1) for name, value in sorted(rss.items()) if value is not None}

    def redis_max(self) -> int | None:
        values = [s["redis_used_memory"] for s in self.samples if s["redis_used_memory"] is not None]
        return max(values, default=None)
