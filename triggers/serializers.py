"""REST representations of schedules and MQTT trigger rules; errors name the field."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from iotqueue.api import BoundedJSONField
from jobs.models import JobRun, JobTemplate, TemplateVersion

from .models import Schedule, ScheduledRun, TriggerRule, template_version_problem
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


class VersionNumberField(serializers.IntegerField):
    """A pinned TemplateVersion, read and written as its number within the row's template
    (as `template_version` of POST /api/runs/); `validate` turns the number into the row."""

    def to_representation(self, value: TemplateVersion) -> int:
        return value.number


def template_version_field() -> VersionNumberField:
    return VersionNumberField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="Start runs of this version of the template (null: the template as it is "
        "when the run starts).",
    )


def template_version_resolve(attrs: dict, instance: Schedule | TriggerRule | None) -> dict[str, str]:
    """Put the TemplateVersion the number names into `attrs`; {field: message} when there is none.

    A PATCH that changes the template but keeps an earlier pin is checked too: the pin must
    be a version of the template the row starts.
    """
    template = attrs.get("template", getattr(instance, "template", None))
    if "template_version" not in attrs:
        version = getattr(instance, "template_version", None)
        problem = template_version_problem(getattr(template, "pk", None), version)
        return {"template_version": problem} if problem else {}
    number = attrs["template_version"]
    if number is None or template is None:
        attrs["template_version"] = None
        return {}
    version = template.versions.filter(number=number).first()
    if version is None:
        message = _("template '%(name)s' has no version %(number)d") % {
            "name": template.name,
            "number": number,
        }
        return {"template_version": message}
    attrs["template_version"] = version
    return {}


class ScheduleSerializer(serializers.ModelSerializer):
    """A schedule: `interval_seconds`, or `crontab` ("0 2 * * *") with a `timezone`."""

    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    template_version = template_version_field()
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
            "template_version",
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
        errors.update(template_version_resolve(attrs, self.instance))
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
    template_version = template_version_field()
    parameters = BoundedJSONField(required=False, default=dict)

    class Meta:
        model = TriggerRule
        fields = [
            "id",
            "name",
            "topic_filter",
            "template",
            "template_version",
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
        errors.update(template_version_resolve(attrs, self.instance))
        if errors:
            raise serializers.ValidationError({field: [message] for field, message in errors.items()})
        return attrs
