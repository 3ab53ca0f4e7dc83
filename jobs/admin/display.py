"""Small HTML pieces the admin pages share."""

from __future__ import annotations

import json
from typing import Any

from django.urls import reverse
from django.utils.html import format_html

from iotqueue.jsondepth import json_too_deep


def status_badge(status: str) -> str:
    """A run or step status as a coloured pill (colours in static/jobs/admin.css)."""
    return format_html('<span class="iq-status iq-status-{}">{}</span>', status, status.replace("_", " "))


def run_url(run_id) -> str:
    return reverse("admin:jobs_jobrun_change", args=[run_id])


def json_block(value: Any) -> str:
    """A stored JSON value as an indented <pre> block.

    Values stored before IOTQUEUE_JSON_MAX_DEPTH was enforced may nest deeper than Python's
    indenting encoder can recurse inside a page render: those are shown on one line, or
    named as too deep when even that fails, so that the page itself always renders.
    """
    if not json_too_deep(value):
        return format_html("<pre>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False))
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:
        text = "(nested too deeply to show)"
    return format_html("<pre>{}</pre>", text)
