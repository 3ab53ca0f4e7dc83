"""Admin: templates with inline ordered steps, runs with their steps and timeline."""

from django.contrib import admin, messages

from devices.admin import DeviceAdmin
from devices.models import Device

from .cancel import lock_force_release, run_cancel
from .models import JobRun, JobStep, JobTemplate, RunEvent, StepRun


class JobStepInline(admin.TabularInline):
    model = JobStep
    extra = 1
    ordering = ["position"]
    autocomplete_fields = ["device"]
    fields = ["position", "name", "device", "action", "args", "timeout_seconds", "max_attempts", "on_failure"]


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
    fields = ["index", "device", "action", "status", "attempt", "fence", "progress", "error", "finished_at"]
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
