"""Holding a command for its time windows (jobs/engine/holds.py) as the planner does it,
carried out by the simulation's in-memory executor (tests/unit/jobs/engine_world.py): a
command outside its window or in its device's quiet hours is queued without asking for the
lock, its `window` deadline asks again, and an urgent step is never held."""

from __future__ import annotations

from datetime import time, timedelta

from jobs.engine.holds import device_windows, row_hold
from jobs.models import JobRun, OnFailure, StepRun, StepStatus
from jobs.timewindows import WindowSpec

from ..engine_world import EPOCH, World

# EPOCH is 2026-01-01 00:00 UTC: 09:00 in Tokyo.
TOKYO_DAY = {"timezone": "Asia/Tokyo", "quiet_hours_start": time(8, 0), "quiet_hours_end": time(21, 0)}


def quiet(world: World, device: str) -> None:
    for name, value in TOKYO_DAY.items():
        setattr(world.devices[device], name, value)


def test_a_command_in_its_devices_quiet_hours_is_held_and_goes_when_they_end():
    # given d0 in its quiet hours until 21:00 Tokyo time (12:00 UTC)
    world = World()
    quiet(world, "d0")
    run = world.run_new([("d0", OnFailure.ABORT, 1)], 5)

    # when the run starts
    world.start(run.pk)

    # then its row is queued, asked no lock, and nothing was sent; a `window` deadline waits
    (row,) = world.rows.values()
    assert row.status == StepStatus.QUEUED
    assert world.locks.devices.get("d0") is None or world.locks.devices["d0"].holder is None
    assert world.inbox["d0"] == []
    assert world.locks.zset[f"window:{row.pk}:0"] == int((EPOCH + timedelta(hours=12)).timestamp() * 1000)
    held = [event for event in world.events if event.kind == "step.held"]
    assert held and "quiet hours until 2026-01-01T12:00:00+00:00" in held[0].message

    # when time reaches the end of the quiet hours
    world.advance(12 * 3600)

    # then the command goes
    assert world.rows[row.pk].status == StepStatus.DISPATCHED
    assert len(world.inbox["d0"]) == 1


def test_an_urgent_step_is_not_held():
    world = World()
    quiet(world, "d0")
    run = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    run.plan[0]["urgent"] = True

    world.start(run.pk)

    (row,) = world.rows.values()
    assert row.status == StepStatus.DISPATCHED
    assert len(world.inbox["d0"]) == 1


def test_a_command_outside_its_label_window_waits_for_the_opening():
    # given a run that keeps a window for label site=berlin opening at 02:00 UTC daily for an hour
    world = World()
    world.devices["d0"].labels = {"site": "berlin"}
    run = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    run.windows = [WindowSpec("night", "0 2 * * *", 60, "UTC", label=("site", "berlin")).as_dict()]

    # when it starts at midnight
    world.start(run.pk)

    # then it waits until 02:00, and goes then
    (row,) = world.rows.values()
    assert row.status == StepStatus.QUEUED and world.inbox["d0"] == []
    world.advance(2 * 3600)
    assert world.rows[row.pk].status == StepStatus.DISPATCHED


def test_a_window_for_another_label_or_group_does_not_hold_the_device():
    world = World()
    device = world.devices["d1"]
    device.labels = {"site": "paris"}
    run = JobRun(
        windows=[
            WindowSpec("berlin", "0 2 * * *", 60, "UTC", label=("site", "berlin")).as_dict(),
            WindowSpec("stores", "0 2 * * *", 60, "UTC", group="stores").as_dict(),
        ],
        plan=[{"urgent": False}],
    )
    assert device_windows(run, device, groups=()) == []
    assert [w.name for w in device_windows(run, device, groups={"stores"})] == ["stores"]
    # and a run with no windows and a device with no quiet hours is never held
    row = StepRun(run=JobRun(plan=[{}]), device=device, index=0)
    assert row_hold(row, EPOCH, {}) is None
