"""REST representation of job templates with their ordered steps (nested create/update)."""

from django.db import transaction
from rest_framework import serializers

from devices.models import Device, DeviceGroup

from .models import JobStep, JobTemplate
from .services import PLAN_FIELDS
from .validation import template_errors

# The plan snapshot's fields plus the two targets it stores by name.
STEP_FIELDS = ["device", "group", *PLAN_FIELDS]


class JobStepSerializer(serializers.ModelSerializer):
    device = serializers.SlugRelatedField(
        slug_field="name", queryset=Device.objects.all(), required=False, allow_null=True
    )
    group = serializers.SlugRelatedField(
        slug_field="name", queryset=DeviceGroup.objects.all(), required=False, allow_null=True
    )

    class Meta:
        model = JobStep
        fields = STEP_FIELDS


class JobTemplateSerializer(serializers.ModelSerializer):
    """A template and its steps; writing replaces the whole step list (validated as a whole)."""

    steps = JobStepSerializer(many=True)

    class Meta:
        model = JobTemplate
        fields = ["id", "name", "description", "default_priority", "steps", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]

    def validate_steps(self, steps: list[dict]) -> list[dict]:
        if not steps:
            raise serializers.ValidationError("A template needs at least one step.")
        instances = [JobStep(**step) for step in steps]
        problems = template_errors(instances)
        if problems:
            # Keyed by the step's index in the submitted list, as DRF reports nested errors.
            by_position = {f"step {s.position}": str(i) for i, s in enumerate(instances)}
            raise serializers.ValidationError(
                {
                    by_position[label]: {field: [message] for field, message in fields.items()}
                    for label, fields in problems.items()
                }
            )
        positions = [s["position"] for s in steps]
        if len(set(positions)) != len(positions):
            raise serializers.ValidationError("Step positions must be unique.")
        return steps

    @transaction.atomic
    def create(self, validated_data: dict) -> JobTemplate:
        steps = validated_data.pop("steps")
        template = JobTemplate.objects.create(**validated_data)
        JobStep.objects.bulk_create([JobStep(template=template, **step) for step in steps])
        return template

    @transaction.atomic
    def update(self, template: JobTemplate, validated_data: dict) -> JobTemplate:
        steps = validated_data.pop("steps", None)
        for field, value in validated_data.items():
            setattr(template, field, value)
        template.save()
        if steps is not None:
            # Runs keep their own snapshot (JobRun.plan), so replacing steps is safe.
            template.steps.all().delete()
            JobStep.objects.bulk_create([JobStep(template=template, **step) for step in steps])
        return template
