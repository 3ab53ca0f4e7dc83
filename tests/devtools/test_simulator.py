"""The device simulator against a real MQTT broker: protocol replies, behaviours and the lock oracle."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from django.core.management import call_command

from devices import protocol
from devtools.processes import manage_argv
from devtools.simulator import DeviceBehaviour, Overlap, Simulator, TokenRegression
from iotqueue.mqtt import broker_address
from jobs.models import JobRun, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = pytest.mark.timeout(60)

# Long enough to publish a second command while the first is still in flight, short for a fast suite.
SLOW_MS = 400
# Heartbeats of a device under watch: frequent, so one published after a moment of interest
# comes soon (a negative check waits for it instead of sleeping).
HEARTBEAT_SECONDS = 0.1
# Upper bound on any wait for the broker: loopback round trips take milliseconds, so this only
# turns a broken test into a quick failure.
WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool

    @property
    def body(self) -> Any:
        return json.loads(self.payload)


class Observer:
    """A plain paho client standing in for the server: publishes commands, records all it receives."""

    def __init__(self, url: str) -> None:
        self.messages: list[Message] = []
        self._changed = threading.Condition()
        self._subacks: set[int] = set()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"simtest-observer-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv311,
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        address = broker_address(url)
        if address.username:
            self.client.username_pw_set(address.username, address.password)
        self.client.connect(address.host, address.port, keepalive=10)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        with self._changed:
            self.messages.append(Message(message.topic, message.payload, bool(message.retain)))
            self._changed.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._changed:
            self._subacks.add(mid)
            self._changed.notify_all()

    def subscribe(self, *topics: str) -> None:
        for topic in topics:
            _, mid = self.client.subscribe(topic, qos=1)
            with self._changed:
                assert self._changed.wait_for(lambda mid=mid: mid in self._subacks, WAIT_SECONDS), (
                    f"no SUBACK for {topic}"
                )

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(WAIT_SECONDS)

    def wait_for(self, predicate: Callable[[Message], bool], *, after: int = 0) -> Message:
        """The first matching message (from index `after` on), waiting up to WAIT_SECONDS for it."""

        def found() -> Message | None:
            return next((message for message in self.messages[after:] if predicate(message)), None)

        with self._changed:
            assert self._changed.wait_for(found, WAIT_SECONDS), f"no matching message; got {self.messages}"
            return found()

    def matching(self, predicate: Callable[[Message], bool]) -> list[Message]:
        with self._changed:
            return [message for message in self.messages if predicate(message)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def reply(kind: str, command_id: str) -> Callable[[Message], bool]:
    """Matches a reply of this kind for this command on the device's protocol topics."""

    def match(message: Message) -> bool:
        return message.topic.endswith(f"/{kind}") and message.body.get("id") == command_id

    return match


def answered(command_id: str) -> Callable[[Message], bool]:
    """Matches any reply (ack, progress or done) to this command."""

    def match(message: Message) -> bool:
        return (
            message.topic.rpartition("/")[2] in protocol.REPLY_KINDS and message.body.get("id") == command_id
        )

    return match


def command(
    name: str,
    action: str,
    *,
    token: int = 1,
    args: dict | None = None,
    override: str = "",
    deadline: str = "2030-01-01T00:00:00Z",
):
    """(topic, payload, id) of a protocol v1 command, built the way the engine builds it."""
    command_id = f"cmd-{uuid.uuid4().hex[:12]}"
    payload = protocol.command_payload(
        command_id=command_id,
        run="run-1",
        step=1,
        attempt=1,
        token=token,
        action=action,
        args=args or {},
        deadline=deadline,
    )
    return protocol.command_topic(name, action, override), payload, command_id


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def broker_url(services) -> str:
    return services.mqtt_url


@pytest.fixture
def prefix(settings, services, broker_url) -> str:
    settings.MQTT_URL = broker_url
    # A prefix per test: retained statuses and stray replies of one test never reach the next.
    settings.IOTQUEUE_TOPIC_PREFIX = f"{services.namespace}-sim{uuid.uuid4().hex[:6]}"
    return settings.IOTQUEUE_TOPIC_PREFIX


@pytest.fixture
def observer(prefix, broker_url) -> Iterator[Observer]:
    observer = Observer(broker_url)
    observer.subscribe(f"{prefix}/#")
    yield observer
    observer.close()


@pytest.fixture
def simulate(prefix) -> Iterator[Callable[..., Simulator]]:
    simulators: list[Simulator] = []

    def start(devices: dict[str, DeviceBehaviour], heartbeat_interval: float = 0) -> Simulator:
        simulator = Simulator(devices, heartbeat_interval=heartbeat_interval, seed=1)
        simulators.append(simulator)
        simulator.start(wait_connected=WAIT_SECONDS)
        return simulator

    yield start
    for simulator in simulators:
        simulator.stop()


def test_command_gets_ack_progress_and_done(simulate, observer):
    simulator = simulate({"lamp-2": DeviceBehaviour()})
    topic, payload, command_id = command("lamp-2", "on", args={"level": 80})

    observer.publish(topic, payload)

    assert (
        protocol.reply_parse("ack", observer.wait_for(reply("ack", command_id)).body).command_id == command_id
    )
    assert observer.wait_for(reply("progress", command_id)).body["progress"] == 50
    done = protocol.reply_parse("done", observer.wait_for(reply("done", command_id)).body)
    assert done.ok is True
    assert done.result == {"device": "lamp-2", "action": "on", "echo": {"level": 80}}
    # A second command sent after the first's done is the normal case, never an overlap.
    topic, payload, info_id = command("lamp-2", "read_info", token=2)
    observer.publish(topic, payload)
    assert observer.wait_for(reply("done", info_id)).body["result"]["serial"] == "SN-lamp-2"
    assert [record["id"] for record in simulator.received("lamp-2")] == [command_id, info_id]
    totals = simulator.stats()["totals"]
    assert (totals["commands"], totals["overlaps"], totals["duplicates"], totals["failures"]) == (2, 0, 0, 0)


def test_failure_rate_one_always_fails_retryably(simulate, observer):
    simulator = simulate({"pump-1": DeviceBehaviour(failure_rate=1.0)})
    topic, payload, command_id = command("pump-1", "firmware/check")

    observer.publish(topic, payload)

    done = protocol.reply_parse("done", observer.wait_for(reply("done", command_id)).body)
    assert (done.ok, done.error, done.retryable) == (False, "simulated failure", True)
    assert simulator.stats()["devices"]["pump-1"]["failures"] == 1


def test_second_command_in_flight_is_an_overlap_but_redelivery_is_a_duplicate(simulate, observer):
    simulator = simulate({"lamp-2": DeviceBehaviour(latency_min_ms=SLOW_MS, latency_max_ms=SLOW_MS)})
    topic, first, first_id = command("lamp-2", "on", token=1)
    _, second, second_id = command("lamp-2", "off", token=1)

    observer.publish(topic, first)
    observer.publish(topic, first)  # QoS 1 redelivery of the same attempt
    observer.publish(topic, second)
    observer.wait_for(reply("done", second_id))

    assert simulator.overlaps == [Overlap("lamp-2", first_id, second_id)]
    stats = simulator.stats()["devices"]["lamp-2"]
    assert (stats["commands"], stats["duplicates"], stats["overlaps"]) == (2, 1, 1)
    assert len(observer.matching(reply("done", first_id))) == 1  # the duplicate was not started twice
    assert [record["duplicate"] for record in simulator.received("lamp-2")] == [False, True, False]


def test_token_going_backwards_is_recorded_and_not_started(simulate, observer):
    simulator = simulate({"gate-1": DeviceBehaviour(latency_min_ms=0, latency_max_ms=5)})
    ids = []
    for token in (5, 4, 6):
        topic, payload, command_id = command("gate-1", "unlock", token=token)
        observer.publish(topic, payload)
        ids.append(command_id)
    observer.wait_for(reply("done", ids[2]))

    # Its deadline is ahead: the server would still count it current, so the fence went back.
    assert simulator.token_regressions == [TokenRegression("gate-1", ids[1], 5, 4)]
    assert simulator.overlaps == []
    # Commands are handled in the order they came: the lower token was refused, unanswered.
    assert observer.matching(answered(ids[1])) == []
    assert simulator.stats()["devices"]["gate-1"]["late"] == 1


def in_a_moment(seconds: float) -> str:
    """An ISO 8601 deadline `seconds` from now (negative: already passed)."""
    return datetime.fromtimestamp(time.time() + seconds, UTC).isoformat()


def test_a_command_past_its_deadline_is_late_and_never_started(simulate, observer):
    simulator = simulate({"gate-1": DeviceBehaviour(latency_min_ms=0, latency_max_ms=5)})
    topic, late, late_id = command("gate-1", "unlock", token=1, deadline=in_a_moment(-1))
    _, current, current_id = command("gate-1", "unlock", token=2)

    observer.publish(topic, late)
    observer.publish(topic, current)
    observer.wait_for(reply("done", current_id))

    assert observer.matching(answered(late_id)) == []
    stats = simulator.stats()["devices"]["gate-1"]
    assert (stats["commands"], stats["late"], stats["overlaps"], stats["token_regressions"]) == (1, 1, 0, 0)
    assert [record["late"] for record in simulator.received("gate-1")] == [True, False]


def test_a_higher_token_while_one_is_current_is_an_overlap_and_supersedes_it(simulate, observer):
    # A real overlap: the server granted token 2 while token 1's attempt could still be answered.
    simulator = simulate({"lamp-2": DeviceBehaviour(latency_min_ms=SLOW_MS, latency_max_ms=SLOW_MS)})
    topic, first, first_id = command("lamp-2", "on", token=1)
    _, second, second_id = command("lamp-2", "off", token=2)

    observer.publish(topic, first)
    observer.publish(topic, second)
    observer.wait_for(reply("done", second_id))

    assert simulator.overlaps == [Overlap("lamp-2", first_id, second_id)]
    assert observer.matching(reply("done", first_id)) == []  # abandoned for the higher token
    stats = simulator.stats()["devices"]["lamp-2"]
    assert (stats["commands"], stats["superseded"], stats["overlaps"], stats["in_flight"]) == (2, 1, 1, 0)


def test_a_command_whose_deadline_passed_is_superseded_without_an_overlap(simulate, observer):
    # Issue 34: the first attempt timed out on the server (its deadline passed) and the lock
    # went on; the next command finds the device still at the old one. Not two holders at once.
    simulator = simulate({"lamp-2": DeviceBehaviour(latency_min_ms=SLOW_MS, latency_max_ms=SLOW_MS)})
    expiry = time.time() + SLOW_MS / 4000
    topic, first, first_id = command(
        "lamp-2", "on", token=1, deadline=datetime.fromtimestamp(expiry, UTC).isoformat()
    )
    _, second, second_id = command("lamp-2", "off", token=2)

    observer.publish(topic, first)
    observer.wait_for(reply("ack", first_id))
    wait_until(lambda: time.time() > expiry)
    observer.publish(topic, second)
    observer.wait_for(reply("done", second_id))

    assert simulator.overlaps == []
    assert observer.matching(reply("done", first_id)) == []
    stats = simulator.stats()["devices"]["lamp-2"]
    assert (stats["commands"], stats["superseded"], stats["overlaps"]) == (2, 1, 0)


def is_reply(message: Message) -> bool:
    return message.topic.split("/")[-1] in protocol.REPLY_KINDS


def test_silent_device_stays_online_but_never_replies(simulate, observer):
    silent = DeviceBehaviour(silent=True)
    simulator = simulate({"cam-3": silent}, heartbeat_interval=HEARTBEAT_SECONDS)
    topic, payload, _ = command("cam-3", "snapshot")

    observer.publish(topic, payload)
    wait_until(lambda: len(simulator.received("cam-3")) == 1)

    # then it has nothing in flight: no progress or done is scheduled that could come later
    assert simulator.stats()["devices"]["cam-3"]["in_flight"] == 0
    # and none came: the event that proves it is a heartbeat the device published after its
    # done would have been due; the broker passes one client's messages on in order, so a
    # reply sent (even late, up to that moment) is already in observer.messages
    due = simulator.received("cam-3")[0]["at"] + silent.latency_max_ms / 1000
    heartbeat = protocol.device_topic("cam-3", "heartbeat")
    observer.wait_for(lambda message: message.topic == heartbeat and message.body["ts"] > due)
    assert observer.matching(is_reply) == []
    assert observer.wait_for(lambda message: message.topic.endswith("cam-3/status")).payload == b"online"


def test_legacy_device_uses_fixed_topics_and_sends_only_done(simulate, observer):
    serial = uuid.uuid4().hex[:8]
    legacy = DeviceBehaviour(command_topic=f"dev/face/{serial}", reply_topic=f"dev/face/{serial}/Ack")
    simulator = simulate({"face-1": legacy})
    observer.subscribe(legacy.reply_topic)
    topic, payload, first = command("face-1", "add_person", args={"person": 7}, override=legacy.command_topic)

    observer.publish(topic, payload)

    body = observer.wait_for(lambda message: message.topic == legacy.reply_topic).body
    assert protocol.reply_kind_infer(body) == "done"
    assert protocol.reply_parse("done", body).result["echo"] == {"person": 7}

    # then the first command got nothing else: the event that proves it is the done of a second
    # command, sent by the same client on the same topic, so it arrives after anything the
    # device sent for the first; and the device has nothing left in flight
    _, payload, second = command("face-1", "add_person", args={"person": 8}, override=legacy.command_topic)
    observer.publish(topic, payload)
    observer.wait_for(lambda message: message.topic == legacy.reply_topic and message.body["id"] == second)
    legacy_replies = observer.matching(lambda message: message.topic == legacy.reply_topic)
    assert [message.body["id"] for message in legacy_replies] == [first, second]
    assert observer.matching(is_reply) == []
    assert simulator.stats()["devices"]["face-1"]["in_flight"] == 0


def test_kill_makes_the_broker_publish_the_retained_offline_will(simulate, observer, broker_url, prefix):
    simulator = simulate({"vac-4": DeviceBehaviour()})
    status = protocol.device_topic("vac-4", "status")
    observer.wait_for(lambda message: message.topic == status and message.payload == b"online")

    simulator.kill("vac-4")

    observer.wait_for(lambda message: message.topic == status and message.payload == b"offline")
    late = Observer(broker_url)
    try:
        late.subscribe(status)
        assert late.wait_for(lambda message: message.topic == status) == Message(status, b"offline", True)
    finally:
        late.close()
    mark = len(observer.messages)
    simulator.restart("vac-4")
    observer.wait_for(lambda message: message.topic == status and message.payload == b"online", after=mark)


def test_cancel_aborts_the_command_in_flight(simulate, observer):
    simulator = simulate({"lamp-2": DeviceBehaviour(latency_min_ms=SLOW_MS, latency_max_ms=SLOW_MS)})
    topic, payload, command_id = command("lamp-2", "on")
    observer.publish(topic, payload)
    observer.wait_for(reply("ack", command_id))

    cancel_topic, cancel, cancel_id = command("lamp-2", protocol.CANCEL_ACTION, args={"id": command_id})
    observer.publish(cancel_topic, cancel)

    canceled = protocol.reply_parse("done", observer.wait_for(reply("done", command_id)).body)
    assert (canceled.ok, canceled.error) == (False, "canceled")
    assert observer.wait_for(reply("done", cancel_id)).body["result"]["canceled"] is True
    # The device is free at once: the next command is no overlap, and the aborted one never finishes.
    topic, payload, next_id = command("lamp-2", "off")
    observer.publish(topic, payload)
    observer.wait_for(reply("done", next_id))
    assert len(observer.matching(reply("done", command_id))) == 1
    stats = simulator.stats()["devices"]["lamp-2"]
    assert (stats["canceled"], stats["overlaps"]) == (1, 0)


def test_malformed_command_is_counted_and_the_device_carries_on(simulate, observer):
    simulator = simulate({"lamp-2": DeviceBehaviour()})
    topic, payload, command_id = command("lamp-2", "on")

    observer.publish(topic, b"not json")
    observer.publish(topic, payload)

    observer.wait_for(reply("done", command_id))
    assert simulator.stats()["devices"]["lamp-2"]["malformed"] == 1


def test_simulate_command_runs_devices_and_writes_stats(observer, prefix, tmp_path):
    stats_file = tmp_path / "stats.json"
    out = StringIO()

    call_command(
        "simulate",
        "--count",
        "2",
        "--prefix",
        "cmd-",
        "--duration",
        "0.5",
        "--heartbeat",
        "0.1",
        "--stats-file",
        str(stats_file),
        stdout=out,
    )

    stats = json.loads(stats_file.read_text())
    assert sorted(stats["devices"]) == ["cmd-1", "cmd-2"]
    assert stats["totals"]["overlaps"] == 0
    assert "0 overlaps" in out.getvalue()
    observer.wait_for(lambda message: message.topic == protocol.device_topic("cmd-1", "heartbeat"))
    status = protocol.device_topic("cmd-2", "status")
    observer.wait_for(lambda message: message.topic == status and message.payload == b"offline")


def test_behaviour_from_device_config():
    base = DeviceBehaviour()

    configured = base.configured(
        {"latency_ms": [5, 10], "failure_rate": 0.5, "silent": True, "colour": "red"}
    )

    assert configured == DeviceBehaviour(latency_min_ms=5, latency_max_ms=10, failure_rate=0.5, silent=True)
    with pytest.raises(ValueError):
        base.configured({"failure_rate": 2})


@pytest.fixture
def simulate_following(stack, tmp_path) -> Iterator[Path]:
    """`manage.py simulate --from-db --own-credentials` as the dev stack runs it, started before
    any device exists; yields its stats file. A quick follow interval keeps the test short."""
    stats_file = tmp_path / "sim.json"
    name = f"simulate-{uuid.uuid4().hex[:6]}"
    following = ("--from-db", "--own-credentials", "--follow-seconds", "0.2")
    argv = manage_argv("simulate", *following, "--stats-file", str(stats_file))
    stack.supervisor.start(name, argv)
    try:
        stack.supervisor.wait_for_log(name, r"simulate: 0 devices online", timeout=60)
        yield stats_file
    finally:
        stack.supervisor.stop(name)


def played(stats_file: Path) -> dict[str, Any]:
    """The devices the simulator plays now, as its stats file last said."""
    try:
        return json.loads(stats_file.read_text())["devices"]
    except FileNotFoundError:
        return {}


def run_finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_a_device_created_after_the_simulator_started_answers_a_run(simulate_following):
    # given the simulator following the device table, started when no device existed
    # when a device is created (offline, as a new one is) and a run of a step on it starts
    device = DeviceFactory(online=False)
    template = template_with_steps((device, "on", {"level": 80}))
    run, _ = run_start(template=template, trigger="cli")

    # then the simulator plays the device, with the credentials it issued it, and the run succeeds
    run = wait_for(lambda: run_finished(run.pk), timeout=60, what="the run on the new device to finish")
    assert run.status == RunStatus.SUCCEEDED, run.error
    wait_for(
        lambda: played(simulate_following).get(device.name, {}).get("commands") == 1,
        what="the simulator's stats to count the command",
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("gone", ["deleted", "disabled"])
def test_a_deleted_or_disabled_device_is_no_longer_played(simulate_following, gone):
    # given a device the following simulator plays
    device = DeviceFactory(online=False)
    wait_for(
        lambda: played(simulate_following).get(device.name, {}).get("online"),
        what="the simulator to play the new device",
    )

    # when the device is deleted, or disabled
    if gone == "deleted":
        device.delete()
    else:
        device.enabled = False
        device.save()

    # then the simulator drops it
    wait_for(lambda: device.name not in played(simulate_following), what="the simulator to drop the device")


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_a_device_whose_config_opts_out_is_left_alone(simulate_following):
    # given a device to be played by hand, and then an ordinary one
    by_hand = DeviceFactory(online=False, config={"simulator": False})
    ordinary = DeviceFactory(online=False)

    # when the simulator has taken up the later one (so it has read both rows)
    wait_for(lambda: ordinary.name in played(simulate_following), what="the simulator to play the device")

    # then it does not play the one that opted out
    assert by_hand.name not in played(simulate_following)
