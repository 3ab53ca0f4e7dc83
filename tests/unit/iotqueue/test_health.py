"""The health checks' judgements (iotqueue/health.py) and the probe middleware's liveness answer
(iotqueue/probes.py), without any server. The real stack is tests/iotqueue/test_health.py."""

from __future__ import annotations

import json

from django.test import RequestFactory

from iotqueue.health import (
    BRIDGE_HEARTBEAT_STALE_SECONDS,
    Check,
    beat_verdict,
    bridge_verdict,
    check_run,
    readiness_report,
    worker_verdict,
)
from iotqueue.probes import ProbeMiddleware

NOW = 1_800_000_000.0


def heartbeat(**fields: object) -> dict[str, str]:
    values = {"host": "h", "pid": 7, "connected": 1, "network_thread_alive": 1, "last_message": 0, "at": NOW}
    values.update(fields)
    return {key: str(value) for key, value in values.items()}


def test_a_failing_probe_becomes_a_failed_check_naming_the_error():
    # given a probe that raises
    def probe() -> str:
        raise ConnectionError("refused")

    # when it is run as a check
    check = check_run("redis", probe)

    # then the check failed, saying why, and nothing was raised
    assert check == Check("redis", False, "ConnectionError: refused")


def test_readiness_is_503_naming_the_failed_check():
    # given one failing check among passing ones
    checks = [Check("database", True, "sqlite"), Check("redis", False, "ConnectionError: refused")]

    # when reported
    status, body = readiness_report(checks)

    # then 503, each check named with its status and reason
    assert status == 503
    assert body == {
        "status": "error",
        "checks": {
            "database": {"status": "ok", "reason": "sqlite"},
            "redis": {"status": "error", "reason": "ConnectionError: refused"},
        },
    }
    assert readiness_report([Check("database", True, "sqlite")])[0] == 200


def test_bridge_fresh_connected_and_alive_is_healthy():
    check = bridge_verdict(heartbeat(last_message=NOW - 3), now=NOW + 1)
    assert check.ok, check
    assert "last message 4s ago" in check.reason


def test_bridge_without_heartbeat_or_with_a_stale_one_is_not_healthy():
    assert not bridge_verdict({}, now=NOW).ok
    stale = bridge_verdict(heartbeat(), now=NOW + BRIDGE_HEARTBEAT_STALE_SECONDS + 0.5)
    assert not stale.ok and "frozen" in stale.reason


def test_bridge_with_a_dead_network_thread_or_disconnected_is_not_healthy():
    dead = bridge_verdict(heartbeat(network_thread_alive=0), now=NOW)
    assert not dead.ok and "network thread is dead" in dead.reason
    disconnected = bridge_verdict(heartbeat(connected=0), now=NOW)
    assert not disconnected.ok and "not connected" in disconnected.reason


def test_beat_tells_leader_from_standby():
    # given a recent tick of the beat whose owner token is "a"
    record = {"owner": "a", "holding": "1", "at": str(NOW)}

    # then it is the leader when the lease names it, a standby when it names another
    leader = beat_verdict(record, holder="a", now=NOW + 1, stale_seconds=20)
    standby = beat_verdict({**record, "holding": "0"}, holder="b", now=NOW + 1, stale_seconds=20)
    assert leader.ok and leader.reason.startswith("leader")
    assert standby.ok and standby.reason.startswith("standby") and "held by b" in standby.reason


def test_beat_with_no_or_an_old_tick_is_not_healthy():
    assert not beat_verdict({}, holder=None, now=NOW, stale_seconds=20).ok
    record = {"owner": "a", "holding": "1", "at": str(NOW - 21)}
    old = beat_verdict(record, holder="a", now=NOW, stale_seconds=20)
    assert not old.ok and "frozen" in old.reason


def test_worker_must_be_this_hosts_unless_any_host_will_do():
    replies = [{"worker@other": {"ok": "pong"}}]
    assert worker_verdict([{"worker@here": {"ok": "pong"}}], host="here", any_host=False).ok
    mine_missing = worker_verdict(replies, host="here", any_host=False)
    assert not mine_missing.ok and "worker@other" in mine_missing.reason
    assert worker_verdict(replies, host="here", any_host=True).ok
    assert not worker_verdict([], host="here", any_host=True).ok


def test_liveness_is_answered_before_the_rest_of_the_stack_without_host_check():
    # given the middleware in front of a view that must not be reached
    def unreachable(request):
        raise AssertionError("the probe went past the middleware")

    middleware = ProbeMiddleware(unreachable)

    # when /healthz is asked for under a host ALLOWED_HOSTS does not list
    response = middleware(RequestFactory().get("/healthz", HTTP_HOST="10.1.2.3:8000"))

    # then it answers 200 ok itself, uncached
    assert response.status_code == 200
    assert json.loads(response.content) == {"status": "ok"}
    assert response["Cache-Control"] == "no-store"


def test_other_paths_and_methods_pass_through():
    passed = []
    middleware = ProbeMiddleware(lambda request: passed.append(request.path) or "next")
    assert middleware(RequestFactory().get("/admin/")) == "next"
    assert middleware(RequestFactory().post("/healthz")) == "next"
    assert passed == ["/admin/", "/healthz"]
