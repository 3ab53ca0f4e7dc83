"""iotqueue/batching.py: when a Batcher flushes, and with what (threads, no server)."""

import threading

from iotqueue.batching import Batcher

# Long enough that a flush that waits for it cannot pass for one that did not.
QUIET = 5.0


def recording(*, idle: float, max_wait: float, max_items: int = 64):
    groups: list[list] = []
    flushed = threading.Event()

    def flush(items: list) -> None:
        groups.append(list(items))
        flushed.set()

    batcher = Batcher(flush, max_items=max_items, idle_seconds=idle, max_wait_seconds=max_wait, name="test")
    return batcher, groups, flushed


def test_items_that_arrive_together_form_one_group_once_quiet():
    batcher, groups, flushed = recording(idle=0.05, max_wait=QUIET)
    settled = []
    batcher.add("ack", lambda: settled.append("ack"))
    batcher.add("progress", lambda: settled.append("progress"))
    assert flushed.wait(QUIET / 2)
    assert groups == [["ack", "progress"]]
    assert settled == ["ack", "progress"]


def test_an_urgent_item_flushes_its_group_at_once_with_what_gathered_before_it():
    batcher, groups, flushed = recording(idle=QUIET, max_wait=2 * QUIET)
    batcher.add("ack")
    batcher.add("done", urgent=True)
    # without `urgent` this group would wait QUIET seconds for the stream to go quiet
    assert flushed.wait(QUIET / 2)
    assert groups == [["ack", "done"]]
    # and the next non-urgent item waits for quiet again: it leaves with the next urgent one
    flushed.clear()
    batcher.add("ack-2")
    batcher.add("done-2", urgent=True)
    assert flushed.wait(QUIET / 2)
    assert groups[-1] == ["ack-2", "done-2"]


def test_a_full_group_leaves_without_waiting():
    batcher, groups, flushed = recording(idle=QUIET, max_wait=2 * QUIET, max_items=3)
    for item in ("a", "b", "c"):
        batcher.add(item)
    assert flushed.wait(QUIET / 2)
    assert groups == [["a", "b", "c"]]
