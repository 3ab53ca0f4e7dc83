"""Runs: the list, cancel and retry, and the run page with its live timeline."""

from __future__ import annotations

import uuid

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from ..cancel import run_cancel
from ..models import JobRun, Trigger
from ..retry import RETRYABLE, RetryError, run_retry
from ..timeline import duration_format, run_timeline
from .display import json_block, run_url, status_badge
from .paging import EstimatedCountPaginator

# How often an open run page fetches its timeline while the run is active: live enough to
# watch a rollout, and one small request (a fixed handful of queries) per open page.
RUN_REFRESH_MS = 2000


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    list_display = [
        "short_id",
        "template",
        "status_badge",
        "cursor",
        "priority",
        "trigger",
        "triggered_by",
        "created_at",
        "took",
    ]
    list_display_links = ["short_id"]
    # Fixed date choices (today, past 7 days, ...) rather than a date hierarchy: its year /
    # month / day links take a SELECT DISTINCT over every run on each page view.
    list_filter = ["status", "trigger", "template", ("created_at", admin.DateFieldListFilter)]
    list_select_related = ["template"]
    search_fields = ["id", "idempotency_key__exact", "triggered_by__exact"]  # see get_search_results
    search_help_text = "A run id or its first characters, an idempotency key, or who started it (exact)."
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
                    ("created_at", "started_at", "finished_at"),
                    "error",
                    ("retry_of_link", "idempotency_key"),
                ]
            },
        ),
        ("Parameters", {"fields": ["parameters_json"]}),
        (
            "Plan: the template's steps when the run started",
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
        "created_at",
        "started_at",
        "finished_at",
        "error",
        "retry_of_link",
        "idempotency_key",
        "parameters_json",
        "plan_json",
    ]
    actions = ["cancel_runs", "retry_runs"]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    @admin.display(description="run", ordering="created_at")
    def short_id(self, run: JobRun) -> str:
        return str(run.pk)[:8]

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: JobRun) -> str:
        return status_badge(run.status)

    @admin.display(description="took")
    def took(self, run: JobRun) -> str:
        if run.started_at is None:
            return ""
        if run.finished_at is None:
            return "…"
        return duration_format(run.finished_at - run.started_at)

    @admin.display(description="template")
    def template_link(self, run: JobRun) -> str:
        url = reverse("admin:jobs_jobtemplate_change", args=[run.template_id])
        return format_html('<a href="{}">{}</a>', url, run.template.name)

    @admin.display(description="retry of")
    def retry_of_link(self, run: JobRun) -> str:
        if run.retry_of_id is None:
            return "-"
        return format_html('<a href="{}">{}</a>', run_url(run.retry_of_id), run.retry_of_id)

    @admin.display(description="parameters")
    def parameters_json(self, run: JobRun) -> str:
        return json_block(run.parameters)

    @admin.display(description="plan")
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

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request, queryset):
        runs = list(queryset.select_related("template"))
        canceled = sum(run_cancel(run=run, by=request.user.username) for run in runs)
        self.message_user(request, f"{canceled} run(s) canceled.", messages.SUCCESS)
        if len(runs) == 1:
            return HttpResponseRedirect(run_url(runs[0].pk))
        return None

    @admin.action(description="Retry selected runs from their failed step", permissions=["retry"])
    def retry_runs(self, request, queryset):
        retries = []
        for run in queryset.select_related("template"):
            try:
                retries.append(run_retry(run=run, by=request.user.username, trigger=Trigger.ADMIN))
            except RetryError as exc:
                self.message_user(request, f"Run {str(run.pk)[:8]} not retried: {exc}", messages.ERROR)
        if retries:
            links = format_html_join(", ", '<a href="{}">{}</a>', ((run_url(r.pk), r.pk) for r in retries))
            self.message_user(request, format_html("Retry started: {}.", links), messages.SUCCESS)
        if len(retries) == 1:
            return HttpResponseRedirect(run_url(retries[0].pk))
        return None

    def get_urls(self):
        timeline = self.admin_site.admin_view(self.timeline_view)
        return [
            path("<path:object_id>/timeline/", timeline, name="jobs_jobrun_timeline"),
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
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def timeline_view(self, request, object_id):
        """The run page's timeline alone: what its live refresh fetches while the run is active."""
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"no run with id {object_id!r}")
        if not self.has_view_or_change_permission(request, run):
            raise PermissionDenied
        return TemplateResponse(
            request, "admin/jobs/jobrun/timeline.html", self._timeline_context(request, run)
        )

    def _timeline_context(self, request, run: JobRun) -> dict:
        return {
            "timeline": run_timeline(run),
            "timeline_url": reverse("admin:jobs_jobrun_timeline", args=[run.pk]),
            "refresh_ms": RUN_REFRESH_MS,
        }


def run_id_range(prefix: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The lowest and highest run id starting with `prefix` (hex digits, dashes ignored), or
    None when it cannot begin a UUID."""
    digits = prefix.replace("-", "").lower()
    if not digits or len(digits) > 32 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))
