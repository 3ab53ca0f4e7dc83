"""Test-only device-locked tasks that talk to a (simulated) device over MQTT themselves.

They are what a user's own task looks like: the body publishes a command and blocks until
the device's `done` for it arrives — device I/O the task does itself, outside the engine.
The test worker imports this module (`--include`, see tests/conftest.py); the app never does.
The task id travels as the command's "run" so the simulator's records name the task. The
worker records when each of these tasks starts and ends (`task_started`, `task_ended`), so a
test can wait for a run to be over instead of sleeping.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

from celery import current_task, shared_task
from celery.signals import task_postrun, task_prerun

from devices import protocol
from devices.task_lock import DeviceLockedTask, device_locked_task, task_lock_hold
from iotqueue.mqtt import client_connect, client_create, publisher
from iotqueue.redis_conn import redis_connection, redis_key

# How long a body waits for the broker's SUBACK and then for the device's done.
REPLY_WAIT_SECONDS = 15.0


def command_roundtrip(device: str, action: str, *, run: str, token: int | None) -> dict:
    """Publish one command to `device` and wait for its done (TimeoutError if none comes)."""
    command_id = f"task-{uuid.uuid4().hex[:12]}"
    done_topic = protocol.device_topic(device, "done")
    subscribed, done = threading.Event(), threading.Event()
    reply: dict = {}

    def on_connect(client, userdata, flags, reason_code, properties):
        client.subscribe(done_topic, qos=1)

    def on_message(client, userdata, message):
        # amqtt may deliver stray retained messages of other topics: ignore anything else.
        if message.topic != done_topic:
            return
        body = json.loads(message.payload)
        if isinstance(body, dict) and body.get("id") == command_id:
            reply.update(body)
            done.set()

    client = client_create("lock-task")
    client.on_connect, client.on_message = on_connect, on_message
    client.on_subscribe = lambda *args: subscribed.set()
    client_connect(client)
    try:
        if not subscribed.wait(REPLY_WAIT_SECONDS):
            raise TimeoutError(f"no SUBACK for {device}'s done topic")
        payload = protocol.command_payload(
            command_id=command_id,
            run=run,
            step=0,
            attempt=1,
            token=token,
            action=action,
            args={},
            deadline=(datetime.now(UTC) + timedelta(seconds=REPLY_WAIT_SECONDS)).isoformat(),
        )
        publisher.publish(protocol.command_topic(device, action), payload)
        if not done.wait(REPLY_WAIT_SECONDS):
            raise TimeoutError(f"{device} did not answer {command_id}")
        return reply
    finally:
        client.disconnect()
        client.loop_stop()


@shared_task(base=DeviceLockedTask, bind=True, name="tests.lock_tasks.device_command", lock_lease_seconds=10)
def device_command(self, device: str, action: str) -> dict:
    return command_roundtrip(device, action, run=self.request.id or "inline", token=self.lock_fence)


# A lease far shorter than the device's answer: only the lease extender keeps the lock.
@shared_task(base=DeviceLockedTask, bind=True, name="tests.lock_tasks.long_command", lock_lease_seconds=1.5)
def long_command(self, device: str, action: str) -> dict:
    return command_roundtrip(device, action, run=self.request.id, token=self.lock_fence)


@device_locked_task(device_arg="target", name="tests.lock_tasks.failing_command")
def failing_command(action: str, target: str) -> None:
    """Unbound, device in a differently named argument: the fence comes from task_lock_hold()."""
    command_roundtrip(target, action, run=current_task.request.id, token=task_lock_hold().fence)
    raise RuntimeError("the body failed after its command")


@shared_task(name="tests.lock_tasks.sentinel")
def sentinel() -> None:
    """Does nothing: sent after something, its end shows the worker took what was sent before."""


def _events_key() -> str:
    return redis_key("test-task-events")


@task_prerun.connect
def _task_started(task_id: str, task, **kwargs) -> None:
    if task.name.startswith("tests.lock_tasks."):
        redis_connection().rpush(_events_key(), json.dumps(["started", task_id]))


# Celery sends task_postrun after everything a run does, a chain's next link included.
@task_postrun.connect
def _task_ended(task_id: str, task, **kwargs) -> None:
    if task.name.startswith("tests.lock_tasks."):
        redis_connection().rpush(_events_key(), json.dumps(["ended", task_id]))


def _task_events(event: str, task_id: str) -> int:
    return sum(
        1 for raw in redis_connection().lrange(_events_key(), 0, -1) if json.loads(raw) == [event, task_id]
    )


def task_started(task_id: str) -> int:
    """How many runs of task `task_id` a worker started (a parked task runs again when handed the lock)."""
    return _task_events("started", task_id)


def task_ended(task_id: str) -> int:
    """How many runs of task `task_id` a worker finished, whatever the outcome (parked included)."""
    return _task_events("ended", task_id)
