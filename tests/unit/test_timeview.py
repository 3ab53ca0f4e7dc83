"""The run's time view as geometry: lanes, bars and their segments, aggregation of big
fan-outs, the time axis, and the rollout chart against its ramp (jobs/timeview.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jobs.timeview import (
    LABEL_WIDTH,
    MIN_SEGMENT,
    RIGHT_PAD,
    ROLLOUT_BARS_MAX,
    WIDTH,
    MinuteCount,
    Ramp,
    Span,
    StepGroup,
    nice_ceiling,
    offset_label,
    planned_rate,
    rollout_chart_build,
    tick_step,
    timeview_build,
)

T0 = datetime(2026, 11, 26, 7, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def span(step_id: int, device: str, *, index: int = 0, status: str = "succeeded", **times) -> Span:
    fields = {
        "phase": "forward",
        "action": "on",
        "attempt": 1,
        "queued_at": None,
        "dispatched_at": None,
        "finished_at": None,
    }
    fields.update(times)
    return Span(step_id=step_id, index=index, device=device, status=status, **fields)


def segments_by_kind(bar) -> dict[str, object]:
    return {seg.cls.split()[-1]: seg for seg in bar.segments}


def test_each_queued_step_is_a_bar_on_its_device_lane_queued_then_dispatched_then_done():
    # given: Morning's gate-1 then lamp-2, one after the other
    spans = [
        span(1, "gate-1", queued_at=at(0), dispatched_at=at(1), finished_at=at(3)),
        span(2, "lamp-2", index=1, queued_at=at(3), dispatched_at=at(4), finished_at=at(10)),
    ]
    # when
    view = timeview_build(spans=spans, groups=[], start=T0, end=at(10), now=at(60))
    # then: a lane per device in the order they were used, a bar per step
    assert [lane.label for lane in view.lanes] == ["gate-1", "lamp-2"]
    assert [bar.step_id for bar in view.bars] == [1, 2]
    assert view.lanes[0].y < view.lanes[1].y
    gate, lamp = (segments_by_kind(bar) for bar in view.bars)
    assert set(gate) == {"tv-seg-queued", "tv-seg-dispatched", "tv-end-succeeded"}
    # the queued segment ends where the dispatched one starts, left to right in time
    assert gate["tv-seg-queued"].x == LABEL_WIDTH
    assert abs(gate["tv-seg-queued"].x + gate["tv-seg-queued"].width - gate["tv-seg-dispatched"].x) < 0.01
    assert gate["tv-seg-dispatched"].x < lamp["tv-seg-queued"].x
    assert abs(lamp["tv-seg-dispatched"].x + lamp["tv-seg-dispatched"].width - (WIDTH - RIGHT_PAD)) < 0.01
    assert all("tv-bar" in bar.cls.split() for bar in view.bars)
    assert view.now_x is None  # the run ended before now: no now line


def test_a_step_still_waiting_counts_up_to_now_and_never_queued_rows_have_no_bar():
    spans = [
        span(1, "cam-3", status="queued", queued_at=at(0)),
        span(2, "vac-4", index=1, status="pending"),
    ]
    view = timeview_build(spans=spans, groups=[], start=T0, end=at(30), now=at(30))
    assert [bar.step_id for bar in view.bars] == [1]
    queued = segments_by_kind(view.bars[0])["tv-seg-queued"]
    assert abs(queued.x + queued.width - (WIDTH - RIGHT_PAD)) < 0.01
    assert view.now_x == WIDTH - RIGHT_PAD


def test_an_instant_step_is_still_visible():
    spans = [span(1, "gate-1", queued_at=at(0), dispatched_at=at(0), finished_at=at(0.001))]
    view = timeview_build(spans=spans, groups=[], start=T0, end=at(3600), now=at(3600))
    assert all(seg.width >= MIN_SEGMENT for seg in view.bars[0].segments if "tv-seg" in seg.cls)


def test_retries_are_marked_and_a_step_backing_off_shows_it():
    # given: a face terminal whose first two attempts went unanswered; it now backs off
    retrying = span(
        1,
        "face-07",
        status="retrying",
        attempt=2,
        queued_at=at(10),
        dispatched_at=at(11),
        retried_at=(at(5), at(20)),
    )
    view = timeview_build(spans=[retrying], groups=[], start=T0, end=at(30), now=at(30))
    bar = view.bars[0]
    assert "tv-retried" in bar.cls
    assert [mark.cls for mark in bar.marks] == ["tv-mark tv-retry", "tv-mark tv-retry"]
    kinds = segments_by_kind(bar)
    # the attempt at the device ended when it was retried, then the back-off runs until now
    dispatched, backoff = kinds["tv-seg-dispatched"], kinds["tv-seg-backoff"]
    assert abs(dispatched.x + dispatched.width - backoff.x) < 0.01
    assert abs(backoff.x + backoff.width - (WIDTH - RIGHT_PAD)) < 0.01


def test_compensation_steps_are_marked_on_their_device_lane():
    spans = [
        span(1, "agent-1", status="succeeded", queued_at=at(0), dispatched_at=at(1), finished_at=at(2)),
        span(
            3,
            "agent-1",
            status="succeeded",
            phase="compensation",
            queued_at=at(5),
            dispatched_at=at(6),
            finished_at=at(7),
        ),
    ]
    view = timeview_build(spans=spans, groups=[], start=T0, end=at(8), now=at(9))
    assert len(view.lanes) == 1
    undo = view.bars[1]
    assert "tv-compensation" in undo.cls and undo.marks[0].cls == "tv-mark tv-undo"
    assert view.bars[0].segments[0].y == undo.segments[0].y  # same lane


def test_a_big_fan_out_draws_a_few_lanes_and_one_aggregate_lane_for_the_rest():
    # given: scenario 4's rollout, the first 200 of 2,000 rows read one by one
    spans = [
        span(n, f"pump-{n:04d}", queued_at=at(n), dispatched_at=at(n + 1), finished_at=at(n + 2))
        for n in range(200)
    ]
    group = StepGroup(
        phase="forward",
        index=0,
        label="firmware/check",
        started=1_550,
        first=at(0),
        last=at(3000),
        active=True,
    )
    # when
    view = timeview_build(spans=spans, groups=[group], start=T0, end=at(3000), now=at(3000), lanes_shown=10)
    # then: ten device lanes, then one lane for the other 1,540 devices, and a note saying so
    assert len(view.bars) == 10 and len(view.lanes) == 11
    (aggregate,) = view.aggregates
    assert "1,540 more devices" in aggregate.title and "tv-agg" in aggregate.cls
    assert view.lanes[-1].y > view.lanes[-2].y
    assert abs(aggregate.x + aggregate.width - (WIDTH - RIGHT_PAD)) < 0.01  # still going: to now
    assert view.notes and "10" in view.notes[0]
    assert view.height > view.lanes[-1].y


def test_a_run_that_all_fits_has_no_aggregate_lane():
    spans = [span(1, "gate-1", queued_at=at(0), dispatched_at=at(1), finished_at=at(2))]
    group = StepGroup(
        phase="forward", index=0, label="unlock", started=1, first=at(0), last=at(2), active=False
    )
    view = timeview_build(spans=spans, groups=[group], start=T0, end=at(2), now=at(5))
    assert view.aggregates == [] and view.notes == []


def test_time_ticks_fit_the_run_from_milliseconds_to_hours():
    assert tick_step(0.05) == 0.01
    assert tick_step(8) == 1
    assert tick_step(3600) == 600
    assert offset_label(0) == "0"
    assert offset_label(0.25) == "+250 ms"
    assert offset_label(1.5) == "+1.5 s"
    assert offset_label(120) == "+2 min"
    assert offset_label(5400) == "+1 h 30 min"
    view = timeview_build(
        spans=[span(1, "gate-1", queued_at=at(0), dispatched_at=at(0.01), finished_at=at(0.04))],
        groups=[],
        start=T0,
        end=at(0.05),
        now=at(1),
    )
    labels = [tick.label for tick in view.ticks]
    assert labels[:3] == ["0", "+10 ms", "+20 ms"]
    assert all(a.at < b.at for a, b in zip(view.ticks, view.ticks[1:], strict=False))


# --- the rollout chart -----------------------------------------------------------------------


def minutes(*counts: tuple[int, int]) -> list[MinuteCount]:
    return [MinuteCount(T0 + timedelta(minutes=i), ok, bad) for i, (ok, bad) in enumerate(counts)]


def test_rollout_chart_stacks_finished_devices_per_minute_under_the_planned_rate():
    # given: 50 a minute, 20 in flight (scenario 4)
    ramp = Ramp(per_minute=50, max_in_flight=20)
    chart = rollout_chart_build(
        index=0,
        label="firmware/check",
        ramp=ramp,
        minutes=minutes((40, 2), (48, 0), (30, 10)),
        start=T0,
        end=T0 + timedelta(minutes=2, seconds=30),
        total=2_000,
    )
    ok = [bar for bar in chart.bars if "tv-rate-ok" in bar.cls]
    failed = [bar for bar in chart.bars if "tv-rate-failed" in bar.cls]
    assert len(ok) == 3 and len(failed) == 2
    # a failed part sits on top of its minute's succeeded part
    assert abs(failed[0].y + failed[0].height - ok[0].y) < 0.01
    assert ok[1].height > ok[0].height > ok[2].height
    # the plan is flat at 50 a minute, above the tallest bar
    ys = {point.split(",")[1] for point in chart.plan_points.split()}
    assert len(ys) == 1 and float(ys.pop()) < min(bar.y for bar in chart.bars)
    assert "130 of 2,000 devices finished" in chart.notes[0] and "50 a minute" in chart.notes[0]


def test_a_ramp_plans_a_rising_rate_as_devices_succeed():
    ramp = Ramp(per_minute=10, factor=2, every=10, maximum=40)
    assert [planned_rate(ramp, n) for n in (0, 9, 10, 20, 30, 100)] == [10, 10, 20, 40, 40, 40]
    chart = rollout_chart_build(
        index=0,
        label="fw",
        ramp=ramp,
        minutes=minutes((10, 0), (20, 0), (40, 0)),
        start=T0,
        end=T0 + timedelta(minutes=3),
        total=100,
    )
    heights = [float(point.split(",")[1]) for point in chart.plan_points.split()[::2]]
    assert heights[0] > heights[1] > heights[2]  # higher rate, higher up (smaller y)


def test_a_long_rollout_is_drawn_in_bounded_bars_and_without_a_limit_no_plan_line():
    long = [MinuteCount(T0 + timedelta(minutes=i), 5, 0) for i in range(600)]
    chart = rollout_chart_build(
        index=2,
        label="fw",
        ramp=Ramp(per_minute=0),
        minutes=long,
        start=T0,
        end=T0 + timedelta(minutes=600),
        total=3_000,
    )
    assert len(chart.bars) <= ROLLOUT_BARS_MAX
    assert chart.plan_points == ""
    assert any("average per minute" in note for note in chart.notes)
    assert "No rate limit" in chart.notes[0]
    # the average per minute stays 5 whatever a bar stands for
    assert {round(bar.height, 3) for bar in chart.bars[:-1]} == {round(chart.bars[0].height, 3)}


def test_value_axes_end_on_round_numbers_close_above_the_data():
    assert [nice_ceiling(v) for v in (0, 0.5, 1, 22, 101, 4_100)] == [1.0, 0.5, 1.0, 24.0, 120.0, 5_000.0]


def test_steps_without_a_device_get_a_lane_each():
    # given: a delay and a task step between two device steps
    spans = [
        span(1, "gate-1", queued_at=at(0), dispatched_at=at(0), finished_at=at(1)),
        span(2, "", index=1, action="delay", queued_at=at(1), dispatched_at=at(1), finished_at=at(6)),
        span(3, "", index=2, action="report", queued_at=at(6), dispatched_at=at(6), finished_at=at(7)),
        span(4, "gate-1", index=3, queued_at=at(7), dispatched_at=at(7), finished_at=at(8)),
    ]
    view = timeview_build(spans=spans, groups=[], start=T0, end=at(8), now=at(9))
    assert [lane.label for lane in view.lanes] == ["gate-1", "#1 delay", "#2 report"]
    assert view.bars[0].segments[0].y == view.bars[3].segments[0].y  # gate-1's two steps share its lane
