"""The device agent (iotqueue_device.Agent) on a real MQTT broker, the test playing the server:
a handler's failure becomes done ok:false, and a command in flight survives a restart through
the state file and jobs/current, never run twice afterwards; it beats, and its last will
says offline when its connection dies."""

from __future__ import annotations

import secrets
import socket
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from iotqueue_device import Agent, CommandFailed
from iotqueue_device.conformance.observer import Observer
from iotqueue_device.protocol import Topics

pytestmark = pytest.mark.timeout(60)

WAIT_SECONDS = 10.0


def command(command_id: str, action: str, token: int, **args) -> dict:
    deadline = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    return {"id": command_id, "run": "r", "step": 0, "attempt": 1, "token": token, "action": action,
            "args": args, "deadline": deadline}  # fmt: skip


@pytest.fixture
def device(services):
    """A device name, and an observer playing the server on its topics (the URL's user). The
    topic prefix is the test's own: a bridge of the session's stack would answer jobs/get too."""
    topics = Topics(f"agent-{secrets.token_hex(4)}", f"{settings.IOTQUEUE_TOPIC_PREFIX}-agent")
    observer = Observer(services.mqtt_url, topics)
    yield topics, observer
    observer.close()


def agent_made(services, topics: Topics, **options) -> Agent:
    """An agent for the device, logged in as the URL's user (not started)."""
    return Agent(topics.device, services.mqtt_url, prefix=topics.prefix, **options)


def wait_reply(observer: Observer, kind: str, command_id: str, after: int = 0):
    seen = observer.wait(lambda s: s.kind == kind and s.id == command_id, WAIT_SECONDS, after=after)
    assert seen is not None, (
        f"no {kind} for {command_id}: {[(s.kind, s.body) for s in observer.since(after)]}"
    )
    return seen


def test_a_handlers_failure_is_a_done_with_ok_false(services, device):
    # given an agent whose handlers fail in each way a handler can
    topics, observer = device
    agent = agent_made(services, topics)

    @agent.action("boom")
    def boom(ctx):
        raise ValueError("boom")

    @agent.action("flaky")
    def flaky(ctx):
        raise CommandFailed("try again", retryable=True)

    agent.start()
    try:
        assert agent.ready.wait(WAIT_SECONDS)
        # when the server sends each, and an action it has no handler for, one after the other
        # (a higher token while one is in flight would supersede it)
        dones = []
        for n, action in enumerate(("boom", "flaky", "unknown"), start=1):
            observer.publish(topics.command(action), command(f"c{n}", action, n))
            dones.append(wait_reply(observer, "done", f"c{n}").body)
    finally:
        stopping = observer.mark()
        agent.stop()

    # then each is answered: failed without retry, failed with retry, refused
    assert dones[0] == {"id": "c1", "ok": False, "error": "ValueError: boom", "retryable": False}
    assert dones[1] == {"id": "c2", "ok": False, "error": "try again", "retryable": True}
    assert dones[2]["status"] == "rejected" and "unsupported action" in dones[2]["error"]
    # and the agent said goodbye: an offline status on stop
    offline = observer.wait(
        lambda s: s.kind == "status" and s.body == "offline", WAIT_SECONDS, after=stopping
    )
    assert offline is not None


def test_a_command_in_flight_survives_a_restart_and_is_never_run_twice(services, device, tmp_path):
    # given an agent that stops (abandoning it) while its handler works on a command
    topics, observer = device
    stuck = threading.Event()
    first = agent_made(services, topics, state_dir=str(tmp_path))
    first.action("flash")(lambda ctx: stuck.wait(WAIT_SECONDS) and None)
    first.start()
    assert first.ready.wait(WAIT_SECONDS)
    flash = command("c5", "flash", 5, image="2.1")
    observer.publish(topics.command("flash"), flash)
    wait_reply(observer, "ack", "c5")
    first.stop(timeout=0.1)
    stuck.set()

    # when the agent starts again from its state directory and the server names the command
    calls = []
    second = agent_made(services, topics, state_dir=str(tmp_path))
    second.action("flash")(lambda ctx: calls.append(ctx.resumed) or {"image": ctx.args["image"]})
    mark = observer.mark()
    second.start()
    try:
        observer.wait(lambda s: s.kind == "jobs/get", WAIT_SECONDS, after=mark)
        observer.publish(topics.jobs_current, {"command": flash, "queued": 0})
        done = wait_reply(observer, "done", "c5", after=mark)
        # and the command comes again (a redelivery), then a late one and a new one
        again = observer.mark()
        observer.publish(topics.command("flash"), flash)
        replay = wait_reply(observer, "done", "c5", after=again)
        observer.publish(topics.command("flash"), command("c4", "flash", 4, image="1.0"))
        observer.publish(topics.command("flash"), command("c6", "flash", 6, image="2.2"))
        wait_reply(observer, "done", "c6", after=again)
    finally:
        second.stop()

    # then the handler resumed the command once, and the redelivery got the same done again
    assert done.body == {"id": "c5", "ok": True, "result": {"image": "2.1"}}
    assert replay.body == done.body
    assert calls == [True, False]
    # and the late command (token 4 after 5) was neither run nor answered
    assert not [s for s in observer.since(again) if s.id == "c4" and s.kind != "cmd"]
    # and the first agent's abandoned handler sent no done of its own
    assert [s.body for s in observer.log if s.kind == "done" and s.id == "c5"] == [done.body, done.body]


def test_an_agent_beats_and_its_last_will_says_offline_when_its_connection_dies(services, device):
    # given an agent beating every 0.2 s
    topics, observer = device
    agent = agent_made(services, topics, heartbeat_seconds=0.2)
    mark = observer.mark()
    agent.start()
    try:
        assert agent.ready.wait(WAIT_SECONDS)
        # then it is online (retained) and its heartbeats come, one after another
        online = observer.wait(lambda s: s.kind == "status" and s.body == "online", WAIT_SECONDS, after=mark)
        assert online is not None
        beats = observer.wait(lambda s: s.kind == "heartbeat", WAIT_SECONDS, after=mark)
        assert beats is not None and "ts" in beats.body
        assert observer.wait(lambda s: s.kind == "heartbeat", WAIT_SECONDS, after=beats.index + 1) is not None

        # when its connection dies without a DISCONNECT (a network cut, a power loss)
        cut = observer.mark()
        agent._client.socket().shutdown(socket.SHUT_RDWR)

        # then the broker publishes its last will, offline, and the agent, back, says online again
        will = observer.wait(lambda s: s.kind == "status" and s.body == "offline", WAIT_SECONDS, after=cut)
        assert will is not None
        back = observer.wait(
            lambda s: s.kind == "status" and s.body == "online", WAIT_SECONDS, after=will.index + 1
        )
        assert back is not None
    finally:
        agent.stop()
