"""Two dev stacks in one checkout: each claims its own state directory (and, without a
DATABASE_URL, a second one its own SQLite database), race-free, by a lock the kernel drops
when the stack ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import devstack

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Stacks started at the same moment in the race test; more than two, so a third also moves on.
STACKS = 3
# A bound on a child's start (Python and the devtools imports), not a timing target.
START_BOUND_SECONDS = 60

# A child that claims a directory under argv[1], says which, and holds it until its stdin closes.
CLAIMANT = """
import sys
from pathlib import Path
from devtools.devstack import instance_claim
print(instance_claim(Path(sys.argv[1])).directory.name, flush=True)
sys.stdin.read()
"""


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: claiming a directory reaches no server."""


def test_a_second_stack_takes_the_next_directory_and_a_finished_one_frees_its_own(tmp_path):
    # given a stack holding the first state directory
    first = devstack.instance_claim(tmp_path)

    # when a second stack starts
    second = devstack.instance_claim(tmp_path)

    # then it takes the next directory
    assert (first.directory.name, second.directory.name) == ("devstack", "devstack-2")
    # and once the first has stopped, a new stack gets the first directory back
    devstack.instance_release(first)
    third = devstack.instance_claim(tmp_path)
    assert third.directory.name == "devstack"
    for instance in (second, third):
        devstack.instance_release(instance)


def test_stacks_starting_at_once_each_claim_their_own_directory(tmp_path):
    # when several stacks start at the same moment, each in its own process
    claimants = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMANT, str(tmp_path)],
            cwd=PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(STACKS)
    ]
    try:
        claimed = [claimant.stdout.readline().strip() for claimant in claimants]
    finally:
        for claimant in claimants:
            claimant.communicate(timeout=START_BOUND_SECONDS)

    # then no two share one
    assert sorted(claimed) == ["devstack", "devstack-2", "devstack-3"]


def test_a_second_stack_gets_its_own_sqlite_database_unless_one_is_set(tmp_path, monkeypatch):
    # given no DATABASE_URL (restored after the test: choosing one sets it for the children)
    monkeypatch.setenv("DATABASE_URL", "")
    first, second = devstack.instance_claim(tmp_path), devstack.instance_claim(tmp_path)
    try:
        # when each stack chooses its database
        # then the first keeps the settings' default, the second gets a file in its directory
        assert devstack._database_choose(first) == "var/db.sqlite3"
        assert os.environ["DATABASE_URL"] == ""
        devstack._database_choose(second)
        assert os.environ["DATABASE_URL"] == f"sqlite:///{second.directory / 'db.sqlite3'}"

        # and a DATABASE_URL that is set is every stack's
        monkeypatch.setenv("DATABASE_URL", "postgres://db/iotqueue")
        assert devstack._database_choose(second) == "DATABASE_URL"
        assert os.environ["DATABASE_URL"] == "postgres://db/iotqueue"
    finally:
        for instance in (first, second):
            devstack.instance_release(instance)
