"""Stacked bar charts as inline SVG, drawn on the server: the console loads nothing from
elsewhere, so it works on a network without internet. Pure: values in, markup out.

Colours come from CSS classes (`iq-fill-<series>`, jobs/static/jobs/dashboard.css), so a
chart follows the admin's light and dark themes; every segment carries a <title> (the
browser's tooltip) and data attributes naming its series and count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

# Drawing units of the viewBox; the SVG scales to its box's width (CSS), these only set
# the proportions and the room left for the axis labels.
WIDTH = 640
HEIGHT = 220
LEFT = 44  # room for the count labels of the y axis
BOTTOM = 26  # room for the bar labels
TOP = 10
GAP = 0.2  # of each bar's slot left empty between bars


@dataclass(frozen=True)
class Bar:
    """One bar: its axis label, the heading of its tooltips, and a count per series."""

    label: str
    title: str
    counts: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def axis_top(value: int) -> int:
    """The y axis's top: the smallest 1, 2 or 5 times a power of ten at or above `value`
    (at least 1), so the gridlines fall on round counts."""
    top = 1
    while True:
        for step in (1, 2, 5):
            if top * step >= value:
                return top * step
        top *= 10


def stacked_bars_svg(
    *,
    bars: Sequence[Bar],
    series: Sequence[tuple[str, str]],
    element_id: str,
    caption: str,
    label_every: int = 1,
) -> SafeString:
    """An SVG of `bars`, each stacked bottom-up in the order of `series` ((key, name) pairs);
    every `label_every`-th bar is labelled on the x axis. An empty chart says so."""
    top = axis_top(max((bar.total for bar in bars), default=0))
    plot_h = HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT) / max(1, len(bars))
    parts: list[str] = [_grid(top, plot_h)]
    for i, bar in enumerate(bars):
        x = LEFT + i * slot + slot * GAP / 2
        w = slot * (1 - GAP)
        parts.append(_bar(bar, series, i, x, w, top, plot_h))
        if i % label_every == 0:
            parts.append(
                format_html(
                    '<text class="iq-chart-label" x="{}" y="{}" text-anchor="middle">{}</text>',
                    _n(x + w / 2),
                    HEIGHT - 7,
                    bar.label,
                )
            )
    if not any(bar.total for bar in bars):
        parts.append(
            format_html(
                '<text class="iq-chart-empty" x="{}" y="{}" text-anchor="middle">{}</text>',
                _n(LEFT + (WIDTH - LEFT) / 2),
                _n(TOP + plot_h / 2),
                _("No runs in this period."),
            )
        )
    return format_html(
        '<svg id="{}" class="iq-chart" viewBox="0 0 {} {}" role="img" aria-labelledby="{}-title" '
        'xmlns="http://www.w3.org/2000/svg"><title id="{}-title">{}</title>{}</svg>',
        element_id,
        WIDTH,
        HEIGHT,
        element_id,
        element_id,
        caption,
        SafeString("".join(parts)),
    )


def _grid(top: int, plot_h: float) -> str:
    """Gridlines at 0, half and the top, each with its count on the left."""
    lines = []
    for value in sorted({0, top // 2, top}):
        y = TOP + plot_h - plot_h * value / top
        lines.append((LEFT, _n(y), WIDTH, _n(y), LEFT - 6, _n(y + 5), value))
    return format_html_join(
        "",
        '<line class="iq-chart-grid" x1="{}" y1="{}" x2="{}" y2="{}"/>'
        '<text class="iq-chart-axis" x="{}" y="{}" text-anchor="end">{}</text>',
        lines,
    )


def _bar(
    bar: Bar, series: Sequence[tuple[str, str]], i: int, x: float, w: float, top: int, plot_h: float
) -> str:
    segments = []
    y = TOP + plot_h
    for key, name in series:
        count = bar.counts.get(key, 0)
        if not count:
            continue
        h = plot_h * count / top
        y -= h
        tip = _("%(when)s: %(count)s %(status)s") % {"when": bar.title, "count": count, "status": name}
        segments.append((key, count, _n(x), _n(y), _n(w), _n(h), key, tip))
    return format_html(
        '<g class="iq-chart-bar" data-bar="{}" data-total="{}">{}</g>',
        i,
        bar.total,
        format_html_join(
            "",
            '<rect data-series="{}" data-count="{}" x="{}" y="{}" width="{}" height="{}" '
            'class="iq-fill-{}"><title>{}</title></rect>',
            segments,
        ),
    )


def _n(value: float) -> str:
    """A coordinate with one decimal, without a trailing .0: short markup, stable output."""
    return f"{value:.1f}".removesuffix(".0")
