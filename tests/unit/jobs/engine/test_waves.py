"""Waves with gates (jobs/engine/waves.py): splitting devices into waves, and a wave's condition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs.engine.waves import wave_name, wave_verdict, waves_expand
from jobs.models import JobStep
from jobs.validation import step_errors, waves_problem


def fleet(count: int, **labels_of) -> list[SimpleNamespace]:
    """`count` devices; labels_of={"region": fn(i)} gives device i its label."""
    labelled = [{key: fn(i) for key, fn in labels_of.items() if fn(i) is not None} for i in range(count)]
    return [SimpleNamespace(name=f"d{i}", labels=labels) for i, labels in enumerate(labelled)]


@pytest.mark.parametrize("total", [1, 2, 3, 7, 99, 100, 101, 8000])
def test_every_device_is_in_exactly_one_wave_and_a_wave_is_at_least_one_device(total):
    # given a canary of 1 %, then 10 %, then the rest
    specs = [{"percent": 1, "gate": "approval"}, {"percent": 10, "max_failed_percent": 2}, {"rest": True}]

    assigned, waves = waves_expand(specs, fleet(total))

    # then each device has a wave, waves are in order, their sizes add up, none is empty
    assert all(0 <= wave < len(waves) for wave in assigned)
    assert assigned == sorted(assigned)
    assert [w["size"] for w in waves] == [assigned.count(n) for n in range(len(waves))]
    assert sum(w["size"] for w in waves) == total
    assert all(w["size"] >= 1 for w in waves)


def test_percentages_round_up_so_a_small_fleet_still_has_a_canary():
    _, waves = waves_expand([{"percent": 1}, {"percent": 10}, {"rest": True}], fleet(8000))
    assert [w["size"] for w in waves] == [80, 800, 7120]
    _, waves = waves_expand([{"percent": 1}, {"percent": 10}, {"rest": True}], fleet(30))
    assert [w["size"] for w in waves] == [1, 3, 26]


def test_waves_that_find_no_device_left_are_dropped():
    # given 2 devices and three waves of at least one each, then the rest
    _, waves = waves_expand([{"count": 1}, {"count": 1}, {"count": 1}, {"rest": True}], fleet(2))
    assert [w["size"] for w in waves] == [1, 1]


def test_devices_no_wave_takes_form_a_last_wave_with_no_rule():
    _, waves = waves_expand([{"count": 2, "gate": "approval"}], fleet(5))
    assert waves == [{"size": 2, "label": "", "gate": "approval"}, {"size": 3, "label": ""}]


def test_by_label_gives_one_wave_per_value_in_sorted_order_and_the_unlabelled_last():
    # given a canary, then one region at a time; some devices have no region
    regions = {0: "eu", 1: "us", 2: "ap", 3: None, 4: "eu", 5: "us", 6: "ap"}
    devices = fleet(7, region=regions.get)

    assigned, waves = waves_expand([{"count": 1}, {"by_label": "region", "gate": "approval"}], devices)

    assert [(w["label"], w["size"]) for w in waves] == [
        ("", 1),
        ("region=ap", 2),
        ("region=eu", 1),
        ("region=us", 2),
        ("region unset", 1),
    ]
    assert all(w.get("gate") == "approval" for w in waves[1:])
    assert assigned == [0, 3, 1, 4, 2, 3, 1]  # device 0 is the canary; the rest by region


def test_no_waves_is_one_wave():
    assigned, waves = waves_expand([], fleet(3))
    assert assigned == [0, 0, 0] and waves == [{"size": 3, "label": ""}]


@pytest.mark.parametrize(
    ("wave", "by_status", "passed"),
    [
        ({}, {"failed": 5}, True),
        ({"max_failed_percent": 2}, {"succeeded": 98, "failed": 2}, True),
        ({"max_failed_percent": 2}, {"succeeded": 97, "failed": 1, "timed_out": 2}, False),
        ({"max_failed_percent": 0}, {"succeeded": 9, "canceled": 1}, False),
        ({"min_succeeded_percent": 90}, {"succeeded": 9, "rejected": 1}, True),
        ({"min_succeeded_percent": 90}, {"succeeded": 8, "rejected": 2}, False),
        # skipped rows did nothing: they count neither way
        ({"min_succeeded_percent": 100}, {"succeeded": 3, "skipped": 7}, True),
    ],
)
def test_a_wave_condition_counts_its_devices_that_ended(wave, by_status, passed):
    ok, counted = wave_verdict(wave, by_status)
    assert ok is passed
    assert "succeeded" in counted


def test_a_wave_is_named_with_its_label():
    waves = [{"size": 1, "label": ""}, {"size": 2, "label": "region=eu"}]
    assert wave_name(0, waves) == "wave 1 of 2"
    assert wave_name(1, waves) == "wave 2 of 2 (region=eu)"


@pytest.mark.parametrize(
    ("waves", "problem"),
    [
        ({"percent": 1}, "JSON list"),
        ([{"percent": 0}], "percent"),
        ([{"percent": 1, "count": 2}], "exactly one"),
        ([{"rest": True}, {"percent": 5}], "only the last"),
        ([{"count": 1, "gate": "maybe"}], "gate"),
        ([{"count": 1, "gate": "webhook"}], "webhook_url"),
        ([{"count": 1, "webhook_url": "https://x.example/"}], "webhook_url"),
        ([{"count": 1, "gate": "webhook", "webhook_url": "file:///etc/passwd"}], "http"),
        ([{"count": 1, "gate": "webhook", "webhook_url": "ftp://x.example/"}], "http"),
        ([{"count": 1, "soak_seconds": -1}], "soak_seconds"),
        ([{"count": 1, "max_failed_percent": 101}], "max_failed_percent"),
        ([{"count": 1, "on_fail": "explode"}], "on_fail"),
        ([{"count": 1, "colour": "red"}], "only"),
    ],
)
def test_waves_are_checked_on_save(waves, problem):
    assert problem in waves_problem(waves)


def test_valid_waves_pass_and_need_a_fan_out_target():
    waves = [
        {"percent": 1, "gate": "webhook", "webhook_url": "https://health.example.com/gate"},
        {"percent": 10, "max_failed_percent": 2, "soak_seconds": 600},
        {"by_label": "region", "gate": "approval", "on_fail": "abort"},
    ]
    assert waves_problem(waves) == ""
    fanout = JobStep(position=0, labels={"kind": "gateway"}, action="firmware/flash", waves=waves)
    assert "waves" not in step_errors(fanout)
    single = JobStep(position=0, device_id=1, action="firmware/flash", waves=waves)
    assert "fan-out" in step_errors(single)["waves"]


def test_an_estimate_in_waves_adds_each_wave_and_the_soaks_and_counts_the_approval_gates():
    from jobs.estimate import RowTiming, fanout_finish_seconds, waves_finish_seconds

    # given 10 devices of 2 s each, at most 2 at once, in a canary of 1 (soak 60 s, approval),
    # then 4, then the rest
    spec = {"max_in_flight": 2}
    specs = [
        {"count": 1, "soak_seconds": 60, "gate": "approval"},
        {"count": 4, "gate": "auto"},
        {"rest": True},
    ]
    assigned, waves = waves_expand(specs, fleet(10))
    rows = [RowTiming(2.0)] * 10

    estimate = waves_finish_seconds(spec, rows, assigned, waves)

    # then each wave takes what it would alone (1 row: 2 s, 4 rows: 4 s, 5 rows: 6 s), plus the soak
    assert estimate.seconds == 2 + 4 + 6 + 60
    assert (estimate.waves, estimate.soak_seconds, estimate.approval_gates) == (3, 60, 1)
    # and without waves the same fan-out takes less: waves wait for each other
    assert fanout_finish_seconds(spec, rows) == 10
