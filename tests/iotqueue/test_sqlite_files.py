"""The SQLite database's files are their owner's only (mode 600): they hold API tokens and
webhook secrets (iotqueue/backends/sqlite3/base.py)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from iotqueue.backends.sqlite3.base import DatabaseWrapper

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite backend"),
]


@pytest.fixture
def common_umask() -> Iterator[None]:
    """The usual umask (022), with which a file is created readable by everyone (644)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def open_database(path: Path) -> DatabaseWrapper:
    """A connection of the project's backend to `path`, as settings make one (WAL)."""
    wrapper = DatabaseWrapper(
        {
            **connection.settings_dict,
            "NAME": str(path),
            "OPTIONS": {**connection.settings_dict["OPTIONS"]},
        },
        alias="file_mode_probe",
    )
    wrapper.ensure_connection()
    with wrapper.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS probe (x INTEGER)")
        cursor.execute("INSERT INTO probe VALUES (1)")
    return wrapper


def test_a_new_database_and_its_wal_files_are_owner_only(tmp_path, common_umask):
    # given no database file yet, and the usual umask
    path = tmp_path / "db.sqlite3"

    # when the backend creates it and writes in WAL mode
    wrapper = open_database(path)
    try:
        # then the database and the files beside it are readable by their owner only
        files = [path, path.with_name("db.sqlite3-wal"), path.with_name("db.sqlite3-shm")]
        assert all(file.exists() for file in files)
        assert {file.name: mode(file) for file in files} == {file.name: 0o600 for file in files}
    finally:
        wrapper.close()


def test_an_existing_world_readable_database_is_narrowed_on_connect(tmp_path):
    # given a database an earlier release left readable by everyone
    path = tmp_path / "db.sqlite3"
    open_database(path).close()
    path.chmod(0o644)

    # when the backend connects to it again
    wrapper = open_database(path)
    wrapper.close()

    # then it is its owner's only
    assert mode(path) == 0o600


def test_the_test_database_in_use_is_owner_only():
    assert mode(Path(connection.settings_dict["NAME"])) == 0o600


def test_a_missing_directory_is_created_owner_only(tmp_path, common_umask):
    # given a database path whose directory does not exist (a fresh checkout's var/)
    path = tmp_path / "var" / "db.sqlite3"

    # when the backend first opens it
    wrapper = open_database(path)
    try:
        # then the directory was created, readable by its owner only, and the database in it
        assert mode(path.parent) == 0o700 and mode(path) == 0o600
    finally:
        wrapper.close()
