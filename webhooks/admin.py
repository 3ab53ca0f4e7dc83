"""Admin for webhooks and their delivery log (read-only: status code, latency, attempts)."""

from django import forms
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from .models import Delivery, EventKind, Webhook


class WebhookForm(forms.ModelForm):
    url = forms.URLField(max_length=2000, assume_scheme="https")
    events = forms.MultipleChoiceField(choices=EventKind.choices, widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = Webhook
        fields = ["name", "url", "events", "template", "secret", "enabled"]


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    form = WebhookForm
    list_display = ["name", "url", "enabled", "consecutive_failures", "disabled_reason", "deliveries_link"]
    list_filter = ["enabled"]
    search_fields = ["name", "url"]
    readonly_fields = ["consecutive_failures", "disabled_reason", "created_at", "updated_at"]

    @admin.display(description="deliveries")
    def deliveries_link(self, webhook: Webhook) -> str:
        url = reverse("admin:webhooks_delivery_changelist") + f"?webhook__id__exact={webhook.pk}"
        return format_html('<a href="{}">deliveries</a>', url)


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "webhook",
        "kind",
        "run_id",
        "state",
        "status_code",
        "latency_ms",
        "attempts",
        "created_at",
    ]
    list_filter = ["state", "kind", "webhook"]
    list_select_related = ["webhook"]
    readonly_fields = [
        "webhook",
        "kind",
        "run_id",
        "payload",
        "state",
        "attempts",
        "status_code",
        "latency_ms",
        "last_error",
        "created_at",
        "updated_at",
    ]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
