"""Health checks against the real stack (issue 33): /healthz and /readyz, and
`manage.py healthcheck worker|beat|bridge` on the stack's own processes.

/readyz is pointed at a throwaway Redis of its own (the session's Redis is shared by every
test and must stay up); the frozen bridge is a second bridge this test starts, on its own
topic prefix and client id, never the stack's.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
from django.test import Client

from devtools.processes import manage_argv
from devtools.servers import redis_start
from iotqueue.health import bridge_check
from iotqueue.redis_conn import redis_connection, redis_key
from tests.conftest import READY, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# The bound for a frozen bridge to be reported (its heartbeat goes stale in 6-8 s).
FROZEN_BRIDGE_SECONDS = 10.0
# A healthcheck command is a Python process starting Django: seconds, not milliseconds.
COMMAND_TIMEOUT_SECONDS = 60.0
# Stands for a beat on another host that took the lease over.
OTHER_BEAT = "elsewhere:1:00000000"


def healthcheck(stack, process: str, **extra_env: str) -> subprocess.CompletedProcess:
    """Run `manage.py healthcheck <process>` with the stack's environment (its Redis, prefix)."""
    return subprocess.run(
        manage_argv("healthcheck", process),
        env={**stack.supervisor.env, **extra_env},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_SECONDS,
    )


def beat_leading(stack) -> subprocess.CompletedProcess | None:
    """The beat's healthcheck when it says the stack's beat leads, else None."""
    result = healthcheck(stack, "beat")
    return result if "leader" in result.stdout else None


def readyz() -> tuple[int, dict]:
    response = Client().get("/readyz")
    return response.status_code, response.json()


def test_healthz_answers_without_any_dependency(settings):
    # given a Redis URL where nothing listens and a host ALLOWED_HOSTS does not list
    settings.REDIS_URL = "redis://127.0.0.1:1/0"

    # when the liveness probe is asked for
    response = Client().get("/healthz", HTTP_HOST="10.9.8.7")

    # then it answers ok
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_turns_503_naming_redis_while_redis_is_down_and_200_when_back(settings, tmp_path):
    # given a Redis of this test's own, with the database and broker of the stack
    server = redis_start(tmp_path)
    settings.REDIS_URL = server.url
    try:
        status, body = readyz()
        assert status == 200, body
        assert set(body["checks"]) == {"database", "redis", "mqtt_broker"}

        # when that Redis stops
        server.stop()

        # then readiness fails, naming redis and why, the others still ok
        status, body = readyz()
        assert status == 503
        assert body["checks"]["redis"]["status"] == "error" and body["checks"]["redis"]["reason"]
        assert body["checks"]["database"]["status"] == "ok"
        assert body["checks"]["mqtt_broker"]["status"] == "ok"

        # and when it is back, readiness is ok again
        server.restart()
        wait_for(lambda: readyz()[0] == 200, what="/readyz to be 200 with Redis back")
    finally:
        server.stop()


def test_readyz_is_exempt_from_the_https_redirect_and_the_host_check(settings):
    # given a production-like HTTPS redirect and host list
    settings.SECURE_SSL_REDIRECT = True
    settings.ALLOWED_HOSTS = ["iotqueue.example.com"]

    # when a probe comes over plain HTTP to the pod's own address
    response = Client().get("/readyz", HTTP_HOST="10.9.8.7:8000")

    # then it is answered, not redirected nor refused
    assert response.status_code == 200, response.content


def test_healthcheck_worker_is_ok_with_the_stacks_worker(stack):
    result = healthcheck(stack, "worker")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("worker: ok:") and "answered the ping" in result.stdout


def test_healthcheck_beat_tells_leader_from_standby(stack):
    # given the stack's beat, holding the lease
    lease = redis_key("beat", "lease")
    redis = redis_connection()
    leader = wait_for(lambda: beat_leading(stack), what="the stack's beat to lead")
    assert leader.returncode == 0 and leader.stdout.startswith("beat: ok: leader")

    # when another beat holds the lease (as one on another host that took it over)
    redis.set(lease, OTHER_BEAT, px=60_000)
    try:
        # then the stack's beat is reported as a healthy standby naming the holder
        standby = healthcheck(stack, "beat")
        assert standby.returncode == 0, standby.stderr
        assert standby.stdout.startswith("beat: ok: standby") and OTHER_BEAT in standby.stdout
    finally:
        # and once the other gives it up, the stack's beat leads again
        if redis.get(lease) == OTHER_BEAT:
            redis.delete(lease)
    wait_for(lambda: beat_leading(stack), what="the stack's beat to lead again")


def test_healthcheck_bridge_ok_for_the_stacks_bridge(stack):
    result = healthcheck(stack, "bridge")
    assert result.returncode == 0, result.stderr
    assert "connected" in result.stdout


def check_failed(client_id: str):
    """The bridge's check when it failed, else None (for wait_for)."""
    check = bridge_check(client_id)
    return None if check.ok else check


def test_healthcheck_bridge_fails_once_the_bridge_is_frozen(stack, services):
    # given a second bridge of this test's own, running and reported healthy
    prefix = f"{services.namespace}-health"
    client_id = f"{prefix}-bridge"
    env = {"IOTQUEUE_TOPIC_PREFIX": prefix, "MQTT_BRIDGE_CLIENT_ID": client_id}
    stack.supervisor.start("health-bridge", manage_argv("bridge"), extra_env=env)
    try:
        stack.supervisor.wait_for_log("health-bridge", READY["bridge"])
        wait_for(lambda: bridge_check(client_id).ok, what="the bridge's first heartbeat")
        assert healthcheck(stack, "bridge", **env).returncode == 0

        # when the process is frozen (SIGSTOP)
        stack.supervisor.kill("health-bridge", signal.SIGSTOP)

        # then its check fails within the bound, saying it is frozen (its heartbeat stale)
        failed = wait_for(
            lambda: check_failed(client_id), timeout=FROZEN_BRIDGE_SECONDS, what="a failed check"
        )
        assert "frozen" in failed.reason, failed.reason
        # and the command exits 1 saying so. (A command that starts Django on a loaded
        # machine may run after the heartbeat's key expired, BRIDGE_HEARTBEAT_TTL_SECONDS
        # after the last beat: it then fails as "no heartbeat", which is as much a failure.)
        result = healthcheck(stack, "bridge", **env)
        assert result.returncode == 1
        assert result.stderr.startswith("bridge: FAIL:")
        assert "frozen" in result.stderr or "no heartbeat" in result.stderr, result.stderr
    finally:
        stack.supervisor.kill("health-bridge", signal.SIGCONT)
        stack.supervisor.stop("health-bridge")
