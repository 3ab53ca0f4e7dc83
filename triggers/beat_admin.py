"""django-celery-beat's PeriodicTask admin, with the tasks a Schedule owns read-only.

`triggers.schedules.schedule_save` rewrites a schedule's PeriodicTask on every save, so an
edit made on the task itself would be silently overwritten: such a task's page is read-only,
says which schedule owns it (with a link), and it can be neither deleted nor switched on or
off from beat's list; tasks nobody owns stay as beat's admin made them.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext
from django_celery_beat.admin import PeriodicTaskAdmin
from django_celery_beat.models import PeriodicTask

from .models import Schedule

OWNER_FIELD = "owning_schedule"


def schedule_owning(task: PeriodicTask | None) -> Schedule | None:
    """The schedule whose PeriodicTask `task` is, or None (looked up once per task object)."""
    if task is None or task.pk is None:
        return None
    if not hasattr(task, "_owning_schedule"):
        task._owning_schedule = Schedule.objects.filter(periodic_task_id=task.pk).first()
    return task._owning_schedule


def tasks_unowned(queryset: QuerySet[PeriodicTask]) -> QuerySet[PeriodicTask]:
    owned = Schedule.objects.filter(periodic_task__isnull=False).values("periodic_task")
    return queryset.exclude(pk__in=owned)


class ScheduleOwnedPeriodicTaskAdmin(PeriodicTaskAdmin):
    """Beat's admin; a task a Schedule owns is shown read-only, with a link to the schedule."""

    @admin.display(description=gettext_lazy("owned by schedule"))
    def owning_schedule(self, task: PeriodicTask):
        schedule = schedule_owning(task)
        if schedule is None:
            return "-"
        url = reverse("admin:triggers_schedule_change", args=[schedule.pk])
        return format_html(
            '<a href="{}">{}</a> — {}',
            url,
            schedule.name,
            _("kept in step with this schedule: change the schedule instead"),
        )

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if schedule_owning(obj) is None:
            return fieldsets
        return [(None, {"fields": (OWNER_FIELD,)}), *fieldsets]

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        if schedule_owning(obj) is None:
            return fields
        return (OWNER_FIELD, *fields)

    def has_change_permission(self, request, obj=None) -> bool:
        return super().has_change_permission(request, obj) and schedule_owning(obj) is None

    def has_delete_permission(self, request, obj=None) -> bool:
        return super().has_delete_permission(request, obj) and schedule_owning(obj) is None

    def _owned_left_out(self, request, queryset: QuerySet[PeriodicTask]) -> QuerySet[PeriodicTask]:
        unowned = tasks_unowned(queryset)
        skipped = queryset.count() - unowned.count()
        if skipped:
            message = ngettext(
                "%(count)d task owned by a schedule was left as it is: change the schedule instead.",
                "%(count)d tasks owned by schedules were left as they are: change the schedules instead.",
                skipped,
            )
            self.message_user(request, message % {"count": skipped}, messages.WARNING)
        return unowned

    # Beat's bulk actions, minus the tasks schedules own (same names and descriptions).
    @admin.action(description=PeriodicTaskAdmin.enable_tasks.short_description)
    def enable_tasks(self, request, queryset):
        super().enable_tasks(request, self._owned_left_out(request, queryset))

    @admin.action(description=PeriodicTaskAdmin.disable_tasks.short_description)
    def disable_tasks(self, request, queryset):
        super().disable_tasks(request, self._owned_left_out(request, queryset))

    @admin.action(description=PeriodicTaskAdmin.toggle_tasks.short_description)
    def toggle_tasks(self, request, queryset):
        super().toggle_tasks(request, self._owned_left_out(request, queryset))

    def delete_queryset(self, request, queryset):
        super().delete_queryset(request, self._owned_left_out(request, queryset))


admin.site.unregister(PeriodicTask)
admin.site.register(PeriodicTask, ScheduleOwnedPeriodicTaskAdmin)
