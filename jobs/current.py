"""What a device is doing now: the answer to its `jobs/get` (device protocol v1.1).

A device that lost track of its command (it rebooted, its firmware crashed) publishes
`P/D/jobs/get`; the bridge hands the question to a worker (`jobs.device_jobs_get`, at most
JOBS_GET_RATE a second per device: more is dropped and counted, the answer would not change), which
answers on `P/D/jobs/current` with the command the device holds the lock for, exactly as it
was sent (same id, attempt and fence, so the device's replies answer that attempt), and how
many holders wait for the device's lock. Nothing changes state: asking twice, or after the
command ended, only answers again (with `null` once it ended).

How it fails: the answer is QoS 1 but not retained, so a device that subscribes to
`P/D/jobs/current` after asking misses it and asks again. A worker that cannot reach the
broker logs the failed publish and the device's question goes unanswered; its attempt's
deadline still bounds the wait.
"""

from __future__ import annotations

import logging

from devices import protocol
from devices.locks import device_lock_state
from iotqueue.mqtt import PublishError, publisher

from .engine.dispatch import command_message
from .engine.kinds import row_commanded
from .models import STEP_IN_FLIGHT, StepRun

log = logging.getLogger(__name__)

# The task the bridge's jobs/get handler sends (jobs/replies.py), by name.
JOBS_GET_TASK = "jobs.device_jobs_get"
# How often one device's jobs/get is answered (each answer is a Celery task on the shared
# queue): a device asks after a reboot or a lost command, so twice a second is plenty, and a
# device asking 1,000 times a second cannot delay other devices' hand-offs. The burst lets a
# device ask a few times in a row (an answer it missed, a command it just finished).
JOBS_GET_RATE = 2.0
JOBS_GET_BURST = 10


def device_command_current(*, device: str) -> StepRun | None:
    """The step whose command `device` should be executing now, or None.

    In flight (dispatched or in progress) on the device; the device lock allows at most
    one. A task step holds the lock but sends the device nothing, so it is not a command.
    """
    step_run = (
        StepRun.objects.select_related("run", "device")
        .filter(device__name=device, status__in=STEP_IN_FLIGHT)
        .order_by("-dispatched_at")
        .first()
    )
    if step_run is None or not row_commanded(step_run):
        return None
    return step_run


def device_jobs_current(*, device: str) -> bytes:
    """The `jobs/current` payload for `device`: its current command (or null) and queue length."""
    step_run = device_command_current(device=device)
    command = command_message(step_run)[1] if step_run is not None else None
    queued = len(device_lock_state(device).queue)
    return protocol.jobs_current_payload(command=command, queued=queued)


def device_jobs_answer(*, device: str) -> None:
    """Publish the answer to a device's jobs/get on P/<device>/jobs/current (QoS 1)."""
    topic = protocol.device_topic(device, protocol.JOBS_CURRENT)
    try:
        publisher.publish(topic, device_jobs_current(device=device))
    except PublishError as exc:
        log.warning("jobs/get of %s not answered: %s", device, exc)
