"""REST representations of runs, their steps and timeline."""

from rest_framework import serializers

from .models import JobRun, JobTemplate, RunEvent, StepRun


class RunStartSerializer(serializers.Serializer):
    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    parameters = serializers.JSONField(required=False, default=dict)
    priority = serializers.IntegerField(required=False, min_value=0, max_value=9)
    idempotency_key = serializers.CharField(required=False, max_length=200, allow_blank=False)
    for_each = serializers.JSONField(
        required=False, help_text='One run per device: {"group": "pumps"} or {"labels": {"site": "berlin"}}.'
    )

    def validate_for_each(self, value):
        if not isinstance(value, dict) or set(value) - {"group", "labels"} or not value:
            raise serializers.ValidationError('Use {"group": NAME} or {"labels": {KEY: VALUE}}.')
        if "labels" in value and not isinstance(value["labels"], dict):
            raise serializers.ValidationError("labels must be a JSON object.")
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
    retry_of = serializers.PrimaryKeyRelatedField(read_only=True, help_text="The run this one retries.")

    class Meta:
        model = JobRun
        fields = [
            "id",
            "url",
            "template",
            "parameters",
            "status",
            "cursor",
            "priority",
            "trigger",
            "triggered_by",
            "idempotency_key",
            "retry_of",
            "error",
            "created_at",
            "started_at",
            "finished_at",
            "steps",
        ]


class RunDetailSerializer(RunSerializer):
    events = RunEventSerializer(many=True, read_only=True)

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "events"]
