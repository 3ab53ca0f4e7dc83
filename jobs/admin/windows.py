"""Maintenance windows (time windows): where they are defined, with when each opens next."""

from __future__ import annotations

from django.contrib import admin
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from ..models import MaintenanceWindow
from ..timewindows import WindowSpec, window_next_start, window_open


def _spec(window: MaintenanceWindow) -> WindowSpec:
    return WindowSpec(window.name, window.cron, window.duration_minutes, window.timezone)


@admin.register(MaintenanceWindow)
class MaintenanceWindowAdmin(admin.ModelAdmin):
    list_display = ["name", "applies_to_display", "cron", "duration_minutes", "timezone", "state"]
    list_select_related = ["template", "group"]
    search_fields = ["name", "label_key", "label_value"]
    autocomplete_fields = ["template", "group"]
    fieldsets = [
        (None, {"fields": ["name", ("cron", "duration_minutes", "timezone")]}),
        (
            gettext_lazy("Applies to (exactly one)"),
            {
                "fields": ["template", "group", ("label_key", "label_value")],
                "description": gettext_lazy(
                    "A command for a device outside every window that applies to it waits for the "
                    "next opening; a run keeps the windows that exist when it is created."
                ),
            },
        ),
    ]

    @admin.display(description=gettext_lazy("applies to"))
    def applies_to_display(self, window: MaintenanceWindow) -> str:
        return window.applies_to

    @admin.display(description=gettext_lazy("now"))
    def state(self, window: MaintenanceWindow) -> str:
        now = timezone.now()
        closes = window_open(_spec(window), now)
        if closes is not None:
            return _("open until %(time)s") % {
                "time": date_format(timezone.localtime(closes), "DATETIME_FORMAT")
            }
        opens = window_next_start(_spec(window), now)
        if opens is None:
            return _("never opens again")
        return _("closed, opens at %(time)s") % {
            "time": date_format(timezone.localtime(opens), "DATETIME_FORMAT")
        }
