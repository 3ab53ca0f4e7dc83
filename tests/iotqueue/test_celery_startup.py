"""The Celery worker and beat check Redis and the database at start and fail in one line,
with status 1 and no traceback (iotqueue/celery.py, iotqueue/startup.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from devtools.processes import beat_argv, worker_argv
from devtools.servers import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# A bound on the whole start, not a timing target: the Redis probe gives up at once on a
# refused connection; the rest is the interpreter, Django and Celery starting (slow on a
# loaded machine). Without the check a worker would retry the broker for ever.
START_BOUND_SECONDS = 60


def unreachable_redis_env() -> tuple[dict[str, str], int]:
    """Development settings with REDIS_URL (and so the Celery broker) on a port where nothing listens."""
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "DATABASE_URL"}
    }
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
            "DEBUG": "true",
            "REDIS_URL": f"redis://:hidden@127.0.0.1:{port}/0",
        }
    )
    return env, port


def start(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=START_BOUND_SECONDS
    )


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_celery_against_an_unreachable_redis_exits_with_one_line(process, tmp_path):
    # given a REDIS_URL where nothing listens
    env, port = unreachable_redis_env()
    argv = worker_argv(concurrency=1) if process == "worker" else beat_argv(tmp_path)

    # when the process starts
    result = start(argv, env)

    # then it exits 1 with one line naming Redis and where (not the password), no traceback
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{process}: cannot reach Redis at 127.0.0.1:{port}/0 (REDIS_URL)"), result.stderr
    assert "hidden" not in result.stderr
