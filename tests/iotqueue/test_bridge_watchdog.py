"""A bridge whose MQTT network thread dies exits non-zero, for its supervisor to restart it
(issue 31, finding 15).

A second, real bridge process runs beside the stack's, on its own topic prefix and client
id, with one extra handler on a test topic that raises SystemExit: a BaseException, which
no guard catches (nor should), so it ends paho's network thread exactly as a bug in paho or
an uncaught error would. Before the watchdog that bridge stayed up, deaf and silent.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from iotqueue.bridge import BRIDGE_NETWORK_THREAD_LOST, NETWORK_THREAD_EXIT_CODE
from iotqueue.redis_conn import redis_connection
from tests.conftest import READY
from tests.mqtt_device import mqtt_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]

# How long the doomed bridge gets to notice and exit (the watchdog looks every second).
EXIT_WAIT_SECONDS = 30.0

FAULTY_BRIDGE = """
import sys

import django

django.setup()
from django.core.management import call_command

from iotqueue.bridge import handler_register


def network_thread_end(topic, payload):
    raise SystemExit("a BaseException: no callback guard catches it")


handler_register(sys.argv[1], network_thread_end)
call_command("bridge")
"""


def test_a_bridge_whose_network_thread_dies_exits_non_zero_and_says_so(stack, services):
    # given a second bridge on its own prefix with a handler that ends paho's thread
    prefix = f"{services.namespace}-watchdog"
    topic = f"{prefix}/boom"
    env = {"IOTQUEUE_TOPIC_PREFIX": prefix, "MQTT_BRIDGE_CLIENT_ID": f"{prefix}-bridge"}
    argv = [sys.executable, "-c", FAULTY_BRIDGE, topic]
    child = stack.supervisor.start("doomed-bridge", argv, extra_env=env)
    stack.supervisor.wait_for_log("doomed-bridge", READY["bridge"])
    metric = redis_connection()
    lost_before = int(metric.hget(BRIDGE_NETWORK_THREAD_LOST.key, "") or 0)

    # when a message reaches that handler
    client = mqtt_client(services.mqtt_url)
    try:
        client.publish(topic, b"{}", qos=1).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()

    # then the process exits with the watchdog's status, saying why, and counts it
    try:
        status = child.process.wait(timeout=EXIT_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        stack.supervisor.stop("doomed-bridge")
        pytest.fail(f"the bridge went deaf and stayed up:\n{child.log_tail()}")
    assert status == NETWORK_THREAD_EXIT_CODE, child.log_tail()
    assert "the MQTT network thread has died" in child.log_text()
    assert int(metric.hget(BRIDGE_NETWORK_THREAD_LOST.key, "") or 0) == lost_before + 1
