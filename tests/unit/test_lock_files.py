"""The lock files agree with the human lists and pin every package with its hashes.

requirements*.txt are the lists people edit; requirements/lock*.txt are what `make install`,
`make run` and the Dockerfile install with `pip install --require-hashes` (`make lock` writes
them). A list edited without `make lock`, or a lock line without a hash, fails here instead
of at someone's next install.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each human list and the lock file `make lock` resolves from it.
LOCKS = {
    "requirements.txt": "requirements/lock.txt",
    "requirements-run.txt": "requirements/lock-run.txt",
    "requirements-dev.txt": "requirements/lock-dev.txt",
    # Optional (`make flower`, `make test-browser`), installed over the development tree.
    "requirements-flower.txt": "requirements/lock-flower.txt",
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}\b")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def human_pins(list_name: str) -> dict[str, str]:
    """Name -> version of a human list, following its `-r` includes."""
    pins: dict[str, str] = {}
    for raw in (ROOT / list_name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins.update(human_pins(line[3:].strip()))
        elif line:
            match = PIN.match(line)
            assert match, f"{list_name}: {raw!r} is not pinned with =="
            pins[canonical(match[1])] = match[2]
    return pins


def version_of(entries: dict[str, tuple[str, list[str]]], name: str) -> str | None:
    return entries[name][0] if name in entries else None


def lock_entries(lock_name: str) -> dict[str, tuple[str, list[str]]]:
    """Name -> (version, hashes) of a lock file: each pin with its continuation lines."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = (ROOT / lock_name).read_text()
    for block in re.split(r"\n(?=\S)", text):
        first = block.split("\n", 1)[0]
        if first.startswith("#") or not first.strip():
            continue
        match = PIN.match(first)
        assert match, f"{lock_name}: {first!r} is not a pin"
        entries[canonical(match[1])] = (match[2], HASH.findall(block))
    return entries


@pytest.mark.parametrize(("list_name", "lock_name"), LOCKS.items())
def test_every_listed_package_is_locked_at_its_pin(list_name, lock_name):
    # given a human list and its lock file
    pins = human_pins(list_name)
    locked = lock_entries(lock_name)

    # when each listed package is looked up in the lock
    drifted = {
        name: (pin, version_of(locked, name)) for name, pin in pins.items() if version_of(locked, name) != pin
    }

    # then each is there at the version the list pins (else: `make lock`, commit both)
    assert pins
    assert not drifted, f"{lock_name} disagrees with {list_name} (listed, locked): {drifted}; run `make lock`"


@pytest.mark.parametrize("lock_name", LOCKS.values())
def test_every_locked_package_has_a_hash(lock_name):
    # given a lock file
    locked = lock_entries(lock_name)

    # when its pins are read with their continuation lines
    unhashed = sorted(name for name, (_, hashes) in locked.items() if not hashes)

    # then every one, transitive ones too, carries at least one sha256 hash
    assert locked
    assert not unhashed, f"{lock_name}: no --hash for {unhashed}"


def test_the_locks_agree():
    # given the image's, `make run`'s, development's and Flower's trees
    image, run, dev, flower = (lock_entries(name) for name in LOCKS.values())

    # when each smaller tree is compared with the larger one installed over it
    def differ(small, large):
        return {
            name: (version, version_of(large, name))
            for name, (version, _) in small.items()
            if version_of(large, name) != version
        }

    # then each is contained in the next at the same versions: installing one over another
    # never up- or downgrades a package
    assert not differ(image, run), "requirements/lock.txt and lock-run.txt disagree; run `make lock`"
    assert not differ(run, dev), "requirements/lock-run.txt and lock-dev.txt disagree; run `make lock`"
    # and Flower's tree, installed over development's, keeps every version development has
    shared = {name: entry for name, entry in flower.items() if name in dev}
    assert not differ(shared, dev), "requirements/lock-flower.txt and lock-dev.txt disagree; run `make lock`"


def test_installs_read_the_locks_with_hashes_required():
    # given the Makefile and the Dockerfile
    makefile = (ROOT / "Makefile").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()

    # when their pip installs are read
    lines = (makefile + dockerfile).splitlines()
    installs = [line for line in lines if "pip install" in line and " -r " in line]

    # then the image, `make run`, `make install` and `make flower` each install their lock,
    # hashes required
    for lock in LOCKS.values():
        assert any(f"--require-hashes -r {lock}" in line for line in installs), f"nothing installs {lock}"
