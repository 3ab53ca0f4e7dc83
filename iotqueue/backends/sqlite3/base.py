"""Django's SQLite backend, waiting for a locked database by polling instead of backing off.

SQLite lets one connection write at a time. When the database is locked, SQLite's own busy
handler (the `timeout` option) retries after sleeping 1, 2, 5, 10, … and then 100 ms
between tries. In the dev stack a worker's batch holds the write lock for a few
milliseconds and takes it again soon after, so a connection that backs off keeps missing
the gaps: a run started over the API (or a batch behind it) waited 100 ms to 3 s for a lock
that was free most of the time.

Here the busy handler is off (busy_timeout 0) and a statement run outside a transaction
— `BEGIN IMMEDIATE` opening every `atomic` block (settings.py), or an autocommit
statement — is tried again every POLL_SECONDS until it gets the lock, for at most the
`timeout` option's seconds. A statement that fails with "database is locked" outside a
transaction changed nothing, so trying it again is safe. Inside a transaction (begun
IMMEDIATE: the write lock is held) no statement waits for the lock. `executemany` outside a
transaction commits row by row, so it is not tried again: it waits with SQLite's own busy
handler, as before.

The database file is its owner's only (mode 600): it holds API tokens and webhook secrets.
It is created so before SQLite opens it (SQLite gives its WAL and shared-memory files the
database file's mode), and a file an earlier release created readable by all is narrowed.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from django.db.backends.sqlite3 import base

# How often a statement that found the database locked tries again (seconds).
POLL_SECONDS = 0.0005
# The `timeout` option's default in Python's sqlite3 (seconds).
TIMEOUT_DEFAULT = 5.0
# Read and write for the owner only: the database holds secrets.
FILE_MODE = 0o600
# The directory a new database file is created in: its owner's only, for the same reason.
DIRECTORY_MODE = 0o700
# Files SQLite keeps beside the database, with its contents.
SIDE_FILE_SUFFIXES = ("-wal", "-shm", "-journal")


def is_locked(exc: sqlite3.OperationalError) -> bool:
    return str(exc).startswith(("database is locked", "database table is locked"))


class PollingCursor(base.SQLiteCursorWrapper):
    """Django's cursor; a statement outside a transaction waits for the lock by polling."""

    def __init__(self, connection: sqlite3.Connection, timeout: float) -> None:
        super().__init__(connection)
        self.lock_timeout = timeout

    def execute(self, query, params=None):
        if self.connection.in_transaction:
            return super().execute(query, params)
        deadline = None
        while True:
            try:
                return super().execute(query, params)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc) or self.connection.in_transaction:
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.lock_timeout
                if now >= deadline:
                    raise
            time.sleep(POLL_SECONDS)

    def executemany(self, query, param_list):
        if self.connection.in_transaction:
            return super().executemany(query, param_list)
        busy_timeout_set(self.connection, self.lock_timeout)
        try:
            return super().executemany(query, param_list)
        finally:
            busy_timeout_set(self.connection, 0)


def database_file_protect(name: str) -> None:
    """Create the database file `name` with FILE_MODE (and its directory with DIRECTORY_MODE) if
    it does not exist, and take group and other permissions off it and the files beside it
    where they have them.

    How it fails: quietly, for an in-memory or URI database (nothing to protect or no plain
    path) and for a file it may not create or change: SQLite then opens it, or reports why not.
    """
    if not name or name == ":memory:" or name.startswith("file:"):
        return
    path = Path(name)
    try:
        # The directory too (var/ in development): the settings create nothing at import.
        path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
    except OSError:  # it exists, or SQLite will say why it cannot be created
        pass
    for file in (path, *(path.with_name(path.name + suffix) for suffix in SIDE_FILE_SUFFIXES)):
        try:
            if file.stat().st_mode & 0o077:
                file.chmod(FILE_MODE)
        except OSError:  # absent, or not ours to change
            continue


def busy_timeout_set(connection: sqlite3.Connection, seconds: float) -> None:
    connection.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


class DatabaseWrapper(base.DatabaseWrapper):
    lock_timeout = TIMEOUT_DEFAULT

    def get_connection_params(self):
        params = super().get_connection_params()
        self.lock_timeout = float(params.get("timeout", TIMEOUT_DEFAULT))
        return params

    def get_new_connection(self, conn_params):
        database_file_protect(str(conn_params["database"]))
        # Connecting and the init commands still wait with the busy handler.
        connection = super().get_new_connection(conn_params)
        busy_timeout_set(connection, 0)
        return connection

    def create_cursor(self, name=None):
        timeout = self.lock_timeout
        return self.connection.cursor(factory=lambda connection: PollingCursor(connection, timeout))
