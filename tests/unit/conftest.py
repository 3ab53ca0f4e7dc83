"""The fast tier runs with network sockets refused.

A unit test that reaches for Redis, an MQTT broker or any other server fails at once with
ServerReached, instead of quietly using whatever listens on the machine (a developer's Redis
on 6379 would make such a test pass here and fail in CI). The database is SQLite, a file:
no socket. Tests that need servers live outside tests/unit/ and are marked `stack`.
"""

from __future__ import annotations

import socket

import pytest

NETWORK_FAMILIES = (socket.AF_INET, socket.AF_INET6)


class ServerReached(AssertionError):
    """A unit test opened a network connection: it belongs in the stack tier."""


@pytest.fixture(autouse=True)
def _network_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def refused(real):
        def attempt(sock: socket.socket, address, *args):
            if sock.family in NETWORK_FAMILIES:
                raise ServerReached(f"a unit test connected to {address}; move it to the stack tier")
            return real(sock, address, *args)

        return attempt

    monkeypatch.setattr(socket.socket, "connect", refused(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", refused(connect_ex))
