"""Small HTML pieces the admin pages share."""

from __future__ import annotations

import json
from typing import Any

from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext as _

from iotqueue.jsondepth import json_too_deep

from ..models import RunStatus, StepStatus
from ..waiting import Waiting

# Status values to their names in the active language (runs and steps share most values).
STATUS_CHOICES = (StepStatus, RunStatus)


def status_label(status: str) -> str:
    """A status's name in the active language, lower case as in a sentence ("in progress")."""
    for choices in STATUS_CHOICES:
        if status in choices.values:
            return str(choices(status).label).lower()
    return status.replace("_", " ")


def status_badge(status: str) -> str:
    """A run or step status as a coloured pill (colours in static/jobs/admin.css)."""
    return format_html('<span class="iq-status iq-status-{}">{}</span>', status, status_label(status))


def waiting_html(waiting: Waiting | None) -> str:
    """Why a run or step waits: the sentence, its reason code on hover, and a link to the run
    that holds the device when another run blocks it."""
    if waiting is None:
        return ""
    sentence = format_html(
        '<span class="iq-why iq-why-{}" title="{}">{}</span>', waiting.reason, waiting.reason, waiting.message
    )
    if waiting.blocking_run is None:
        return sentence
    return format_html(
        '{} <a class="iq-why-run" href="{}" title="{}">{}</a>',
        sentence,
        run_url(waiting.blocking_run),
        _("the run that holds the device"),
        _("open run %(run)s") % {"run": str(waiting.blocking_run)[:8]},
    )


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
