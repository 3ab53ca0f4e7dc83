"""Small HTML pieces the admin pages share."""

from __future__ import annotations

from django.urls import reverse
from django.utils.html import format_html


def status_badge(status: str) -> str:
    """A run or step status as a coloured pill (colours in static/jobs/admin.css)."""
    return format_html('<span class="iq-status iq-status-{}">{}</span>', status, status.replace("_", " "))


def run_url(run_id) -> str:
    return reverse("admin:jobs_jobrun_change", args=[run_id])
