"""Step runs and run events: the engine's records, read-only, and the million-row tables."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Q
from django.utils.html import format_html

from ..models import RunEvent, StepRun
from ..timeline import ATTENTION_KINDS, FAILURE_SUFFIXES
from .display import run_url, status_badge


class ReadOnlyAdmin(admin.ModelAdmin):
    """The engine's own records: viewing only, edits would break its bookkeeping."""

    show_full_result_count = False  # no second, unfiltered COUNT(*) on every filtered page
    ordering = ["-id"]  # newest first, along the primary key

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(StepRun)
class StepRunAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_link",
        "index",
        "phase",
        "device",
        "action",
        "status_badge",
        "attempt",
        "dispatched_at",
        "finished_at",
    ]
    list_filter = ["status", "phase"]
    list_select_related = ["run__template", "device"]
    search_fields = ["command_id__exact", "device__name__exact"]
    raw_id_fields = ["run", "device"]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    @admin.display(description="run")
    def run_link(self, step_run: StepRun) -> str:
        return format_html('<a href="{}">{}</a>', run_url(step_run.run_id), step_run.run)

    @admin.display(description="status", ordering="status")
    def status_badge(self, step_run: StepRun) -> str:
        return status_badge(step_run.status)


class EventToneFilter(admin.SimpleListFilter):
    """Fixed choices: a filter on `kind` itself would scan millions of rows for its values."""

    title = "kind"
    parameter_name = "tone"
    FAMILIES = ("run.", "step.", "reply.", "message.", "lock.")

    def lookups(self, request, model_admin):
        return [
            ("attention", "stale / dropped / offline / interventions"),
            ("failure", "failures and timeouts"),
            *((family, f"{family}*") for family in self.FAMILIES),
        ]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "attention":
            return queryset.filter(kind__in=ATTENTION_KINDS)
        if value == "failure":
            failed = Q()
            for suffix in FAILURE_SUFFIXES:
                failed |= Q(kind__endswith=suffix)
            return queryset.filter(failed)
        if value in self.FAMILIES:
            return queryset.filter(kind__startswith=value)
        return queryset


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "kind", "run_link", "device", "message"]
    list_filter = [EventToneFilter]
    list_select_related = ["run__template"]
    search_fields = ["device__exact", "kind__exact"]
    raw_id_fields = ["run", "step_run"]

    @admin.display(description="run")
    def run_link(self, event: RunEvent) -> str:
        if event.run_id is None:
            return "-"
        return format_html('<a href="{}">{}</a>', run_url(event.run_id), event.run)
