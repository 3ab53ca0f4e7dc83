"""The dashboard: the admin's first page (the fleet, runs over time, stuck runs, rollouts,
recent failures) and the fragment its live refresh fetches; the device list's state filter
its numbers link to.

The page is the admin's own index view (`AdminSite.index`, with its app list below the
dashboard) given the dashboard's context and template; iotqueue/urls.py routes /admin/ here
ahead of the admin's URLs. Staff only, as every admin page (`AdminSite.admin_view`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import JSONField
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import formats, timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from redis import RedisError

from ..charts import Bar, stacked_bars_svg
from ..choices import AbortCause
from ..dashboard import (
    CHART_STATUSES,
    FLEET_STATES,
    FleetBoard,
    FleetCounts,
    RunsChart,
    StatusBucket,
    device_state_q,
    devices_locked,
    fleet_board,
    rollouts_active,
    runs_by_status,
    runs_failed_recent,
)
from ..models import Rollout, RolloutState, RunStatus
from ..rollouts import APPLIES
from ..timeline import duration_format
from ..waiting import runs_stuck, stuck_after
from .display import run_url

log = logging.getLogger(__name__)

INDEX_TEMPLATE = "admin/jobs/dashboard/index.html"
PANELS_TEMPLATE = "admin/jobs/dashboard/panels.html"
# How often an open dashboard fetches its panels: fresh enough to watch a rollout move, and
# one request of a fixed dozen queries per open page.
DASHBOARD_REFRESH_MS = 5000
# Stuck runs listed; the heading says when there are more.
STUCK_SHOWN = 20
# Every third hour is labelled on the 24-hour chart: 24 labels would run into each other.
HOUR_LABEL_EVERY = 3

STATE_NAMES = {
    "online": gettext_lazy("online"),
    "offline": gettext_lazy("offline"),
    "busy": gettext_lazy("busy"),
    "idle": gettext_lazy("idle"),
    "disabled": gettext_lazy("disabled"),
    "total": gettext_lazy("total"),
}
STATE_HELP = {
    "online": gettext_lazy("Enabled devices that report online, or whose presence is not tracked."),
    "offline": gettext_lazy("Enabled devices that report offline or never reported."),
    "busy": gettext_lazy("Enabled devices that hold their lock or have a command in flight."),
    "idle": gettext_lazy("Online devices that are not busy."),
    "disabled": gettext_lazy("Devices that receive no commands."),
    "total": gettext_lazy("Every device."),
}


class DeviceStateFilter(admin.SimpleListFilter):
    """The device list by the dashboard's states: `?state=online|offline|busy|idle|disabled`."""

    title = gettext_lazy("state")
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [(state, STATE_NAMES[state]) for state in FLEET_STATES if state != "total"]

    def queryset(self, request, queryset):
        state = self.value()
        if state not in STATE_NAMES or state == "total":
            return queryset
        locked = devices_locked() if state in ("busy", "idle") else None
        return queryset.filter(device_state_q(state=state, locked=locked))


# --- the fleet board ---------------------------------------------------------------------------


def device_list_url(*, state: str, label: str | None = None, value: str | None = None) -> str | None:
    """The device list filtered as one number of the board counts; None when the label key
    cannot be written as a lookup (it holds `__` or names a lookup of JSONField itself)."""
    query: dict[str, str] = {} if state == "total" else {"state": state}
    if label is not None:
        if "__" in label or label in JSONField.get_lookups():
            return None
        if value is None:
            query[f"labels__{label}__isnull"] = "True"
        else:
            query[f"labels__{label}"] = value
    url = reverse("admin:devices_device_changelist")
    return f"{url}?{urlencode(query)}" if query else url


def _cells(counts: FleetCounts, label: str | None = None, value: str | None = None) -> list[dict[str, Any]]:
    return [
        {"state": state, "count": n, "url": device_list_url(state=state, label=label, value=value)}
        for state, n in counts.items()
    ]


def fleet_context(board: FleetBoard) -> dict[str, Any]:
    rows = [
        {
            "value": row.value,
            "shown": row.value
            if row.value is not None
            else _("(no %(label)s label)") % {"label": board.label},
            "cells": _cells(row.counts, board.label, row.value),
        }
        for row in board.rows
    ]
    return {
        "board": board,
        "states": [{"key": s, "name": STATE_NAMES[s], "help": STATE_HELP[s]} for s in FLEET_STATES],
        "totals": _cells(board.totals),
        "rows": rows,
        "other": _cells(board.other) if board.other else None,
    }


# --- the chart ---------------------------------------------------------------------------------


def _bars(buckets: list[StatusBucket], *, label_format: str, title_format: str) -> list[Bar]:
    return [
        Bar(
            label=formats.date_format(timezone.localtime(b.start), label_format),
            title=formats.date_format(timezone.localtime(b.start), title_format),
            counts=b.counts,
        )
        for b in buckets
    ]


def chart_context(chart: RunsChart) -> dict[str, Any]:
    series = [(status.value, status.label) for status in CHART_STATUSES]
    return {
        "series": series,
        "hours_svg": stacked_bars_svg(
            bars=_bars(chart.hours, label_format="H", title_format="SHORT_DATETIME_FORMAT"),
            series=series,
            element_id="dash-chart-24h",
            caption=_("Runs per hour over the last 24 hours, by status"),
            label_every=HOUR_LABEL_EVERY,
        ),
        "days_svg": stacked_bars_svg(
            bars=_bars(chart.days, label_format="D j", title_format="DATE_FORMAT"),
            series=series,
            element_id="dash-chart-7d",
            caption=_("Runs per day over the last 7 days, by status"),
        ),
        "hours_total": sum(b.total for b in chart.hours),
        "days_total": sum(b.total for b in chart.days),
    }


# --- stuck runs, rollouts, failures ------------------------------------------------------------


def stuck_context(now: datetime) -> dict[str, Any]:
    """The stuck runs with their reason; a note instead when Redis cannot be read."""
    try:
        stuck = runs_stuck(limit=STUCK_SHOWN + 1, now=now)
    except RedisError as exc:
        log.warning("dashboard without stuck runs: %s", exc)
        return {"stuck": [], "stuck_error": _("Redis cannot be reached: the reasons are unknown.")}
    return {
        "stuck": [
            {"item": item, "url": run_url(item.run.pk), "waited": duration_format(item.waited)}
            for item in stuck[:STUCK_SHOWN]
        ],
        "stuck_more": len(stuck) > STUCK_SHOWN,
        "stuck_error": None,
    }


def rollouts_context(now: datetime) -> list[dict[str, Any]]:
    out = []
    for rollout in rollouts_active(now=now):
        # A rollout in waves that is paused, soaking or at a gate starts no device: its state
        # says when it goes on, not an ETA.
        halt = waves_halt_text(rollout.waves) if rollout.halted else ""
        eta = None if halt else rollout.eta
        out.append(
            {
                "rollout": rollout,
                "halt": halt,
                "url": run_url(rollout.run.pk),
                "eta": duration_format(eta) if eta is not None else None,
                "eta_at": now + eta if eta is not None else None,
                "gauges": [
                    {"gauge": g, "width": round(g.closeness * 100), "cause_name": _cause_name(g.cause)}
                    for g in rollout.gauges
                ],
                "width": {
                    key: _percent(n, rollout.total)
                    for key, n in (
                        ("succeeded", rollout.succeeded),
                        ("failed", rollout.failed),
                        ("in_flight", rollout.in_flight),
                        ("skipped", rollout.skipped),
                    )
                },
            }
        )
    return out


def waves_halt_text(waves: Rollout) -> str:
    """Why a rollout in waves starts no device now, for people: "Paused by ops: change
    freeze", "Awaiting approval of wave 2 of 3.", the webhook, or the soak's end."""
    following = {"wave": waves.wave + 2, "waves": len(waves.waves)}
    if waves.state == RolloutState.PAUSED:
        who = waves.decided_by or "?"
        if waves.reason:
            return _("Paused by %(who)s: %(reason)s") % {"who": who, "reason": waves.reason}
        return _("Paused by %(who)s.") % {"who": who}
    if waves.state == RolloutState.AWAITING_APPROVAL:
        return _("Awaiting approval of wave %(wave)s of %(waves)s.") % following
    if waves.state == RolloutState.AWAITING_WEBHOOK:
        return _("Awaiting the webhook's answer for wave %(wave)s of %(waves)s.") % following
    if waves.soak_until is not None:
        until = formats.time_format(timezone.localtime(waves.soak_until), "H:i:s")
        text = _("Soaking until %(until)s; then its gate decides whether wave %(wave)s of %(waves)s opens.")
        return text % {**following, "until": until}
    return _("Soaking; then its gate decides whether wave %(wave)s of %(waves)s opens.") % following


CAUSE_NAMES = {
    AbortCause.FAILED: gettext_lazy("failed"),
    AbortCause.REJECTED: gettext_lazy("rejected"),
    AbortCause.TIMED_OUT: gettext_lazy("timed out"),
    AbortCause.ANY: gettext_lazy("failed, rejected, timed out or canceled"),
}


def _cause_name(cause: str) -> str:
    """What an abort criterion counts, for people."""
    return str(CAUSE_NAMES.get(cause, cause))


def _percent(n: int, total: int) -> float:
    return round(n * 100 / total, 2) if total else 0.0


# Rollouts shown waiting for a decision: more than fit on a screen is a backlog, not a list.
GATED_SHOWN = 20
# The states in which a rollout waits for someone (or something) to decide.
GATED_STATES = (RolloutState.AWAITING_APPROVAL, RolloutState.AWAITING_WEBHOOK, RolloutState.PAUSED)


def gated_context(request) -> list[dict[str, Any]]:
    """Fan-outs in waves that wait for a decision (approval, the webhook, or paused), oldest
    first, with the gate actions that apply when the user may change runs. One query."""
    may_steer = request.user.has_perm("jobs.change_jobrun")
    gated = (
        Rollout.objects.filter(state__in=GATED_STATES, run__status=RunStatus.RUNNING)
        .select_related("run__template")
        .order_by("updated_at")[:GATED_SHOWN]
    )
    return [
        {
            "rollout": rollout,
            "url": run_url(rollout.run_id),
            "actions": [a for a, states in APPLIES.items() if may_steer and rollout.state in states],
        }
        for rollout in gated
        if rollout.run.cursor == rollout.index
    ]


def failures_context() -> list[dict[str, Any]]:
    return [{"run": run, "url": run_url(run.pk)} for run in runs_failed_recent()]


# --- the views ---------------------------------------------------------------------------------


def dashboard_context(request) -> dict[str, Any]:
    """Every panel's context, read with a fixed number of queries and two Redis pipelines."""
    now = timezone.now()
    label = request.GET.get("label") or None
    board = fleet_board(label=label)
    return {
        "title": _("Dashboard"),
        "now": now,
        "fleet": fleet_context(board),
        "chart": chart_context(runs_by_status(now=now)),
        **stuck_context(now),
        "stuck_after": duration_format(stuck_after()),
        "rollouts": rollouts_context(now),
        "gated": gated_context(request),
        "dashboard_url": reverse("dashboard"),
        "failures": failures_context(),
        "run_statuses": {status.value: status.label for status in RunStatus},
        "refresh_ms": DASHBOARD_REFRESH_MS,
        "fragment_url": _with_query(reverse("dashboard-fragment"), {"label": board.label}),
    }


def _with_query(url: str, params: Mapping[str, str | None]) -> str:
    query = urlencode({k: v for k, v in params.items() if v})
    return f"{url}?{query}" if query else url


def dashboard_index(request):
    """The admin index with the dashboard above its app list."""
    response = admin.site.index(request, extra_context=dashboard_context(request))
    response.template_name = INDEX_TEMPLATE
    return response


def dashboard_fragment(request):
    """The panels alone: what the open dashboard fetches every DASHBOARD_REFRESH_MS."""
    return TemplateResponse(request, PANELS_TEMPLATE, dashboard_context(request))


def dashboard_urls() -> list[URLPattern]:
    """/admin/ (the dashboard, ahead of the admin's own index) and its fragment, staff only."""
    return [
        path("admin/", admin.site.admin_view(dashboard_index), name="dashboard"),
        path("admin/dashboard/", admin.site.admin_view(dashboard_fragment), name="dashboard-fragment"),
    ]
