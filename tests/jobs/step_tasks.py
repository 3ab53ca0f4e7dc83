"""Test-only step tasks (template steps of kind `task`), as a user's own tasks would look.

The test worker imports this module (`--include`, see tests/conftest.py); the tests import
it too, so the web side (template validation) knows the same registered names.
"""

from __future__ import annotations

import time

from celery import shared_task

from iotqueue.redis_conn import redis_connection, redis_key
from jobs.tasksteps import step_task

# How long `gate_wait` waits for its gate before it gives up (a broken test must not hang).
GATE_WAIT_SECONDS = 20.0


@step_task
@shared_task(name="tests.firmware_url")
def firmware_url(version: str) -> dict:
    """What a user's task that looks a firmware image up returns: where to fetch it."""
    return {"url": f"https://fw.example.com/pump-{version}.bin", "version": version}


@step_task
@shared_task(name="tests.always_fails")
def always_fails(reason: str) -> dict:
    raise RuntimeError(reason)


@step_task
@shared_task(name="tests.gate_wait")
def gate_wait(gate: str) -> str:
    """Block until the test opens the gate (a Redis key), so the step is observably running."""
    conn = redis_connection()
    conn.set(redis_key(f"test-gate-entered:{gate}"), "1", ex=60)
    deadline = time.monotonic() + GATE_WAIT_SECONDS
    while not conn.exists(redis_key(f"test-gate:{gate}")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} was never opened")
        time.sleep(0.05)
    return "passed"


@shared_task(name="tests.not_a_step_task")
def not_a_step_task() -> None:
    """A Celery task that was not registered as a step task: templates may not name it."""
