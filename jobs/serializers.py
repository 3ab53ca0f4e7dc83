"""REST representations of runs, their steps and timeline."""

from rest_framework import serializers

from devices.selectors import selector_parse
from iotqueue.api import BoundedJSONField

from .models import JobRun, JobTemplate, RunEvent, StepRun


class RunStartSerializer(serializers.Serializer):
    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    template_version = serializers.IntegerField(
        required=False, min_value=1, help_text="Run this version of the template (default: as it is now)."
    )
    parameters = BoundedJSONField(required=False, default=dict)
    priority = serializers.IntegerField(required=False, min_value=0, max_value=9)
    idempotency_key = serializers.CharField(required=False, max_length=200, allow_blank=False)
    for_each = BoundedJSONField(
        required=False,
        help_text='One run per device: {"group": "pumps"}, {"labels": {"site": "berlin"}} or '
        '{"selector": "site in (berlin,paris),!legacy"}.',
    )

    def validate_for_each(self, value):
        if not isinstance(value, dict) or set(value) - {"group", "labels", "selector"} or not value:
            raise serializers.ValidationError(
                'Use {"group": NAME}, {"labels": {KEY: VALUE}} or {"selector": "KEY in (A,B),!KEY"}.'
            )
        if not isinstance(value.get("group", ""), str):
            raise serializers.ValidationError("group must be a group's name.")
        if not isinstance(value.get("labels", {}), dict):
            raise serializers.ValidationError("labels must be a JSON object.")
        if not isinstance(value.get("selector", ""), str):
            raise serializers.ValidationError("selector must be a string.")
        try:
            requirements = selector_parse(value.get("selector", ""))
        except ValueError as exc:
            raise serializers.ValidationError(f"Not a label selector: {exc}.") from None
        if not value.get("group") and not value.get("labels") and not requirements:
            # An empty selector matches every enabled device: one run on each, by accident.
            raise serializers.ValidationError(
                "Name a group or at least one label; an empty selector is refused."
            )
        return value

    def validate_parameters(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("Must be a JSON object.")
        return value


class StepRunSerializer(serializers.ModelSerializer):
    device = serializers.CharField(source="device_name")

    class Meta:
        model = StepRun
        fields = [
            "index",
            "phase",
            "device",
            "action",
            "args",
            "status",
            "attempt",
            "command_id",
            "fence",
            "deadline",
            "progress",
            "result",
            "error",
            "queued_at",
            "dispatched_at",
            "acked_at",
            "finished_at",
        ]


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["created_at", "kind", "device", "message", "data"]


class RunSerializer(serializers.ModelSerializer):
    template = serializers.CharField(source="template.name")
    url = serializers.HyperlinkedIdentityField(view_name="run-detail")
    steps = StepRunSerializer(source="step_runs", many=True, read_only=True)
    retry_of = serializers.PrimaryKeyRelatedField(
        read_only=True, allow_null=True, help_text="The run this one retries (null: none)."
    )
    template_version = serializers.IntegerField(
        source="template_version.number",
        read_only=True,
        allow_null=True,
        help_text="The number of the template version the run executes (null: a canvas command "
        "or a run from before versions).",
    )

    class Meta:
        model = JobRun
        fields = [
            "id",
            "url",
            "template",
            "template_version",
            "parameters",
            "status",
            "cursor",
            "priority",
            "trigger",
            "triggered_by",
            "idempotency_key",
            "retry_of",
            "error",
            "max_duration",
            "deadline",
            "created_at",
            "started_at",
            "finished_at",
            "steps",
        ]


class RunDetailSerializer(RunSerializer):
    events = RunEventSerializer(many=True, read_only=True)

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "events"]
