"""Runs: the list, cancel, retry and closing a continuous fan-out, and the run page with its
live timeline."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext
from redis import RedisError

from iotqueue.moments import moment_html

from ..cancel import run_cancel
from ..engine.continuous import fanout_close
from ..engine.plan import spec_is_fanout
from ..models import STEP_TERMINAL, JobRun, Phase, RunStatus, StepRun, Trigger
from ..retry import RETRYABLE, RetryError, run_retry
from ..services import plan_step_target
from ..timeline import duration_format, run_timeline
from ..timeview import clock_ms
from ..waiting import Waiting, runs_waiting
from .display import json_block, run_url, status_badge, waiting_html
from .paging import EstimatedCountPaginator
from .rollouts import rollout_action_view, rollouts_view

log = logging.getLogger(__name__)

# How often an open run page fetches its timeline while the run is active: live enough to
# watch a rollout, and one small request (a fixed handful of queries) per open page.
RUN_REFRESH_MS = 2000
# Runs whose steps are all done: the progress bar is full.
RUN_DONE = (RunStatus.SUCCEEDED, RunStatus.COMPENSATED)


@dataclass(frozen=True)
class FanoutProgress:
    """A run's current fan-out step: its rows, and how many of them ended."""

    done: int
    total: int


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    # Six columns fit a 1280-px window beside the admin's navigation and the filters (widths in
    # static/jobs/admin.css): the template under the run, the progress under the step, the age
    # under the time; trigger, starter and priority are on the run page (and filters).
    list_display = ["short_id", "status_badge", "step", "waiting", "created", "took"]
    list_display_links = ["short_id"]
    # Fixed date choices (today, past 7 days, ...) rather than a date hierarchy: its year /
    # month / day links take a SELECT DISTINCT over every run on each page view.
    list_filter = ["status", "trigger", "template", ("created_at", admin.DateFieldListFilter)]
    list_select_related = ["template"]
    search_fields = ["id", "idempotency_key__exact", "triggered_by__exact"]  # see get_search_results
    search_help_text = gettext_lazy(
        "A run id or its first characters, an idempotency key, or who started it (exact)."
    )
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    change_form_template = "admin/jobs/jobrun/change_form.html"
    fieldsets = [
        (
            None,
            {
                "fields": [
                    ("template_link", "status_badge", "cursor"),
                    ("trigger", "triggered_by", "priority"),
                    ("created_ms", "started_ms", "finished_ms"),
                    "error",
                    ("retry_of_link", "idempotency_key"),
                ]
            },
        ),
        (gettext_lazy("Parameters"), {"fields": ["parameters_json"]}),
        (
            gettext_lazy("Time windows"),
            {"classes": ["collapse"], "fields": [("not_before", "end_by", "end_behaviour"), "windows_list"]},
        ),
        (
            gettext_lazy("Plan: the template's steps when the run started"),
            {"classes": ["collapse"], "fields": ["plan_json"]},
        ),
    ]
    readonly_fields = [
        "template_link",
        "status_badge",
        "cursor",
        "trigger",
        "triggered_by",
        "priority",
        "created_ms",
        "started_ms",
        "finished_ms",
        "error",
        "retry_of_link",
        "idempotency_key",
        "parameters_json",
        "plan_json",
        "not_before",
        "end_by",
        "end_behaviour",
        "windows_list",
    ]
    actions = ["cancel_runs", "retry_runs", "close_fanouts"]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    @admin.display(description=gettext_lazy("maintenance windows"))
    def windows_list(self, run: JobRun) -> str:
        """The maintenance windows the run kept when it was created (time windows)."""
        return (
            ", ".join(f"{w['name']} ({w['cron']}, {w['minutes']} min, {w['tz']})" for w in run.windows) or "-"
        )

    def get_changelist_instance(self, request):
        """The page's reasons and fan-out progress, read for all its runs at once (a fixed
        number of queries and one Redis round trip), kept on its rows for the columns."""
        changelist = super().get_changelist_instance(request)
        runs = list(changelist.result_list)  # evaluates the page once; the template reuses it
        now = timezone.now()
        waiting, known = self.waiting_read(runs, now)
        progress = runs_fanout_progress(runs)
        for run in runs:
            run.list_now = now
            run.list_waiting = waiting.get(run.pk)
            run.list_waiting_known = known
            run.list_fanout = progress.get(run.pk)
        return changelist

    def waiting_read(self, runs: list[JobRun], now) -> tuple[dict[uuid.UUID, Waiting], bool]:
        """Why each active run waits; none, and False (the column says so), when the lock
        Redis cannot be reached."""
        try:
            return runs_waiting(runs, now=now), True
        except RedisError as exc:
            log.warning("run list without waiting reasons: %s", exc)
            return {}, False

    @admin.display(description=gettext_lazy("run"), ordering="created_at")
    def short_id(self, run: JobRun) -> str:
        """The run's first characters (the search takes them) over its template's name."""
        return format_html('{}<br><span class="iq-quiet">{}</span>', str(run.pk)[:8], run.template.name)

    @admin.display(description=gettext_lazy("status"), ordering="status")
    def status_badge(self, run: JobRun) -> str:
        return status_badge(run.status)

    @admin.display(description=gettext_lazy("step"))
    def step(self, run: JobRun) -> str:
        """The current step (its place among the run's steps and its name) over a progress
        bar: steps done of all, and within a fan-out step its devices done of all."""
        steps = len(run.plan)
        if not steps:
            return "-"
        index = min(run.cursor, steps - 1)
        spec = run.plan[index]
        label = spec.get("name") or spec.get("action") or spec.get("kind", "")
        done = steps if run.status in RUN_DONE else min(run.cursor, steps)
        fanout = getattr(run, "list_fanout", None)
        if fanout and fanout.total and run.status not in RUN_DONE:
            done += fanout.done / fanout.total
            detail = _("%(done)s/%(total)s devices") % {
                "done": f"{fanout.done:,}",
                "total": f"{fanout.total:,}",
            }
        else:
            detail = plan_step_target(spec)
        percent = round(100 * min(done, steps) / steps)
        return format_html(
            '<span class="iq-num">{}/{}</span> {}<br>'
            '<span class="iq-bar" title="{}%"><span style="width: {}%"></span></span>'
            '<span class="iq-quiet">{}</span>',
            index + 1,
            steps,
            label,
            percent,
            percent,
            detail,
        )

    @admin.display(description=gettext_lazy("waiting for"))
    def waiting(self, run: JobRun) -> str:
        if run.is_terminal or not hasattr(run, "list_waiting"):
            return ""
        if run.list_waiting is None:
            if run.list_waiting_known:
                return ""
            return format_html('<span class="iq-quiet">{}</span>', _("unknown (Redis unreachable)"))
        return waiting_html(run.list_waiting)

    @admin.display(description=gettext_lazy("created"), ordering="created_at")
    def created(self, run: JobRun) -> str:
        """When, to the second, over how long ago."""
        now = getattr(run, "list_now", None) or timezone.now()
        age = _("%(age)s ago") % {"age": duration_format(now - run.created_at)}
        return format_html(
            '{}<br><span class="iq-quiet">{}</span>', moment_html(run.created_at, now=now), age
        )

    @admin.display(description=gettext_lazy("took"))
    def took(self, run: JobRun) -> str:
        """Start to end; a run still going shows how long so far."""
        if run.started_at is None:
            return ""
        if run.finished_at is None:
            now = getattr(run, "list_now", None) or timezone.now()
            return format_html(
                '<span class="iq-open" title="{}">{}…</span>',
                _("still going"),
                duration_format(now - run.started_at),
            )
        return duration_format(run.finished_at - run.started_at)

    @admin.display(description=gettext_lazy("template"))
    def template_link(self, run: JobRun) -> str:
        url = reverse("admin:jobs_jobtemplate_change", args=[run.template_id])
        return format_html('<a href="{}">{}</a>', url, run.template.name)

    @admin.display(description=gettext_lazy("created at"))
    def created_ms(self, run: JobRun) -> str:
        return moment_ms(run.created_at)

    @admin.display(description=gettext_lazy("started at"))
    def started_ms(self, run: JobRun) -> str:
        return moment_ms(run.started_at)

    @admin.display(description=gettext_lazy("finished at"))
    def finished_ms(self, run: JobRun) -> str:
        return moment_ms(run.finished_at)

    @admin.display(description=gettext_lazy("retry of"))
    def retry_of_link(self, run: JobRun) -> str:
        if run.retry_of_id is None:
            return "-"
        return format_html('<a href="{}">{}</a>', run_url(run.retry_of_id), run.retry_of_id)

    @admin.display(description=gettext_lazy("parameters"))
    def parameters_json(self, run: JobRun) -> str:
        return json_block(run.parameters)

    @admin.display(description=gettext_lazy("plan"))
    def plan_json(self, run: JobRun) -> str:
        return json_block(run.plan)

    def get_search_results(self, request, queryset, search_term):
        """Runs whose id starts with the term (the list shows 8 characters), or with that
        idempotency key or starter. The id prefix is a range of the primary key: matching it
        as text (Django's default, `id::text LIKE '%x%'`) reads every run."""
        term = search_term.strip()
        if not term:
            return queryset, False
        found = Q(idempotency_key=term) | Q(triggered_by=term)
        ids = run_id_range(term)
        if ids is not None:
            found |= Q(id__range=ids)
        return queryset.filter(found), False

    def has_add_permission(self, request) -> bool:
        return False  # runs are started from a template (Run now), never typed in

    def has_delete_permission(self, request, obj=None) -> bool:
        # Deleting an active run would leave its devices' locks and queues behind: cancel it.
        if obj is not None and not obj.is_terminal:
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # it would delete active runs too; retention prunes
        return actions

    def has_retry_permission(self, request) -> bool:
        """A retry starts a new run: the same permission as Run now and REST."""
        return request.user.has_perm("jobs.add_jobrun")

    @admin.action(description=gettext_lazy("Cancel selected runs"), permissions=["change"])
    def cancel_runs(self, request, queryset):
        runs = list(queryset.select_related("template"))
        canceled = sum(run_cancel(run=run, by=request.user.username) for run in runs)
        done = ngettext("%(count)s run canceled.", "%(count)s runs canceled.", canceled) % {"count": canceled}
        self.message_user(request, done, messages.SUCCESS)
        if len(runs) == 1:
            return HttpResponseRedirect(run_url(runs[0].pk))
        return None

    @admin.action(
        description=gettext_lazy("Retry selected runs from their failed step"), permissions=["retry"]
    )
    def retry_runs(self, request, queryset):
        retries = []
        for run in queryset.select_related("template"):
            try:
                retries.append(run_retry(run=run, by=request.user.username, trigger=Trigger.ADMIN))
            except RetryError as exc:
                refused = _("Run %(run)s not retried: %(reason)s") % {"run": str(run.pk)[:8], "reason": exc}
                self.message_user(request, refused, messages.ERROR)
        if retries:
            links = format_html_join(", ", '<a href="{}">{}</a>', ((run_url(r.pk), r.pk) for r in retries))
            started = format_html(_("Retry started: {links}."), links=links)
            self.message_user(request, started, messages.SUCCESS)
        if len(retries) == 1:
            return HttpResponseRedirect(run_url(retries[0].pk))
        return None

    @admin.action(description=gettext_lazy("Close open continuous fan-outs"), permissions=["change"])
    def close_fanouts(self, request, queryset):
        runs = list(queryset)
        closed = sum(fanout_close(run=run, by=request.user.username) is not None for run in runs)
        done = ngettext(
            "%(count)s continuous fan-out closed.", "%(count)s continuous fan-outs closed.", closed
        ) % {"count": closed}
        self.message_user(request, done, messages.SUCCESS if closed else messages.WARNING)
        if len(runs) == 1:
            return HttpResponseRedirect(run_url(runs[0].pk))
        return None

    def get_urls(self):
        timeline = self.admin_site.admin_view(self.timeline_view)
        rollout = self.admin_site.admin_view(self.rollout_view)
        return [
            path("<path:object_id>/timeline/", timeline, name="jobs_jobrun_timeline"),
            path("<path:object_id>/rollout/<slug:verb>/", rollout, name="jobs_jobrun_rollout"),
            *super().get_urls(),
        ]

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None:
            context.update(self._timeline_context(request, obj))
            context.update(
                show_save=False,
                show_save_and_continue=False,
                can_cancel=not obj.is_terminal and self.has_change_permission(request, obj),
                can_retry=obj.status in RETRYABLE and self.has_retry_permission(request),
                open_fanouts=(
                    list(obj.continuous_fanouts.filter(closed_at=None).order_by("index"))
                    if obj.status == RunStatus.RUNNING
                    else []
                ),
                can_close_fanout=self.has_change_permission(request, obj),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def timeline_view(self, request, object_id):
        """The run page's timeline alone: what its live refresh fetches while the run is active."""
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(_("No run with id %(id)r") % {"id": object_id})
        if not self.has_view_or_change_permission(request, run):
            raise PermissionDenied
        return TemplateResponse(
            request, "admin/jobs/jobrun/timeline.html", self._timeline_context(request, run)
        )

    def rollout_view(self, request, object_id, verb):
        """A gate button of the run page or the dashboard: pause, resume, approve, abort."""
        return rollout_action_view(self, request, object_id, verb)

    def _timeline_context(self, request, run: JobRun) -> dict:
        return {
            "rollouts": rollouts_view(run),
            "can_steer": self.has_change_permission(request, run),
            "inside_form": True,  # the run page's change form holds the timeline
            "timeline": run_timeline(run),
            "timeline_url": reverse("admin:jobs_jobrun_timeline", args=[run.pk]),
            "refresh_ms": RUN_REFRESH_MS,
        }


def moment_ms(when) -> str:
    """A run's times on its page: date and time to the millisecond, like its timeline."""
    return f"{timezone.localtime(when):%Y-%m-%d} {clock_ms(when)}" if when else "-"


def runs_fanout_progress(runs: list[JobRun]) -> dict[uuid.UUID, FanoutProgress]:
    """For the runs at a fan-out step, its rows and how many ended: one grouped query over
    those steps' rows only (the step run index by run, phase and index), never a count of
    the table."""
    current = Q()
    for run in runs:
        if not run.is_terminal and run.cursor < len(run.plan) and spec_is_fanout(run.plan[run.cursor]):
            current |= Q(run_id=run.pk, index=run.cursor)
    if not current:
        return {}
    counted = (
        StepRun.objects.filter(current, phase=Phase.FORWARD)
        .order_by()
        .values("run_id")
        .annotate(total=Count("pk"), done=Count("pk", filter=Q(status__in=STEP_TERMINAL)))
    )
    return {item["run_id"]: FanoutProgress(item["done"], item["total"]) for item in counted}


def run_id_range(prefix: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The lowest and highest run id starting with `prefix` (hex digits, dashes ignored), or
    None when it cannot begin a UUID."""
    digits = prefix.replace("-", "").lower()
    if not digits or len(digits) > 32 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))
