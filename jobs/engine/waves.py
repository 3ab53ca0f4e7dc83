"""Waves with gates: a fan-out's devices in ordered waves, and what ends a wave. Pure.

A step's `waves` is a list of wave specs, each sized by exactly one of `percent` (of the
step's devices), `count`, `rest` (every device left) or `by_label` (every device left, one
wave per value of that label, values in sorted order, devices without it last). Each spec
may carry a condition (`min_succeeded_percent`, `max_failed_percent`), what a failed
condition does (`on_fail`: pause, the default, or abort), a `soak_seconds` to wait after
the wave and a `gate` before the next one (`auto`, `approval`, or `webhook` with a
`webhook_url`). Devices no spec takes form a last wave with no condition.

Sizes round up, so a wave is at least one device; a wave that finds no device left is
dropped, so every wave has a device and every device is in exactly one wave. The engine
(jobs/engine/wave_gates.py) keeps where a rollout stands in a `Rollout` row; the operator's
actions and the webhook's answer are jobs/rollouts.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..choices import WaveGate, WaveOnFail
from ..models import StepStatus

# The keys of a wave spec that size it; exactly one per spec.
SIZE_KEYS = ("percent", "count", "rest", "by_label")
# What a wave carries over from its spec into the expanded wave (its condition and gate).
WAVE_RULE_KEYS = (
    "min_succeeded_percent",
    "max_failed_percent",
    "on_fail",
    "soak_seconds",
    "gate",
    "webhook_url",
)
# A row that ended without success counts against a wave's max_failed_percent.
WAVE_FAILING = (StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT, StepStatus.CANCELED)
# Waves a rollout may expand into (by_label: one per label value): a wave per store of a
# large chain is a few hundred; thousands of gates is no rollout anyone steers, and the
# number must stay far below StepRun.wave's smallint.
WAVES_EXPANDED_MAX = 1000
# The label value of a wave of the devices that lack the label (by_label).
NO_LABEL = ""


def _label(device: Any, key: str) -> str:
    labels = getattr(device, "labels", None) or {}
    return str(labels.get(key, NO_LABEL))


def waves_expand(specs: Sequence[Mapping[str, Any]], devices: Sequence[Any]) -> tuple[list[int], list[dict]]:
    """(the wave of each device, in the order given; the expanded waves, from 0).

    Each expanded wave is {"size", "label", and the spec's rule keys}; a `by_label` spec
    gives one wave per label value (label "key=value"). Devices no spec takes form a last
    wave of their own with no rule. An empty `specs` is one wave of every device.
    """
    total = len(devices)
    assigned: list[int] = [-1] * total
    left = list(range(total))
    waves: list[dict] = []

    def add(members: list[int], spec: Mapping[str, Any], label: str = "") -> None:
        if not members:
            return
        for position in members:
            assigned[position] = len(waves)
        rules = {key: spec[key] for key in WAVE_RULE_KEYS if key in spec}
        waves.append({"size": len(members), "label": label, **rules})

    for spec in specs:
        if not left:
            break
        if spec.get("by_label"):
            key = spec["by_label"]
            by_value: dict[str, list[int]] = {}
            for position in left:
                by_value.setdefault(_label(devices[position], key), []).append(position)
            # Devices without the label go last, after the sorted values.
            for value in sorted(by_value, key=lambda v: (v == NO_LABEL, v)):
                add(by_value[value], spec, f"{key}={value}" if value != NO_LABEL else f"{key} unset")
            left = []
        elif spec.get("rest"):
            add(left, spec)
            left = []
        else:
            size = spec["count"] if spec.get("count") else math.ceil(total * spec["percent"] / 100)
            size = max(1, min(size, len(left)))
            add(left[:size], spec)
            left = left[size:]
    add(left, {})
    return assigned, waves


def wave_verdict(wave: Mapping[str, Any], by_status: Mapping[str, int]) -> tuple[bool, str]:
    """Whether an ended wave meets its condition, and what it counted (for the event).

    `by_status`: the wave's rows by status. Succeeded and failed percentages are of the
    wave's rows that were not skipped (an aborted rollout skips rows; they did nothing)."""
    total = sum(n for status, n in by_status.items() if status != StepStatus.SKIPPED)
    succeeded = by_status.get(StepStatus.SUCCEEDED, 0)
    failed = sum(by_status.get(status, 0) for status in WAVE_FAILING)
    counted = f"{succeeded} of {total} succeeded, {failed} failed"
    if not total:
        return True, counted
    minimum = wave.get("min_succeeded_percent")
    if minimum is not None and succeeded * 100 < minimum * total:
        return False, f"{counted} (fewer than {minimum}% succeeded)"
    maximum = wave.get("max_failed_percent")
    if maximum is not None and failed * 100 > maximum * total:
        return False, f"{counted} (more than {maximum}% failed)"
    return True, counted


def wave_gate(wave: Mapping[str, Any]) -> str:
    return wave.get("gate") or WaveGate.AUTO


def wave_aborts(wave: Mapping[str, Any]) -> bool:
    """Whether a failed condition aborts the rollout (else it pauses)."""
    return wave.get("on_fail") == WaveOnFail.ABORT


def wave_name(wave_index: int, waves: Sequence[Mapping[str, Any]]) -> str:
    """ "wave 2 of 3" or "wave 3 of 5 (region=eu)", for events and reasons."""
    label = waves[wave_index].get("label") if wave_index < len(waves) else ""
    name = f"wave {wave_index + 1} of {len(waves)}"
    return f"{name} ({label})" if label else name
