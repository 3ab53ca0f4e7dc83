"""REST representations of webhooks and their deliveries; errors name the field."""

from __future__ import annotations

from rest_framework import serializers

from jobs.models import JobTemplate

from .models import EVENT_KINDS, Delivery, Webhook, http_url_validator

# A secret shorter than this is guessable enough to forge signatures offline.
SECRET_MIN_LENGTH = 16


class WebhookSerializer(serializers.ModelSerializer):
    """A webhook: `url` (http/https), `events` (kinds), optional `template` (name), `secret`
    (write-only, the HMAC-SHA256 key of X-Iotqueue-Signature)."""

    # Declared: DRF drops a model URLField's URLValidator (it adds its own, any scheme).
    url = serializers.URLField(max_length=2000, validators=[http_url_validator])
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=list(EVENT_KINDS)),
        allow_empty=False,
        max_length=len(EVENT_KINDS),
    )
    template = serializers.SlugRelatedField(
        slug_field="name", queryset=JobTemplate.objects.all(), required=False, allow_null=True
    )
    secret = serializers.CharField(write_only=True, min_length=SECRET_MIN_LENGTH, max_length=200)

    class Meta:
        model = Webhook
        fields = [
            "id",
            "name",
            "url",
            "events",
            "template",
            "secret",
            "enabled",
            "consecutive_failures",
            "disabled_reason",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "consecutive_failures", "disabled_reason", "created_at", "updated_at"]

    def validate_events(self, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError("An event kind is listed twice.")
        return value


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
