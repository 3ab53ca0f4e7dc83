"""Test-only Celery tasks around canvas device commands: the user's own links.

The test worker imports this module (`--include`, see tests/conftest.py). Each records what
it got in a Redis list named by the test, so the test can wait for it.
"""

from __future__ import annotations

import json

from celery import shared_task

from iotqueue.redis_conn import redis_connection, redis_key


def _record(key: str, value) -> None:
    redis_connection().rpush(redis_key(f"canvas-test:{key}"), json.dumps(value))


def recorded(key: str) -> list:
    return [json.loads(item) for item in redis_connection().lrange(redis_key(f"canvas-test:{key}"), 0, -1)]


@shared_task(name="tests.canvas.fetch_url")
def fetch_url(version: str) -> dict:
    return {"url": f"https://firmware.example/{version}.bin"}


@shared_task(name="tests.canvas.report")
def report(result, key: str) -> dict:
    _record(key, result)
    return result


@shared_task(name="tests.canvas.summarize", ignore_result=False)
def summarize(results, key: str) -> int:
    _record(key, results)
    return len(results)


@shared_task(name="tests.canvas.on_error")
def on_error(request, exc, traceback, key: str) -> None:
    _record(key, {"task_id": request.id, "error": f"{type(exc).__name__}: {exc}"})


# The gate waits this long at most (retries of GATE_RETRY_SECONDS) before giving up.
GATE_RETRIES = 600
GATE_RETRY_SECONDS = 0.1


def gate_open(key: str) -> None:
    _record(key, "open")


@shared_task(name="tests.canvas.gate", bind=True, max_retries=GATE_RETRIES)
def gate(self, key: str) -> None:
    """Holds its chain until the test opens the gate; retries, so no worker process waits."""
    if not recorded(key):
        raise self.retry(countdown=GATE_RETRY_SECONDS)
