"""A unit of work's commands published without waiting for the broker (jobs/engine/publish.py):
which `send` deadlines may be cleared when, the wait on exit, the client dropped when a
PUBACK never comes, and the open `Publications` a transition finds."""

from __future__ import annotations

import pytest

from jobs.deadlines import Deadline
from jobs.engine import publish
from jobs.engine.publish import Publications, publications_open
from jobs.models import StepRun


class Info:
    """An MQTTMessageInfo as paho hands it out: published once the PUBACK came."""

    def __init__(self, *, acked: bool = False, acked_on_wait: bool = True) -> None:
        self.acked, self.acked_on_wait, self.waited = acked, acked_on_wait, []

    def is_published(self) -> bool:
        return self.acked

    def wait_for_publish(self, timeout: float) -> None:
        self.waited.append(timeout)
        self.acked = self.acked_on_wait


class Publisher:
    """The process's publisher: hands out the next infos, or why a message was refused."""

    def __init__(self) -> None:
        self.outcomes: list = []
        self.closed = 0

    def publish_nowait(self, messages):
        handed, self.outcomes = self.outcomes[: len(messages)], self.outcomes[len(messages) :]
        return handed

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def publisher(monkeypatch):
    fake = Publisher()
    monkeypatch.setattr(publish, "publisher", fake)
    monkeypatch.setattr(publish, "command_message", lambda row: (f"cmd/{row.pk}", b"{}"))
    return fake


@pytest.fixture
def cleared(monkeypatch):
    """The `send` deadlines cleared when a Publications closes."""
    seen: list[Deadline] = []
    monkeypatch.setattr(publish, "deadlines_clear", lambda deadlines: seen.extend(deadlines))
    return seen


def row(pk: int) -> StepRun:
    return StepRun(pk=pk, attempt=1)


def send(pk: int) -> Deadline:
    return Deadline("send", pk, 1)


def test_acknowledged_commands_are_confirmed_once_and_the_rest_on_exit(publisher, cleared):
    # given three commands published, one refused by the client, one acknowledged at once
    late = Info()
    publisher.outcomes = [Info(acked=True), late, "publish to cmd/3 failed: no connection"]
    with Publications() as publications:
        failed = publications.publish([row(1), row(2), row(3)])

        # then the refused one is returned (its `send` deadline re-sends it), the
        # acknowledged one's deadline may be cleared now, and only once
        assert [(r.pk, why) for r, why in failed] == [(3, "publish to cmd/3 failed: no connection")]
        assert publications.confirmed() == [send(1)]
        assert publications.confirmed() == []
        assert cleared == []

    # and on exit the other was waited for and its deadline cleared
    assert late.waited and late.waited[0] <= publish.PUBLISH_TIMEOUT_SECONDS
    assert cleared == [send(2)]
    assert publisher.closed == 0


def test_a_puback_that_never_comes_drops_the_client_and_leaves_the_commands_to_their_deadlines(
    publisher, cleared, monkeypatch
):
    # given two commands the broker never acknowledges, published long enough ago
    clock = [100.0]
    monkeypatch.setattr(publish.time, "monotonic", lambda: clock[0])
    publisher.outcomes = [Info(acked_on_wait=False), Info(acked_on_wait=False)]
    with Publications() as publications:
        publications.publish([row(1), row(2)])
        clock[0] += publish.PUBLISH_TIMEOUT_SECONDS + 1

        # when the unit of work asks what was confirmed
        assert publications.confirmed() == []

        # then the client is dropped (a late copy must not leave) and nothing is held
        assert publisher.closed == 1
    assert cleared == []
    assert publisher.closed == 1


def test_a_transition_publishes_into_the_open_one_or_its_own(publisher, cleared):
    publisher.outcomes = [Info(), Info()]
    # inside a unit of work, a transition finds its Publications: the wait is the unit's
    with Publications() as task:
        with publications_open() as found:
            assert found is task
            found.publish([row(1)])
        assert cleared == []
    assert cleared == [send(1)]

    # outside one (a test, a shell), the transition's own waits at the end of its block
    with publications_open() as own:
        assert own is not task
        own.publish([row(2)])
    assert cleared == [send(1), send(2)]
    with publications_open() as after:
        assert after is not own  # nothing outlives its block
