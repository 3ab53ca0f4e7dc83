"""Admin for schedules (kept in step with their beat PeriodicTask, read-only in beat's admin:
beat_admin.py) and MQTT trigger rules."""

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import OuterRef, Subquery
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from iotqueue.forms import JSON_FORMFIELD_OVERRIDES
from jobs.models import TemplateVersion
from jobs.permissions import user_may_start_runs

from . import beat_admin  # noqa: F401  (re-registers beat's PeriodicTask admin)
from .models import Schedule, ScheduledRun, TriggerRule
from .schedules import schedule_save
from .validation import parameters_errors, rule_errors, schedule_errors


class StartsRunsAdmin(admin.ModelAdmin):
    formfield_overrides = JSON_FORMFIELD_OVERRIDES
    """Adding or changing what starts runs needs the permission to start runs; without it
    the pages are read-only (with the view permission) and the enable action is hidden."""

    def has_add_permission(self, request) -> bool:
        return super().has_add_permission(request) and user_may_start_runs(request.user)

    def has_change_permission(self, request, obj=None) -> bool:
        return super().has_change_permission(request, obj) and user_may_start_runs(request.user)


class TemplateVersionPinForm(forms.ModelForm):
    """Offers the versions of the edited row's template only (all versions on an add page,
    where the template is not chosen yet); the model's clean refuses another template's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields.get("template_version")
        if field is None:
            return
        versions = TemplateVersion.objects.select_related("template")
        if self.instance.template_id:
            versions = versions.filter(template_id=self.instance.template_id)
        field.queryset = versions


class ScheduleForm(TemplateVersionPinForm):
    class Meta:
        model = Schedule
        fields = [
            "name",
            "template",
            "template_version",
            "parameters",
            "priority",
            "interval_seconds",
            "crontab",
            "timezone",
            "enabled",
            "overlap",
        ]

    def clean(self) -> dict:
        data = super().clean()
        data["crontab"] = " ".join((data.get("crontab") or "").split())
        errors = schedule_errors(
            interval_seconds=data.get("interval_seconds"),
            crontab=data["crontab"],
            timezone=data.get("timezone") or "",
        )
        if not isinstance(data.get("parameters", {}), dict):
            errors["parameters"] = _("parameters must be a JSON object")
        elif "parameters" not in self.errors:
            errors.update(
                parameters_errors(template=data.get("template"), parameters=data.get("parameters", {}))
            )
        if errors:
            raise ValidationError(errors)
        return data


@admin.register(Schedule)
class ScheduleAdmin(StartsRunsAdmin):
    form = ScheduleForm
    list_display = [
        "name",
        "template",
        "template_version",
        "when",
        "enabled",
        "overlap",
        "last_run_status",
        "last_run_at",
    ]
    list_filter = ["enabled", "overlap", "template"]
    list_select_related = ["template", "template_version__template"]
    search_fields = ["name", "template__name"]
    readonly_fields = ["fire_count", "last_fired_at", "queued_fire", "periodic_task"]
    actions = ["schedules_enable", "schedules_disable"]

    def get_queryset(self, request):
        newest = ScheduledRun.objects.filter(schedule=OuterRef("pk")).order_by("-id")
        return (
            super()
            .get_queryset(request)
            .annotate(
                last_run_status=Subquery(newest.values("run__status")[:1]),
                last_run_at=Subquery(newest.values("run__created_at")[:1]),
            )
        )

    @admin.display(description=gettext_lazy("last run"))
    def last_run_status(self, schedule: Schedule) -> str:
        return schedule.last_run_status or "-"

    @admin.display(description=gettext_lazy("last run started"))
    def last_run_at(self, schedule: Schedule):
        return schedule.last_run_at

    def save_model(self, request, obj: Schedule, form, change: bool) -> None:
        schedule_save(schedule=obj)

    def _enabled_set(self, request, queryset, enabled: bool) -> None:
        # One by one through the service, so each PeriodicTask follows (a queryset update would not).
        changed = 0
        for schedule in queryset.select_related("template", "periodic_task"):
            if schedule.enabled != enabled:
                schedule.enabled = enabled
                schedule_save(schedule=schedule)
                changed += 1
        if enabled:
            message = ngettext("%(count)d schedule enabled.", "%(count)d schedules enabled.", changed)
        else:
            message = ngettext("%(count)d schedule disabled.", "%(count)d schedules disabled.", changed)
        self.message_user(request, message % {"count": changed}, messages.SUCCESS)

    @admin.action(description=gettext_lazy("Enable selected schedules"), permissions=["change"])
    def schedules_enable(self, request, queryset):
        self._enabled_set(request, queryset, True)

    @admin.action(
        description=gettext_lazy("Disable selected schedules (future fires stop)"), permissions=["change"]
    )
    def schedules_disable(self, request, queryset):
        self._enabled_set(request, queryset, False)


class TriggerRuleForm(TemplateVersionPinForm):
    class Meta:
        model = TriggerRule
        fields = [
            "name",
            "topic_filter",
            "template",
            "template_version",
            "parameters",
            "idempotency_key",
            "priority",
            "enabled",
            "max_runs_per_minute",
            "max_active_runs",
        ]

    def clean(self) -> dict:
        data = super().clean()
        errors = rule_errors(
            topic_filter=data.get("topic_filter") or "",
            parameters=data.get("parameters", {}),
            idempotency_key=data.get("idempotency_key") or "",
        )
        if not errors and "parameters" not in self.errors:
            errors.update(
                parameters_errors(template=data.get("template"), parameters=data.get("parameters", {}))
            )
        if errors:
            raise ValidationError(errors)
        return data


@admin.register(TriggerRule)
class TriggerRuleAdmin(StartsRunsAdmin):
    form = TriggerRuleForm
    list_display = [
        "name",
        "topic_filter",
        "template",
        "template_version",
        "enabled",
        "priority",
        "updated_at",
    ]
    list_filter = ["enabled", "template"]
    list_select_related = ["template", "template_version__template"]
    search_fields = ["name", "topic_filter"]
