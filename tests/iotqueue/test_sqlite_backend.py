"""The SQLite backend waits for the write lock by polling (iotqueue/backends/sqlite3/base.py):
an `atomic` block and an autocommit write wait while another connection writes and run once
it commits; past the `timeout` option they fail with "database is locked"; inside a
transaction nothing waits."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from django.db import OperationalError, connection, connections, transaction

from iotqueue.backends.sqlite3.base import DatabaseWrapper

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(60),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite backend"),
]

WAIT_SECONDS = 30.0  # bound of every wait on another thread


@pytest.fixture
def probe_table():
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS lock_probe (x INTEGER)")
        cursor.execute("DELETE FROM lock_probe")
    yield "lock_probe"
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS lock_probe")


@pytest.fixture
def writer():
    """Another connection to the same file, as another process would hold it."""
    other = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None, timeout=WAIT_SECONDS)
    yield other
    if other.in_transaction:
        other.execute("ROLLBACK")
    other.close()


class _Writer:
    """`work` in a thread with its own Django connection, opened before the lock is taken
    (opening runs the init commands, which wait the SQLite way): go() starts the work."""

    def __init__(self, work) -> None:
        self.work, self.outcome = work, []
        self.connected, self._go, self.started = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.connected.wait(WAIT_SECONDS)

    def go(self) -> None:
        self._go.set()
        assert self.started.wait(WAIT_SECONDS)

    def result(self) -> list:
        self.thread.join(WAIT_SECONDS)
        assert not self.thread.is_alive()
        return self.outcome

    def _run(self) -> None:
        try:
            connection.ensure_connection()
            self.connected.set()
            self._go.wait(WAIT_SECONDS)
            self.started.set()
            self.outcome.append(self.work())
        except Exception as exc:
            self.outcome.append(exc)
        finally:
            connections.close_all()


def _rows(table: str) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT x FROM {table} ORDER BY x")
        return [x for (x,) in cursor.fetchall()]


def test_the_busy_handler_is_off_and_the_timeout_comes_from_the_options():
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        assert cursor.fetchone() == (0,)
    assert connection.lock_timeout == connection.settings_dict["OPTIONS"]["timeout"]


@pytest.mark.parametrize("in_atomic", [True, False], ids=["atomic", "autocommit"])
def test_a_write_waits_while_another_connection_holds_the_lock_then_runs(probe_table, writer, in_atomic):
    def write() -> str:
        if in_atomic:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"INSERT INTO {probe_table} VALUES (2)")
        else:
            with connection.cursor() as cursor:
                cursor.execute(f"INSERT INTO {probe_table} VALUES (2)")
        return "written"

    thread = _Writer(write)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute(f"INSERT INTO {probe_table} VALUES (1)")
    thread.go()
    assert "written" not in thread.outcome  # it cannot have happened while the lock is held
    writer.execute("COMMIT")
    assert thread.result() == ["written"]
    assert _rows(probe_table) == [1, 2]


def test_a_write_gives_up_after_the_timeout_option(probe_table, writer):
    settings_dict = {**connection.settings_dict}
    settings_dict["OPTIONS"] = {**settings_dict["OPTIONS"], "timeout": 0.05}
    short = DatabaseWrapper(settings_dict, alias="short-timeout")
    writer.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(OperationalError, match="database is locked"), short.cursor() as cursor:
            cursor.execute(f"INSERT INTO {probe_table} VALUES (3)")
    finally:
        short.close()
        writer.execute("ROLLBACK")
    assert _rows(probe_table) == []


def test_executemany_outside_a_transaction_waits_with_the_busy_handler(probe_table, writer):
    """Row by row, each its own commit: not tried again, waited for the SQLite way."""

    def write_many() -> str:
        with connection.cursor() as cursor:
            cursor.executemany(f"INSERT INTO {probe_table} VALUES (%s)", [(4,), (5,)])
            cursor.execute("PRAGMA busy_timeout")
            assert cursor.fetchone() == (0,)  # back off after the call
        return "written"

    thread = _Writer(write_many)
    writer.execute("BEGIN IMMEDIATE")
    thread.go()
    writer.execute("COMMIT")
    assert thread.result() == ["written"]
    assert _rows(probe_table) == [4, 5]
