"""A PostgreSQL restart as its clients see it, played on one database; and a drill for `make run`.

A PostgreSQL server often serves more than the stack under test, so it is not stopped:
`database_restarting` ends every connection to one database with the FATAL a shutdown
sends ("terminating connection due to administrator command") and refuses new ones
(`ALLOW_CONNECTIONS false`) until its `with` body is over. It needs a superuser (or the
database's owner) and connects to the `postgres` maintenance database to do it.

`python -m devtools.pg_restart <database URL>` is the drill CI runs: it makes that database
afresh, starts the dev stack on it (`make run`, CI=true, so it exits when the demo is done),
plays a restart of RESTART_SECONDS once the demo follows its runs, and exits with the dev
stack's status; non-zero too when the demo never saw the database go (the drill missed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

# How long the database stays away: longer than the engine tasks' own retries (ten of 0.2 s),
# so the monitor's rescue is exercised too, short enough for CI.
RESTART_SECONDS = 4.0
# The dev stack's line once its demo runs are started and followed.
FOLLOWING = "following "
# What the demo prints while the database is away (devtools/management/commands/demo.py).
AWAY = "database unreachable"
# `make run` on a fresh clone installs first; the demo itself takes about a minute.
DRILL_TIMEOUT_SECONDS = 600.0


def _maintenance(url: str) -> psycopg.Connection:
    parts = urlsplit(url)
    return psycopg.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 5432,
        user=parts.username or None,
        password=parts.password or None,
        dbname="postgres",
        autocommit=True,
    )


@contextlib.contextmanager
def database_restarting(url: str, name: str) -> Iterator[None]:
    """Database `name` (on the server of `url`) down for the body of the `with`: its
    connections ended as a shutdown ends them, new ones refused; then up again."""
    maintenance = _maintenance(url)
    quoted = sql.Identifier(name)
    try:
        maintenance.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(quoted))
        maintenance.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        yield
    finally:
        maintenance.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(quoted))
        maintenance.close()


def database_recreate(url: str) -> str:
    """Drop and create the database `url` names; its name."""
    name = urlsplit(url).path.lstrip("/")
    with _maintenance(url) as maintenance:
        maintenance.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        maintenance.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pg_restart", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="postgres://user@host:port/database (made afresh)")
    args = parser.parse_args(argv)
    name = database_recreate(args.url)
    env = {**os.environ, "DATABASE_URL": args.url, "CI": "true"}
    stack = subprocess.Popen(
        ["make", "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    seen = {"away": False, "restarted": False}
    timer = threading.Timer(DRILL_TIMEOUT_SECONDS, stack.kill)
    timer.start()
    try:
        for line in stack.stdout:
            sys.stdout.write(line)
            seen["away"] = seen["away"] or AWAY in line
            if FOLLOWING in line and not seen["restarted"]:
                seen["restarted"] = True
                threading.Thread(target=_restart, args=(args.url, name), daemon=True).start()
        status = stack.wait()
    finally:
        timer.cancel()
    if status != 0:
        print(f"pg_restart: make run exited with status {status}", file=sys.stderr)
        return status or 1
    if not seen["away"]:
        print("pg_restart: the demo never saw the database go; the drill missed", file=sys.stderr)
        return 1
    print("pg_restart: make run rode out the database restart")
    return 0


def _restart(url: str, name: str) -> None:
    time.sleep(0.5)  # into the following, not at its first read
    print(f"pg_restart: database {name} restarting for {RESTART_SECONDS:g}s", flush=True)
    with database_restarting(url, name):
        time.sleep(RESTART_SECONDS)
    print(f"pg_restart: database {name} back", flush=True)


if __name__ == "__main__":
    sys.exit(main())
