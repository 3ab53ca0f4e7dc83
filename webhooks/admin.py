"""Admin for webhooks and their delivery log (read-only: status code, latency, attempts)."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import addresses, signing
from .models import Delivery, EventKind, Webhook


def webhook_url_validate(value: str) -> None:
    """Refuse a URL whose host is a refused name or address (webhooks/addresses.py)."""
    try:
        addresses.url_check(value)
    except addresses.AddressRefused as exc:
        raise ValidationError(str(exc), code="address") from exc


class WebhookForm(forms.ModelForm):
    """The webhook's fields; the secret is write-only (`new_secret`, empty keeps it)."""

    url = forms.URLField(max_length=2000, assume_scheme="https", validators=[webhook_url_validate])
    events = forms.MultipleChoiceField(choices=EventKind.choices, widget=forms.CheckboxSelectMultiple)
    new_secret = forms.CharField(
        label=gettext_lazy("New secret"),
        required=False,
        max_length=200,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text=gettext_lazy(
            "Write-only: whsec_<base64> or 16+ characters. Empty keeps the current secret; "
            "on a new webhook, empty generates one, shown once."
        ),
    )

    class Meta:
        model = Webhook
        fields = ["name", "url", "events", "template", "enabled"]

    def clean_new_secret(self) -> str:
        value = self.cleaned_data.get("new_secret", "")
        if not value:
            return ""
        try:
            return signing.secret_normalize(value)
        except signing.SecretInvalid as exc:
            raise ValidationError(
                _("Give whsec_<base64 of a 16+ byte key> or at least 16 characters of text."), code="secret"
            ) from exc


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    """Webhooks; the secret is never shown back: "set" / "not set", and a rotate action that
    shows a new one once to a user who may change webhooks."""

    form = WebhookForm
    list_display = [
        "name",
        "url",
        "enabled",
        "secret_status",
        "consecutive_failures",
        "disabled_reason",
        "deliveries_link",
    ]
    list_filter = ["enabled"]
    search_fields = ["name", "url"]
    readonly_fields = ["secret_status", "consecutive_failures", "disabled_reason", "created_at", "updated_at"]

    @admin.display(description=gettext_lazy("deliveries"))
    def deliveries_link(self, webhook: Webhook) -> str:
        url = reverse("admin:webhooks_delivery_changelist") + f"?webhook__id__exact={webhook.pk}"
        return format_html('<a href="{}">{}</a>', url, _("deliveries"))

    @admin.display(description=gettext_lazy("secret"))
    def secret_status(self, webhook: Webhook) -> str:
        return _("set") if webhook.secret_is_set else _("not set")

    def get_fields(self, request: HttpRequest, obj: Webhook | None = None) -> list[str]:
        fields = ["name", "url", "events", "template", "enabled", "new_secret", *self.readonly_fields]
        may_write = self.has_change_permission(request, obj) if obj else self.has_add_permission(request)
        return [field for field in fields if may_write or field != "new_secret"]

    def save_model(self, request: HttpRequest, obj: Webhook, form: WebhookForm, change: bool) -> None:
        new_secret = form.cleaned_data.get("new_secret")
        if new_secret:
            obj.secret = new_secret
        elif not change:
            obj.secret = signing.secret_generate()
            obj.secret_generated = True  # response_add shows it, once
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: Webhook, post_url_continue: str | None = None):
        if getattr(obj, "secret_generated", False):
            return self.secret_shown(request, obj, obj.secret)
        return super().response_add(request, obj, post_url_continue)

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None):
        extra = {**(extra_context or {}), "can_rotate_secret": self.has_change_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def get_urls(self):
        rotate = path(
            "<path:object_id>/rotate-secret/",
            self.admin_site.admin_view(self.rotate_secret_view),
            name="webhooks_webhook_rotate_secret",
        )
        return [rotate, *super().get_urls()]

    def rotate_secret_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET asks; POST replaces the secret and shows the new one, once (change permission)."""
        webhook = get_object_or_404(Webhook, pk=object_id)
        if not self.has_change_permission(request, webhook):
            raise PermissionDenied
        if request.method != "POST":
            return self._secret_page(request, webhook, "")
        secret = signing.secret_generate()
        Webhook.objects.filter(pk=webhook.pk).update(secret=secret, updated_at=timezone.now())
        self.log_change(request, webhook, _("Rotated the secret."))
        return self.secret_shown(request, webhook, secret)

    def secret_shown(self, request: HttpRequest, webhook: Webhook, secret: str) -> HttpResponse:
        """The page that shows a new secret, this once (not cached)."""
        response = self._secret_page(request, webhook, secret)
        add_never_cache_headers(response)
        return response

    def _secret_page(self, request: HttpRequest, webhook: Webhook, secret: str) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": webhook,
            "secret": secret,
            "title": _("Secret of webhook %(name)s") % {"name": webhook.name},
        }
        return TemplateResponse(request, "admin/webhooks/webhook/rotate_secret.html", context)


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
