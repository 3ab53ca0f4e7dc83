"""The dashboard's stacked bar chart (jobs/charts.py): well-formed SVG, bars stacked in the
series' order and scaled to a round axis, tooltips, labels, an empty chart that says so."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from jobs.charts import BOTTOM, HEIGHT, TOP, Bar, axis_top, stacked_bars_svg

SVG = "{http://www.w3.org/2000/svg}"
SERIES = [("succeeded", "succeeded"), ("failed", "failed"), ("running", "running")]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(str(svg))


@pytest.mark.parametrize(
    ("value", "top"), [(0, 1), (1, 1), (2, 2), (3, 5), (5, 5), (7, 10), (11, 20), (101, 200), (4999, 5000)]
)
def test_the_axis_ends_on_a_round_count_at_or_above_the_tallest_bar(value, top):
    assert axis_top(value) == top


def test_each_bar_stacks_its_series_bottom_up_in_order_scaled_to_the_axis():
    # given two bars: 3 succeeded + 1 failed, and 2 running
    bars = [
        Bar(label="10", title="10:00", counts={"succeeded": 3, "failed": 1}),
        Bar(label="11", title="11:00", counts={"running": 2}),
    ]

    # when drawn
    root = parse(stacked_bars_svg(bars=bars, series=SERIES, element_id="c", caption="Runs"))

    # then the axis tops at 5, and the first bar's succeeded sits on the baseline, failed on it
    plot_h = HEIGHT - TOP - BOTTOM
    groups = root.findall(f"{SVG}g")
    assert [g.get("data-total") for g in groups] == ["4", "2"]
    first = groups[0].findall(f"{SVG}rect")
    assert [r.get("data-series") for r in first] == ["succeeded", "failed"]
    heights = [float(r.get("height")) for r in first]
    assert heights == pytest.approx([plot_h * 3 / 5, plot_h * 1 / 5], abs=0.1)
    succeeded, failed = first
    assert float(succeeded.get("y")) + float(succeeded.get("height")) == pytest.approx(TOP + plot_h, abs=0.1)
    assert float(failed.get("y")) + float(failed.get("height")) == pytest.approx(
        float(succeeded.get("y")), abs=0.1
    )
    # a series a bar does not have draws nothing
    assert [r.get("data-series") for r in groups[1].findall(f"{SVG}rect")] == ["running"]
    # and every segment says what it counts
    assert first[1].find(f"{SVG}title").text == "10:00: 1 failed"
    assert root.get("id") == "c" and root.find(f"{SVG}title").text == "Runs"


def test_every_nth_bar_is_labelled():
    bars = [Bar(label=f"{h:02d}", title="", counts={}) for h in range(24)]
    root = parse(stacked_bars_svg(bars=bars, series=SERIES, element_id="c", caption="x", label_every=3))
    labels = [t.text for t in root.findall(f"{SVG}text") if t.get("class") == "iq-chart-label"]
    assert labels == [f"{h:02d}" for h in range(0, 24, 3)]


def test_an_empty_chart_draws_its_axis_and_says_there_were_no_runs():
    root = parse(stacked_bars_svg(bars=[Bar("a", "a", {})], series=SERIES, element_id="c", caption="x"))
    assert [t.text for t in root.findall(f"{SVG}text") if t.get("class") == "iq-chart-empty"] == [
        "No runs in this period."
    ]
    assert root.findall(f"{SVG}g/{SVG}rect") == []


def test_text_from_outside_is_escaped():
    bars = [Bar(label="<b>", title='"&', counts={"failed": 1})]
    svg = stacked_bars_svg(bars=bars, series=[("failed", "<i>failed</i>")], element_id="c", caption="<x>")
    root = parse(svg)  # well-formed: nothing broke out of its attribute or element
    assert "<b>" not in svg and "<i>" not in svg
    assert root.find(f"{SVG}g/{SVG}rect/{SVG}title").text == '"&: 1 <i>failed</i>'
