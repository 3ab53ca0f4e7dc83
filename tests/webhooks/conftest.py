"""Fixtures of the run-events tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.webhooks.receiver import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A real HTTP receiver on a free port, recording what it is sent."""
    started = Receiver().start()
    yield started
    started.stop()
