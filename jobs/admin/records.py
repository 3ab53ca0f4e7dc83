"""Step runs and run events: the engine's records, read-only, and the million-row tables."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Q
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from devices.models import Device
from iotqueue.moments import moment_html

from ..models import JobRun, Phase, RunEvent, StepRun
from ..timeline import ATTENTION_KINDS
from ..waiting import OFFLINE_WAIT_EVENTS
from .display import run_url, status_badge, status_label
from .paging import EstimatedCountPaginator

# The kinds the run page colours as failures (timeline.FAILURE_SUFFIXES: ".failed",
# ".rejected", ".timed_out"), as the engine records them: `run.<status>` and `step.<status>`, and the
# scheduler's. Listed rather than matched by suffix: `kind IN (...)` reads the kind index,
# `kind LIKE '%.failed'` reads every event (600 ms with 3 million).
FAILURE_KINDS = (
    "run.failed",
    "run.timed_out",
    "step.failed",
    "step.rejected",
    "step.timed_out",
    "schedule.failed",
)


class ReadOnlyAdmin(admin.ModelAdmin):
    """The engine's own records: viewing only, edits would break its bookkeeping."""

    show_full_result_count = False  # no second, unfiltered COUNT(*) on every filtered page
    paginator = EstimatedCountPaginator  # nor a COUNT(*) of millions of rows on every page view
    ordering = ["-id"]  # newest first, along the primary key

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(StepRun)
class StepRunAdmin(ReadOnlyAdmin):
    # Narrow enough for a 1280-px window beside the navigation and the filter: the run's id
    # over its template, the device over the action, the attempt under the status, when it
    # was sent over when it ended (to the second).
    list_display = ["id", "run_link", "step", "target", "status_badge", "times"]
    # Status only: a filter on phase would read every row for the rare compensation rows
    # (no index has phase; the run page shows a run's compensations).
    list_filter = ["status"]
    list_select_related = ["run__template", "device"]
    search_fields = ["command_id__exact", "device__name__exact"]  # as get_search_results does it
    search_help_text = _("A command id or a device name (exact).")
    raw_id_fields = ["run", "device"]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    @admin.display(description=_("run"))
    def run_link(self, step_run: StepRun) -> str:
        return run_cell(step_run.run)

    @admin.display(description=_("step"))
    def step(self, step_run: StepRun) -> str:
        if step_run.phase == Phase.COMPENSATION:
            return format_html('#{} <span class="iq-quiet">{}</span>', step_run.index, _("compensation"))
        return f"#{step_run.index}"

    def get_search_results(self, request, queryset, search_term):
        """Rows with that command id or on the device of that name, each through its index.

        The device is looked up first: `command_id = x OR device.name = x` across the join
        would read every step run, `command_id = x OR device_id IN (ids)` reads two indexes.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        devices = list(Device.objects.filter(name=term).values_list("pk", flat=True))
        return queryset.filter(Q(command_id=term) | Q(device_id__in=devices)), False

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, step_run: StepRun) -> str:
        attempt = _("attempt %(attempt)s") % {"attempt": step_run.attempt}
        return format_html('{}<br><span class="iq-quiet">{}</span>', status_badge(step_run.status), attempt)

    @admin.display(description=_("device and action"))
    def target(self, step_run: StepRun) -> str:
        return format_html(
            '{}<br><span class="iq-quiet">{}</span>',
            step_run.device.name if step_run.device_id else "-",
            step_run.action,
        )

    # Times to the second (Django's list format reads "5:08 p.m."); sorted along the primary
    # key, the list's only index-backed order.
    @admin.display(description=_("sent / ended"), ordering="id")
    def times(self, step_run: StepRun) -> str:
        return format_html("{}<br>{}", moment_html(step_run.dispatched_at), moment_html(step_run.finished_at))


class EventToneFilter(admin.SimpleListFilter):
    """Fixed choices: a filter on `kind` itself would scan millions of rows for its values."""

    title = _("kind")
    parameter_name = "tone"
    FAMILIES = ("run.", "step.", "reply.", "message.", "lock.")

    def lookups(self, request, model_admin):
        return [
            ("attention", _("stale / dropped / offline / interventions")),
            ("failure", _("failures and timeouts")),
            *((family, f"{family}*") for family in self.FAMILIES),
        ]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "attention":
            return queryset.filter(Q(kind__in=ATTENTION_KINDS) | OFFLINE_WAIT_EVENTS)
        if value == "failure":
            return queryset.filter(kind__in=FAILURE_KINDS)
        if value in self.FAMILIES:
            return queryset.filter(kind__startswith=value)
        return queryset


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = ["id", "created", "kind", "run_link", "device", "message"]
    list_filter = [EventToneFilter]
    list_select_related = ["run__template"]
    search_fields = ["device__exact", "kind__exact"]  # both indexed: runevent_device_id, kind
    search_help_text = _("A device name or an event kind (exact), e.g. pump-0042 or reply.stale.")
    raw_id_fields = ["run", "step_run"]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    @admin.display(description=_("created at"), ordering="id")
    def created(self, event: RunEvent) -> str:
        return moment_html(event.created_at)

    @admin.display(description=_("run"))
    def run_link(self, event: RunEvent) -> str:
        if event.run_id is None:
            return "-"
        return run_cell(event.run)


def run_cell(run: JobRun) -> str:
    """A run in a list: its first characters (linked) over its template and status."""
    return format_html(
        '<a href="{}">{}</a><br><span class="iq-quiet">{} ({})</span>',
        run_url(run.pk),
        str(run.pk)[:8],
        run.template.name,
        status_label(run.status),
    )
