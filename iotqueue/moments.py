"""Times in the admin's lists, to the second: one format for every list of every app."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from django.utils.html import format_html


def moment_html(when: datetime | None, *, now: datetime | None = None) -> str:
    """17:08:04 today, 2026-11-25 17:08:04 before (the whole date and time zone on hover),
    in the current time zone; '-' for no time. Django's own list format reads "5:08 p.m.":
    events seconds apart would read alike."""
    if when is None:
        return "-"
    local = timezone.localtime(when)
    today = timezone.localtime(now or timezone.now()).date()
    shown = f"{local:%H:%M:%S}" if local.date() == today else f"{local:%Y-%m-%d %H:%M:%S}"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>', when.isoformat(), f"{local:%Y-%m-%d %H:%M:%S %Z}", shown
    )
