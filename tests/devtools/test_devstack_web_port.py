"""The dev stack's web server takes the next free port when its own is taken at bind time
(two stacks starting at once), instead of checking first and racing for the bind."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from devtools import devstack
from devtools.processes import Supervisor


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: runserver here needs no Redis or broker."""


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds (bound and listening), as the other stack's web would."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_the_web_server_moves_on_when_its_port_is_taken(taken_port, tmp_path, monkeypatch):
    # given the web port taken by another process
    monkeypatch.setattr(devstack, "WEB_PORT", taken_port)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "iotqueue.settings",
        "DEBUG": "true",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }

    # when the dev stack starts its web server
    with Supervisor(tmp_path / "logs", env) as supervisor:
        port = devstack._web_start(supervisor)

        # then it runs on another port, after runserver found the first one taken
        assert port != taken_port and supervisor.children["web"].alive()
        assert devstack.PORT_TAKEN in supervisor.children["web"].log_text()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
