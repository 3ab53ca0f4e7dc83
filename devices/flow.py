"""Per-device flow control: space commands for firmware that misbehaves when flooded.

A device may declare `min_interval_seconds` between commands and/or `max_per_minute`. The
engine asks `device_flow_waits` before publishing while it holds the device's lock; a
positive answer means "publish later" (the step keeps the lock and waits in the deadline
set, no worker sleeps). Send times live in a short Redis list per device, kept only for
devices that have limits.
"""

from __future__ import annotations

import time
from typing import Any

from iotqueue.redis_conn import redis_connection, redis_key

from .models import Device

# A send time older than this cannot matter to a per-minute limit or an interval.
WINDOW_SECONDS = 60.0


def _key(device: Device) -> str:
    return redis_key("sent", "{" + device.name + "}")


def device_flow_limited(device: Device) -> bool:
    """Whether the device spaces its commands (`min_interval_seconds`, `max_per_minute`)."""
    return bool(device.min_interval_seconds or device.max_per_minute)


def device_flow_wait(device: Device, *, now: float | None = None) -> float:
    """Seconds to wait before the device may get its next command (0 = now)."""
    return device_flow_waits([device], now=now).get(device.name, 0.0)


def device_flow_waits(devices: list[Device], *, now: float | None = None) -> dict[str, float]:
    """`device_flow_wait` of the devices that space their commands, in one round trip;
    devices without limits are left out (they wait for nothing)."""
    limited = {d.name: d for d in devices if device_flow_limited(d)}
    if not limited:
        return {}
    with redis_connection().pipeline(transaction=False) as pipe:
        for device in limited.values():
            pipe.lrange(_key(device), 0, max(1, device.max_per_minute) - 1)
        lists = pipe.execute()
    now = time.time() if now is None else now
    return {
        device.name: flow_wait(
            [float(t) for t in sent],
            min_interval_seconds=device.min_interval_seconds,
            max_per_minute=device.max_per_minute,
            now=now,
        )
        for device, sent in zip(limited.values(), lists, strict=True)
    }


def flow_wait(sent: list[float], *, min_interval_seconds: float, max_per_minute: int, now: float) -> float:
    """Seconds until the next command may go, from the send times `sent` (newest first):
    `min_interval_seconds` after the newest, and while `max_per_minute` were sent within
    WINDOW_SECONDS, until the oldest of them leaves the window. 0 = now; 0 limits = none."""
    wait = 0.0
    if sent and min_interval_seconds:
        wait = max(wait, sent[0] + min_interval_seconds - now)
    if max_per_minute and len(sent) >= max_per_minute:
        wait = max(wait, sent[max_per_minute - 1] + WINDOW_SECONDS - now)
    return max(0.0, wait)


def device_flow_record(device: Device, *, now: float | None = None, pipe: Any | None = None) -> None:
    """Remember that a command went to the device now (newest first); on `pipe` (a pipeline
    of `redis_connection()`) when given, for the caller to send."""
    if not device_flow_limited(device):
        return
    if pipe is None:
        with redis_connection().pipeline(transaction=False) as own:
            device_flow_record(device, now=now, pipe=own)
            own.execute()
        return
    key = _key(device)
    pipe.lpush(key, time.time() if now is None else now)
    pipe.ltrim(key, 0, max(1, device.max_per_minute) - 1)
    pipe.expire(key, int(WINDOW_SECONDS * 2))
