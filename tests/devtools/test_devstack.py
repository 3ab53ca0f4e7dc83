"""The dev stack's start-up block: everything a newcomer needs to use the stack, in one place."""

from __future__ import annotations

import shlex

import pytest

from devtools.devstack import access_block

WEB = "http://127.0.0.1:8000"
ENVIRONMENT = {
    "REDIS_URL": "redis://127.0.0.1:41234/0",
    "MQTT_URL": "mqtt://iotqueue:p%2Fw@127.0.0.1:41235",
    "IOTQUEUE_MQTT_AUTH": "dynsec",
    "DEBUG": "true",
    "HOME": "/home/someone",
}


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: formatting the block reaches no server."""


def exported(block: str) -> dict[str, str]:
    """The variables of the block's `export` line, as a shell would set them."""
    (line,) = [line for line in block.splitlines() if line.strip().startswith("export ")]
    words = shlex.split(line.strip())[1:]
    return dict(word.split("=", 1) for word in words)


def test_the_block_names_the_admin_api_and_metrics_with_their_credentials():
    # when the block is formatted for a stack on port 8000
    block = access_block(web_url=WEB, api_token="tok123", metrics_token="met456", environment=ENVIRONMENT)

    # then it says where the admin is and how to log in, the API with its token, the metrics with theirs
    assert f"{WEB}/admin/" in block and "admin / admin" in block
    assert f"{WEB}/api/" in block and "Authorization: Token tok123" in block
    assert f"{WEB}/metrics" in block and "Authorization: Bearer met456" in block
    # and it is short enough to stay on the screen
    assert len(block.splitlines()) <= 10


def test_the_export_line_reaches_the_same_servers_api_and_metrics():
    # when the block is formatted
    block = access_block(web_url=WEB, api_token="tok123", metrics_token="met456", environment=ENVIRONMENT)

    # then pasting its export line gives another shell this stack's servers, the API and both tokens
    assert exported(block) == {
        "REDIS_URL": ENVIRONMENT["REDIS_URL"],
        "MQTT_URL": ENVIRONMENT["MQTT_URL"],
        "IOTQUEUE_MQTT_AUTH": "dynsec",
        "DEBUG": "true",
        "API": f"{WEB}/api",
        "TOKEN": "tok123",
        "IOTQUEUE_METRICS_TOKEN": "met456",
    }


def test_a_database_url_is_exported_only_when_the_stack_has_one_and_values_are_quoted():
    # given a stack on PostgreSQL whose password has characters a shell would interpret
    environment = {**ENVIRONMENT, "DATABASE_URL": "postgres://me:a b$c@db:5432/iotqueue"}

    # when the block is formatted
    block = access_block(web_url=WEB, api_token="t", metrics_token="m", environment=environment)

    # then the export line carries the database URL unchanged through the shell
    assert exported(block)["DATABASE_URL"] == environment["DATABASE_URL"]
    # and without one, none is exported (the CLI then uses the same SQLite file)
    assert "DATABASE_URL" not in exported(
        access_block(web_url=WEB, api_token="t", metrics_token="m", environment=ENVIRONMENT)
    )


def test_the_block_names_the_mtls_listener_and_its_ca_file_or_says_there_is_none():
    # given a stack whose broker has an mTLS listener for certificate devices
    environment = {
        **ENVIRONMENT,
        "MQTT_TLS_URL": "mqtts://127.0.0.1:41236",
        "IOTQUEUE_DEVICE_CA_CERT": "/tmp/stack/mqtt/tls/device-ca.crt",
    }

    # when the block is formatted, then one line names the listener's URL and the CA file
    block = access_block(web_url=WEB, api_token="t", metrics_token="m", environment=environment)
    (line,) = [line for line in block.splitlines() if "MQTT_TLS_URL=" in line]
    assert "MQTT_TLS_URL=mqtts://127.0.0.1:41236" in line and "/tmp/stack/mqtt/tls/device-ca.crt" in line
    assert len(block.splitlines()) <= 10
    # and on a broker without one (the pip-only amqtt), the block says so
    assert "no mTLS listener" in access_block(
        web_url=WEB, api_token="t", metrics_token="m", environment=ENVIRONMENT
    )
