"""Shared concurrency limits: the list, and on a limit's page its slots in use now."""

from django.contrib import admin
from django.utils.html import format_html_join
from django.utils.translation import gettext_lazy as _

from devices.lock_slots import slot_counts

from ..models import ConcurrencyLimit


@admin.register(ConcurrencyLimit)
class ConcurrencyLimitAdmin(admin.ModelAdmin):
    list_display = ["name", "label", "max_concurrent", "applies_to", "match", "enabled", "updated_at"]
    list_filter = ["enabled", "applies_to"]
    search_fields = ["name", "match"]
    readonly_fields = ["in_flight", "created_at", "updated_at"]
    fields = ["name", "label", "max_concurrent", "applies_to", "match", "enabled", "in_flight"]

    @admin.display(description=_("in flight now"))
    def in_flight(self, obj: ConcurrencyLimit) -> str:
        """Per label value with commands in flight or waiting: held of the limit, waiting."""
        if obj.pk is None:
            return "-"
        counts = slot_counts(obj.name)
        if not counts:
            return _("none")
        rows = (
            (value, held, obj.max_concurrent, waiting) for value, (held, waiting) in sorted(counts.items())
        )
        text = _("%(label)s=%(value)s: %(held)s of %(most)s in flight, %(waiting)s waiting")
        return format_html_join(
            "",
            "<div>{}</div>",
            (
                (text % {"label": obj.label, "value": v, "held": h, "most": m, "waiting": w},)
                for v, h, m, w in rows
            ),
        )
