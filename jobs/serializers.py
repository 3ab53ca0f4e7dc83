"""REST representations of runs, their steps and timeline."""

from drf_spectacular.utils import extend_schema_field
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
            "progress_detail",
            "progress_messages",
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


# A run's detail shows its latest this many events; the whole timeline is paged at
# /api/runs/<id>/events/ (a device that floods must not make one answer megabytes).
RUN_DETAIL_EVENTS = 100


class RunDetailSerializer(RunSerializer):
    events = serializers.SerializerMethodField(
        help_text=f"The run's latest {RUN_DETAIL_EVENTS} events, oldest first; all of them, paged, "
        "at events_url."
    )
    events_total = serializers.SerializerMethodField(help_text="How many events the run has.")
    events_url = serializers.HyperlinkedIdentityField(
        view_name="run-events", help_text="The run's whole timeline, paged, oldest first."
    )

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "events", "events_total", "events_url"]

    @extend_schema_field(RunEventSerializer(many=True))
    def get_events(self, run: JobRun) -> list[dict]:
        latest = list(run.events.order_by("-id")[:RUN_DETAIL_EVENTS])
        return RunEventSerializer(reversed(latest), many=True).data

    def get_events_total(self, run: JobRun) -> int:
        return run.events.count()
