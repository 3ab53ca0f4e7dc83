"""REST representations of schedules and MQTT trigger rules; errors name the field."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from iotqueue.api import BoundedJSONField
from jobs.models import JobRun, JobTemplate

from .models import Schedule, ScheduledRun, TriggerRule
from .schedules import schedule_save
from .validation import parameters_errors, rule_errors, schedule_errors


class LastRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobRun
        fields = ["id", "status", "created_at"]


def _object_check(value: Any) -> Any:
    if not isinstance(value, dict):
        raise serializers.ValidationError(_("Must be a JSON object."))
    return value


class ScheduleSerializer(serializers.ModelSerializer):
    """A schedule: `interval_seconds`, or `crontab` ("0 2 * * *") with a `timezone`."""

    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    parameters = BoundedJSONField(required=False, default=dict)
    # null or "" clears it, e.g. when a PATCH switches a schedule to an interval.
    crontab = serializers.CharField(required=False, allow_blank=True, allow_null=True, max_length=200)
    last_run = serializers.SerializerMethodField()

    class Meta:
        model = Schedule
        fields = [
            "id",
            "name",
            "template",
            "parameters",
            "priority",
            "interval_seconds",
            "crontab",
            "timezone",
            "enabled",
            "overlap",
            "fire_count",
            "last_fired_at",
            "last_run",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "fire_count", "last_fired_at", "created_at", "updated_at"]

    def validate_parameters(self, value: Any) -> Any:
        return _object_check(value)

    def validate(self, attrs: dict) -> dict:
        def current(field: str, default: Any) -> Any:
            if field in attrs:
                return attrs[field]
            return getattr(self.instance, field) if self.instance is not None else default

        attrs["crontab"] = " ".join((current("crontab", "") or "").split())
        errors = schedule_errors(
            interval_seconds=current("interval_seconds", None),
            crontab=attrs["crontab"],
            timezone=current("timezone", "UTC"),
        )
        errors.update(
            parameters_errors(template=current("template", None), parameters=current("parameters", {}))
        )
        if errors:
            raise serializers.ValidationError({field: [message] for field, message in errors.items()})
        return attrs

    @extend_schema_field(LastRunSerializer(allow_null=True))
    def get_last_run(self, schedule: Schedule) -> dict | None:
        link = ScheduledRun.objects.filter(schedule=schedule).select_related("run").first()
        return LastRunSerializer(link.run).data if link else None

    def create(self, validated_data: dict) -> Schedule:
        return schedule_save(schedule=Schedule(**validated_data))

    def update(self, schedule: Schedule, validated_data: dict) -> Schedule:
        for field, value in validated_data.items():
            setattr(schedule, field, value)
        return schedule_save(schedule=schedule)


class TriggerRuleSerializer(serializers.ModelSerializer):
    """A rule: MQTT `topic_filter` -> `template`, `parameters` may use {{ topic.N }} / {{ message.x }}."""

    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    parameters = BoundedJSONField(required=False, default=dict)

    class Meta:
        model = TriggerRule
        fields = [
            "id",
            "name",
            "topic_filter",
            "template",
            "parameters",
            "idempotency_key",
            "priority",
            "enabled",
            "max_runs_per_minute",
            "max_active_runs",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]

    def validate_parameters(self, value: Any) -> Any:
        return _object_check(value)

    def validate(self, attrs: dict) -> dict:
        def current(field: str, default: Any) -> Any:
            if field in attrs:
                return attrs[field]
            return getattr(self.instance, field) if self.instance is not None else default

        errors = rule_errors(
            topic_filter=current("topic_filter", ""),
            parameters=current("parameters", {}),
            idempotency_key=current("idempotency_key", ""),
        )
        if "topic_filter" not in errors and "parameters" not in errors:
            errors.update(
                parameters_errors(template=current("template", None), parameters=current("parameters", {}))
            )
        if errors:
            raise serializers.ValidationError({field: [message] for field, message in errors.items()})
        return attrs
