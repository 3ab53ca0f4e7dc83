"""Admin: templates with inline ordered steps, runs with their steps and timeline."""

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.forms.models import BaseInlineFormSet

from devices.admin import DeviceAdmin
from devices.models import Device

from .cancel import lock_force_release, run_cancel
from .models import JobRun, JobStep, JobTemplate, RunEvent, StepRun
from .validation import template_errors


class JobStepFormSet(BaseInlineFormSet):
    """Checks across steps (references to earlier steps, unique names) on save."""

    def clean(self) -> None:
        super().clean()
        steps = [
            form.instance
            for form in self.forms
            if getattr(form, "cleaned_data", None) and not form.cleaned_data.get("DELETE")
        ]
        errors = template_errors(steps)
        if errors:
            raise ValidationError(
                [
                    f"{label}, {field}: {message}"
                    for label, fields in errors.items()
                    for field, message in fields.items()
                ]
            )


class JobStepInline(admin.StackedInline):
    model = JobStep
    formset = JobStepFormSet
    extra = 0
    ordering = ["position"]
    autocomplete_fields = ["device", "group"]
    fieldsets = [
        (None, {"fields": [("position", "name", "kind"), ("action", "args")]}),
        ("Target (exactly one)", {"fields": [("device", "device_param"), ("group", "labels")]}),
        (
            "Timing and failure",
            {
                "fields": [
                    ("timeout_seconds", "ack_timeout_seconds", "queue_timeout_seconds", "delay_seconds"),
                    ("max_attempts", "backoff_seconds", "on_failure"),
                    ("compensation_action", "compensation_args"),
                ]
            },
        ),
        (
            "Fan-out",
            {
                "classes": ["collapse"],
                "fields": [
                    ("rollout_per_minute", "max_in_flight"),
                    ("abort_failure_percent", "abort_min_devices", "success_percent"),
                ],
            },
        ),
    ]


@admin.register(JobTemplate)
class JobTemplateAdmin(admin.ModelAdmin):
    list_display = ["name", "default_priority", "updated_at"]
    search_fields = ["name", "description"]
    inlines = [JobStepInline]


class StepRunInline(admin.TabularInline):
    model = StepRun
    extra = 0
    can_delete = False
    ordering = ["index"]
    fields = [
        "index",
        "phase",
        "device",
        "action",
        "status",
        "attempt",
        "fence",
        "progress",
        "result",
        "error",
        "finished_at",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class RunEventInline(admin.TabularInline):
    model = RunEvent
    fk_name = "run"
    extra = 0
    can_delete = False
    fields = ["created_at", "kind", "device", "message", "data"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    list_display = ["id", "template", "status", "cursor", "priority", "trigger", "created_at", "finished_at"]
    list_filter = ["status", "trigger", "template"]
    list_select_related = ["template"]
    search_fields = ["id", "idempotency_key"]
    date_hierarchy = "created_at"
    readonly_fields = [
        "id",
        "template",
        "parameters",
        "plan",
        "status",
        "cursor",
        "trigger",
        "triggered_by",
        "priority",
        "idempotency_key",
        "error",
        "created_at",
        "started_at",
        "finished_at",
    ]
    inlines = [StepRunInline, RunEventInline]
    actions = ["cancel_runs"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request, queryset):
        canceled = sum(run_cancel(run=run, by=request.user.username) for run in queryset)
        self.message_user(request, f"{canceled} run(s) canceled.", messages.SUCCESS)


@admin.register(StepRun)
class StepRunAdmin(admin.ModelAdmin):
    list_display = ["run", "index", "device", "action", "status", "attempt", "dispatched_at", "finished_at"]
    list_filter = ["status"]
    list_select_related = ["run__template", "device"]
    search_fields = ["command_id", "device__name"]
    raw_id_fields = ["run", "device"]


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "kind", "run", "device", "message"]
    list_filter = ["kind"]
    list_select_related = ["run__template"]
    search_fields = ["device", "message"]
    raw_id_fields = ["run", "step_run"]


# The force-release action ends the holder's attempt, which is engine (jobs) business; the
# devices app must not import jobs, so jobs extends the device admin here.
admin.site.unregister(Device)


@admin.register(Device)
class DeviceWithLockAdmin(DeviceAdmin):
    actions = ["force_release_lock"]

    @admin.action(description="Force-release the device lock (audited)", permissions=["change"])
    def force_release_lock(self, request, queryset):
        for device in queryset:
            holder = lock_force_release(device=device, by=request.user.username)
            if holder:
                self.message_user(request, f"{device.name}: lock taken from {holder}.", messages.WARNING)
            else:
                self.message_user(request, f"{device.name}: lock was free.", messages.INFO)
