"""A process that starts against a misconfigured dependency fails at once in one line that
says what to do, with status 1 and no traceback (iotqueue/startup.py; docs/operations.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.servers import free_port, mqtt_broker_start
from tests.conftest import database_url

# The test database must exist (and be migrated) for the bridge's other checks to pass.
pytestmark = pytest.mark.django_db(transaction=True)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# A bound on the whole start, not a timing target: the checks wait PROBE_SECONDS at most
# each, the rest is the interpreter and Django starting (slow on a loaded machine).
START_BOUND_SECONDS = 60


@pytest.fixture
def bridge_env(services, django_db_setup, django_db_blocker) -> dict[str, str]:
    """The environment the stack's bridge gets: the test database, Redis and broker."""
    with django_db_blocker.unblock():
        url = database_url()
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
        "DEBUG": "true",
        "DATABASE_URL": url,
        "REDIS_URL": services.redis_url,
        "MQTT_URL": services.mqtt_url,
        "IOTQUEUE_MQTT_AUTH": os.environ.get("IOTQUEUE_MQTT_AUTH", "") or services_auth(services),
    }


def services_auth(services) -> str:
    return services.broker.auth if services.broker else "none"


def bridge_start(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "bridge"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_BOUND_SECONDS,
    )


def assert_one_line_failure(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("bridge: ") and all(word in line for word in words), result.stderr


def test_a_broker_without_dynamic_security_is_named_in_one_line(bridge_env, tmp_path):
    # given an anonymous broker without the dynamic security plugin, and dynsec asked for
    broker = mqtt_broker_start(tmp_path, mode="pip")
    try:
        env = {**bridge_env, "MQTT_URL": broker.url, "IOTQUEUE_MQTT_AUTH": "dynsec"}

        # when the bridge starts
        result = bridge_start(env)
    finally:
        broker.stop()

    # then it fails in one line that says what to do
    assert_one_line_failure(result, "no dynamic security plugin", "IOTQUEUE_MQTT_AUTH=none")


def test_wrong_broker_credentials_are_named_in_one_line(bridge_env, services):
    # given the session's broker, which checks passwords, and a wrong one in MQTT_URL
    if services.broker is None or services.broker.auth != "dynsec":
        pytest.skip("needs the embedded Mosquitto with its dynamic security plugin")
    url = services.mqtt_url.replace("@", "x@", 1)

    # when the bridge starts
    result = bridge_start({**bridge_env, "MQTT_URL": url})

    # then it says the broker refused the credentials
    assert_one_line_failure(result, "refused the connection", "MQTT_URL")


def test_an_unreachable_redis_is_named_in_one_line(bridge_env):
    # given a REDIS_URL where nothing listens
    port = free_port()

    # when the bridge starts
    result = bridge_start({**bridge_env, "REDIS_URL": f"redis://:hidden@127.0.0.1:{port}/0"})

    # then it names the address (not the password)
    assert_one_line_failure(result, f"cannot reach Redis at 127.0.0.1:{port}")
    assert "hidden" not in result.stderr


def test_an_unmigrated_database_says_to_migrate(bridge_env, tmp_path):
    # given an empty database
    empty = tmp_path / "empty.sqlite3"

    # when the bridge starts on it
    result = bridge_start({**bridge_env, "DATABASE_URL": f"sqlite:///{empty}"})

    # then it says to run migrate
    assert_one_line_failure(result, "manage.py migrate")


# Each entry point as production starts it (Dockerfile, docker-compose.yml), named as its line is.
ENTRY_POINTS = {
    "manage.py": ["manage.py", "check"],
    "web": ["-m", "gunicorn", "iotqueue.wsgi:application", "--bind", "127.0.0.1:0", "--no-control-socket"],
    "worker": ["-m", "celery", "-A", "iotqueue", "worker", "--pool=solo"],
    "beat": ["-m", "celery", "-A", "iotqueue", "beat"],
}
# A key Django's deploy check accepts (50 characters, many distinct ones).
GOOD_SECRET_KEY = "k" + "".join(chr(ord("A") + n % 58) for n in range(60))


def production_start(process: str, **variables: str) -> subprocess.CompletedProcess:
    """Start an entry point without DEBUG, with `variables` set (a .env file cannot fill in
    what is set here, empty or not)."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "iotqueue.settings", "DEBUG": "false", **variables}
    return subprocess.run(
        [sys.executable, *ENTRY_POINTS[process]],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_BOUND_SECONDS,
    )


def assert_settings_line(result: subprocess.CompletedProcess, start: str) -> None:
    """A non-zero exit, no traceback, and a line of stderr that starts with `start` (gunicorn
    logs its own lines around the web's)."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert any(line.startswith(start) for line in result.stderr.splitlines()), result.stderr


@pytest.mark.parametrize("process", ENTRY_POINTS)
def test_a_missing_secret_key_is_named_in_one_line_by_every_entry_point(process):
    # when a process starts without DEBUG and without a SECRET_KEY
    result = production_start(process, SECRET_KEY="", ALLOWED_HOSTS="iotqueue.example.com")

    # then it exits non-zero with one line, after its name, that says what to set; no traceback
    assert_settings_line(result, f"{process}: SECRET_KEY is not set. With DEBUG off, set SECRET_KEY")


@pytest.mark.parametrize("process", ["web", "worker"])
def test_missing_allowed_hosts_are_named_in_one_line(process):
    # when a process starts without DEBUG, with a good key but no ALLOWED_HOSTS
    result = production_start(process, SECRET_KEY=GOOD_SECRET_KEY, ALLOWED_HOSTS="")

    # then its one line names ALLOWED_HOSTS
    assert_settings_line(result, f"{process}: ALLOWED_HOSTS is not set. With DEBUG off, set it")
