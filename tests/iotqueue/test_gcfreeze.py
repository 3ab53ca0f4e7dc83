"""Start-up objects frozen out of the full garbage collections of the long-running processes
(iotqueue/gcfreeze.py): in a fresh interpreter, and in the real worker and bridge."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# What a fresh interpreter reports after importing Django's models and freezing: how many
# objects the oldest generation held before and after, how many were frozen, and how many
# objects a collection found in a cycle made afterwards.
_PROBE = """
import gc, django
django.setup()
from iotqueue.gcfreeze import startup_objects_freeze
gc.collect()
before = len(gc.get_objects(generation=2))
frozen = startup_objects_freeze("probe")
after = len(gc.get_objects(generation=2))
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
print(before, after, frozen, gc.collect())
"""


def test_freezing_takes_the_start_up_objects_out_of_the_oldest_generation():
    # Given a process that has set Django up (a subprocess: freezing this one would freeze
    # the test session)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "iotqueue.settings", "DEBUG": "true"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30, env=env, cwd=root
    )
    assert done.returncode == 0, done.stderr
    before, after, frozen, collected = map(int, done.stdout.split()[-4:])

    # Then the oldest generation, which a full collection walks, is nearly empty
    assert before > 50_000
    assert frozen > 50_000
    assert after < before // 50
    # And a cycle made afterwards is still freed
    assert collected >= 2


@pytest.mark.django_db(transaction=True)
def test_the_worker_and_the_bridge_freeze_their_start_up_objects(stack):
    # Given the real worker (prefork, two pool processes) and the real bridge, started
    worker = stack.supervisor.children["worker"]
    stack.supervisor.wait_for_log("worker", r"worker: \d+ objects from start-up frozen")
    stack.supervisor.wait_for_log("bridge", r"bridge: \d+ objects from start-up frozen")

    # Then each pool process froze its own start-up objects, as did the main process
    found = re.findall(r"worker process: (\d+) objects from start-up frozen", worker.log_text())
    pool = [int(n) for n in found]
    assert len(pool) >= 2
    assert min(pool) > 50_000
    bridge = stack.supervisor.children["bridge"].log_text()
    assert int(re.search(r"bridge: (\d+) objects from start-up frozen", bridge).group(1)) > 20_000
