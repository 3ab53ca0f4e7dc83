"""CPU time by component (worker, bridge, this process, servers) and for the whole machine.

Read from /proc, so Linux only; elsewhere the figures are absent. The machine's total shows
how much of its 2 cores other programs took during a phase: a busy neighbour depresses
every throughput figure here, the baseline's included.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Process trees here are a few levels deep; the bound only guards against a parent cycle.
MAX_DEPTH = 64


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # fields from 3 (state) on; the name may hold spaces


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def _owners(roots: dict[str, int], parents: dict[int, int]) -> dict[str, set[int]]:
    """Each process under a root, assigned to its nearest root ancestor.

    Nearest, because this process is itself an ancestor of every other root.
    """
    by_pid = {pid: name for name, pid in roots.items()}
    owned: dict[str, set[int]] = {name: set() for name in roots}
    for pid in parents:
        ancestor, hops = pid, 0
        while ancestor not in by_pid and ancestor in parents and hops < MAX_DEPTH:
            ancestor, hops = parents[ancestor], hops + 1
        if ancestor in by_pid:
            owned[by_pid[ancestor]].add(pid)
    return owned


def _process_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        if (fields := _stat_fields(pid)) is not None:
            total += int(fields[11]) + int(fields[12])  # utime + stime, all threads
    return total / TICKS_PER_SECOND


def _machine_busy_seconds() -> float | None:
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / TICKS_PER_SECOND


@dataclass
class CpuSample:
    at: float
    components: dict[str, float]
    machine: float | None


def cpu_sample(roots: dict[str, int]) -> CpuSample:
    """CPU seconds used so far by each component (its root process and descendants)."""
    owned = _owners(roots, _parents())
    components = {name: _process_seconds(pids) for name, pids in owned.items()}
    return CpuSample(time.monotonic(), components, _machine_busy_seconds())


def cpu_report(before: CpuSample, after: CpuSample, *, steps: int) -> dict[str, object]:
    """CPU ms per finished step by component, and cores busy on average (ours vs. others)."""
    seconds = after.at - before.at
    used = {name: after.components[name] - before.components.get(name, 0.0) for name in after.components}
    ours = sum(used.values())
    report: dict[str, object] = {
        "ms_per_step": {name: round(value * 1000 / max(steps, 1), 2) for name, value in used.items()},
        "ours_cores": round(ours / seconds, 2),
    }
    if before.machine is not None and after.machine is not None:
        busy = (after.machine - before.machine) / seconds
        report["machine_busy_cores"] = round(busy, 2)
        report["others_cores"] = round(max(0.0, busy - ours / seconds), 2)
    return report
