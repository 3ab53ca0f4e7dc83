"""REST representation of job templates with their ordered steps (nested create/update)."""

from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from devices.models import Device, DeviceGroup
from iotqueue.api import BoundedModelSerializer

from .models import JobStep, JobTemplate, TemplateVersion
from .parameters import template_parameters
from .services import PLAN_FIELDS, template_version_record
from .validation import template_errors

# The plan snapshot's fields plus the two targets it stores by name.
STEP_FIELDS = ["device", "group", *PLAN_FIELDS]

# A template's steps as its representation reads them: in order, targets joined, one query.
STEPS_PREFETCH = Prefetch(
    "steps", queryset=JobStep.objects.select_related("device", "group").order_by("position")
)


class JobStepListSerializer(serializers.ListSerializer):
    """A template's step list, refused as a whole when longer than the limit, before any step is read."""

    def to_internal_value(self, data: Any) -> list[dict]:
        limit = settings.IOTQUEUE_TEMPLATE_MAX_STEPS
        if isinstance(data, list) and len(data) > limit:
            raise serializers.ValidationError(
                _("A template has at most %(limit)d steps (IOTQUEUE_TEMPLATE_MAX_STEPS), not %(count)d.")
                % {"limit": limit, "count": len(data)}
            )
        return super().to_internal_value(data)


class JobStepSerializer(BoundedModelSerializer):
    device = serializers.SlugRelatedField(
        slug_field="name", queryset=Device.objects.all(), required=False, allow_null=True
    )
    group = serializers.SlugRelatedField(
        slug_field="name", queryset=DeviceGroup.objects.all(), required=False, allow_null=True
    )

    class Meta:
        model = JobStep
        fields = STEP_FIELDS
        list_serializer_class = JobStepListSerializer


class JobTemplateSerializer(serializers.ModelSerializer):
    """A template and its steps; a step list sent replaces the whole list (validated as a whole)."""

    steps = JobStepSerializer(many=True)
    parameters = serializers.SerializerMethodField(
        help_text=gettext_lazy(
            "The run parameters the steps read ({{ params.NAME }} in args, device_param): a run "
            "of this template must give each of them."
        )
    )

    class Meta:
        model = JobTemplate
        fields = [
            "id",
            "name",
            "description",
            "default_priority",
            "max_duration",
            "steps",
            "parameters",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_parameters(self, template: JobTemplate) -> list[str]:
        # The steps as prefetched (STEPS_PREFETCH, in position order): no query.
        return template_parameters(list(template.steps.all()))

    def validate_steps(self, steps: list[dict]) -> list[dict]:
        if not steps:
            raise serializers.ValidationError(_("A template needs at least one step."))
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
            raise serializers.ValidationError(_("Step positions must be unique."))
        return steps

    @transaction.atomic
    def create(self, validated_data: dict) -> JobTemplate:
        steps = validated_data.pop("steps")
        template = JobTemplate.objects.create(**validated_data)
        JobStep.objects.bulk_create([JobStep(template=template, **step) for step in steps])
        template_version_record(template=template, author=self._author())
        return _template_with_steps(template.pk)

    @transaction.atomic
    def update(self, template: JobTemplate, validated_data: dict) -> JobTemplate:
        steps = validated_data.pop("steps", None)
        for field, value in validated_data.items():
            setattr(template, field, value)
        template.save()
        if steps is not None:
            template_steps_write(template=template, steps=steps)
        template_version_record(template=template, author=self._author())
        # Read again: the view drops the prefetched steps after a write, and reading them one
        # by one would cost a query per step (its device and group).
        return _template_with_steps(template.pk)

    def _author(self) -> Any:
        request = self.context.get("request")
        return getattr(request, "user", None)


def template_steps_write(*, template: JobTemplate, steps: list[dict]) -> None:
    """Make the template's steps these, writing only the positions whose step changed.

    A changed step is deleted and created again, not updated in place: runs keep their own
    snapshot (JobRun.plan) and nothing refers to a step's row, and deleting first means no
    intermediate state can collide on a unique position.
    """
    current = {step.position: step for step in template.steps.all()}
    wanted = {step["position"]: JobStep(template=template, **step) for step in steps}
    stale = [
        step.pk
        for position, step in current.items()
        if position not in wanted or _step_values(step) != _step_values(wanted[position])
    ]
    kept = {position for position, step in current.items() if step.pk not in stale}
    JobStep.objects.filter(pk__in=stale).delete()
    JobStep.objects.bulk_create([step for position, step in wanted.items() if position not in kept])


def _step_values(step: JobStep) -> tuple:
    return (step.device_id, step.group_id, *(getattr(step, name) for name in PLAN_FIELDS))


def _template_with_steps(pk: int) -> JobTemplate:
    return JobTemplate.objects.prefetch_related(STEPS_PREFETCH).get(pk=pk)


class TemplateVersionSerializer(serializers.ModelSerializer):
    """One recorded version of a template, read-only: who saved it, when, and its steps as
    a run of it executes them (devices and groups by name)."""

    author = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True, help_text="null: the system"
    )
    steps = serializers.ListField(child=serializers.DictField(), read_only=True)

    class Meta:
        model = TemplateVersion
        fields = ["number", "author", "created_at", "default_priority", "max_duration", "steps"]
        read_only_fields = fields
