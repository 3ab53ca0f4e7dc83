"""REST representations of webhooks and their deliveries; errors name the field."""

from __future__ import annotations

from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs.models import JobTemplate

from . import addresses, signing
from .models import EVENT_KINDS, Delivery, Webhook, http_url_validator

# The longest secret text taken: its whsec_ form must fit the column.
SECRET_MAX_LENGTH = 200
SECRET_SET, SECRET_NOT_SET = "set", "not set"


def webhook_url_validate(value: str) -> None:
    """Refuse a URL whose host is a refused name or address (webhooks/addresses.py)."""
    try:
        addresses.url_check(value)
    except addresses.AddressRefused as exc:
        raise serializers.ValidationError(str(exc)) from exc


class WebhookSerializer(serializers.ModelSerializer):
    """A webhook: `url` (http/https, public addresses unless allow-listed), `events` (kinds),
    optional `template` (name), `secret` (write-only: `whsec_<base64>` or text of 16+
    characters; generated when left out) and `secret_status` ("set" / "not set"). The
    secret is never shown back; POST .../rotate-secret/ makes a new one and shows it once."""

    # Declared: DRF drops a model URLField's URLValidator (it adds its own, any scheme).
    url = serializers.URLField(max_length=2000, validators=[http_url_validator, webhook_url_validate])
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=list(EVENT_KINDS)),
        allow_empty=False,
        max_length=len(EVENT_KINDS),
    )
    template = serializers.SlugRelatedField(
        slug_field="name", queryset=JobTemplate.objects.all(), required=False, allow_null=True
    )
    secret = serializers.CharField(
        write_only=True,
        required=False,
        max_length=SECRET_MAX_LENGTH,
        help_text=gettext_lazy("whsec_<base64> or 16+ characters of text; write-only"),
    )
    secret_status = serializers.SerializerMethodField(
        help_text=gettext_lazy('"set" or "not set": the secret itself is never shown')
    )

    class Meta:
        model = Webhook
        fields = [
            "id",
            "name",
            "url",
            "events",
            "template",
            "secret",
            "secret_status",
            "enabled",
            "consecutive_failures",
            "disabled_reason",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "consecutive_failures", "disabled_reason", "created_at", "updated_at"]

    @extend_schema_field(serializers.ChoiceField(choices=[SECRET_SET, SECRET_NOT_SET]))
    def get_secret_status(self, webhook: Webhook) -> str:
        return SECRET_SET if webhook.secret_is_set else SECRET_NOT_SET

    def validate_secret(self, value: str) -> str:
        try:
            return signing.secret_normalize(value)
        except signing.SecretInvalid as exc:
            raise serializers.ValidationError(
                _("Give whsec_<base64 of a 16+ byte key> or at least 16 characters of text.")
            ) from exc

    def validate_events(self, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError(_("An event kind is listed twice."))
        return value


class SecretSerializer(serializers.Serializer):
    """A webhook's new secret, shown once, to the user who rotated it."""

    secret = serializers.CharField(read_only=True, help_text=gettext_lazy("whsec_<base64>; shown only now"))


class DeliverySerializer(serializers.ModelSerializer):
    class Meta:
        model = Delivery
        fields = [
            "id",
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
        read_only_fields = fields
