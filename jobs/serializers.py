"""REST representations of runs, their steps and timeline."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db.models import Manager
from django.utils import timezone
from django.utils.translation import gettext as _
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from devices.models import DeviceGroup
from devices.selectors import selector_parse
from devices.serializers import LockStateSerializer
from iotqueue.api import BoundedJSONField

from .models import (
    ConcurrencyLimit,
    ContinuousFanout,
    EndBehaviour,
    JobRun,
    JobTemplate,
    LimitScope,
    MaintenanceWindow,
    Rollout,
    RunEvent,
    StepRun,
    window_target_problems,
)
from .rollouts import REASON_MAX_LENGTH, rollout_waves
from .services import RunStartError, run_window_check
from .timewindows import WindowSpec, window_next_start, window_open
from .waiting import REASONS, Waiting, runs_steps_waiting, step_waiting


class RunStartSerializer(serializers.Serializer):
    template = serializers.SlugRelatedField(slug_field="name", queryset=JobTemplate.objects.all())
    template_version = serializers.IntegerField(
        required=False, min_value=1, help_text="Run this version of the template (default: as it is now)."
    )
    parameters = BoundedJSONField(
        required=False,
        default=dict,
        help_text="Read by the steps as {{ params.NAME }}: every name the template's steps read (and "
        "each device_param) must be given, or the answer is 400 naming the missing ones.",
    )
    priority = serializers.IntegerField(required=False, min_value=0, max_value=9)
    idempotency_key = serializers.CharField(required=False, max_length=200, allow_blank=False)
    for_each = BoundedJSONField(
        required=False,
        help_text='One run per device: {"group": "pumps"}, {"labels": {"site": "berlin"}} or '
        '{"selector": "site in (berlin,paris),!legacy"}.',
    )

    not_before = serializers.DateTimeField(
        required=False,
        help_text="Time windows: the run stays pending until then (ISO 8601 with its offset).",
    )
    end_by = serializers.DateTimeField(
        required=False,
        help_text="Time windows: then `end_behaviour` decides what still runs (ISO 8601 with its offset).",
    )
    end_behaviour = serializers.ChoiceField(
        choices=EndBehaviour.choices,
        required=False,
        default=EndBehaviour.CANCEL,
        help_text="At end_by: cancel (the run is canceled: queued commands are not sent, those at work are "
        "told to stop) or finish (commands at work finish, nothing new starts; the run ends canceled).",
    )

    def validate(self, attrs):
        try:
            run_window_check(
                not_before=attrs.get("not_before"),
                end_by=attrs.get("end_by"),
                end_behaviour=attrs.get("end_behaviour", EndBehaviour.CANCEL),
            )
        except RunStartError as exc:
            raise serializers.ValidationError({exc.field: [str(exc)]}) from None
        return attrs

    def validate_for_each(self, value):
        if not isinstance(value, dict) or set(value) - {"group", "labels", "selector"} or not value:
            raise serializers.ValidationError(
                _('Use {"group": NAME}, {"labels": {KEY: VALUE}} or {"selector": "KEY in (A,B),!KEY"}.')
            )
        if not isinstance(value.get("group", ""), str):
            raise serializers.ValidationError(_("group must be a group's name."))
        if not isinstance(value.get("labels", {}), dict):
            raise serializers.ValidationError(_("labels must be a JSON object."))
        if not isinstance(value.get("selector", ""), str):
            raise serializers.ValidationError(_("selector must be a string."))
        try:
            requirements = selector_parse(value.get("selector", ""))
        except ValueError as exc:
            problem = _("Not a label selector: %(error)s.") % {"error": exc}
            raise serializers.ValidationError(problem) from None
        if not value.get("group") and not value.get("labels") and not requirements:
            # An empty selector matches every enabled device: one run on each, by accident.
            raise serializers.ValidationError(
                _("Name a group or at least one label; an empty selector is refused.")
            )
        return value

    def validate_parameters(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError(_("Must be a JSON object."))
        return value


class WaitingSerializer(serializers.Serializer):
    """Why a step or run waits (jobs/waiting.py); computed when read, never stored."""

    reason = serializers.ChoiceField(
        choices=sorted(REASONS.items()),
        help_text="What it waits for, as a code (docs/operations.md lists them).",
    )
    message = serializers.CharField(help_text="The same for people, in the request's language.")
    device = serializers.CharField(allow_null=True, help_text="The device it concerns, if any.")
    since = serializers.DateTimeField(
        allow_null=True, help_text="When the condition began: device offline since, queued, sent."
    )
    until = serializers.DateTimeField(
        allow_null=True,
        help_text="When it may go on, if known: a delay's end, flow control's or the rollout's next "
        "send, a retry, the attempt's deadline.",
    )
    blocking_run = serializers.UUIDField(
        allow_null=True, help_text="device_busy: the run holding the device."
    )
    blocking_step = serializers.IntegerField(allow_null=True, help_text="device_busy: that run's step index.")
    queue_position = serializers.IntegerField(
        allow_null=True, help_text="device_busy: this step's place in the device's queue (1 = next)."
    )
    step = serializers.IntegerField(allow_null=True, help_text="The index of the step that waits.")


# The serializer context's key for the reasons of the runs and steps being written.
WAITING_CONTEXT = "waiting"


@dataclass
class WaitingKnown:
    """Reasons read for the runs being written, in one batch per page (jobs/waiting.py)."""

    runs_read: set = field(default_factory=set)
    runs: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)


def waiting_read(context: dict, runs: Iterable[JobRun]) -> None:
    """Read the reasons of `runs` and their rows into the serializer context (a fixed number
    of queries and one Redis round trip for a page, with the rows prefetched)."""
    known = context.setdefault(WAITING_CONTEXT, WaitingKnown())
    runs = [run for run in runs if run.pk not in known.runs_read]
    if not runs:
        return
    # A failed fan-out's rows at work finish after their run ended: all rows are read.
    rows = [row for run in runs for row in run.step_runs.all()]
    by_run, by_row = runs_steps_waiting(runs, rows)
    known.runs_read.update(run.pk for run in runs)
    known.runs.update(by_run)
    known.steps.update(by_row)


def waiting_data(waiting: Waiting | None) -> dict | None:
    return WaitingSerializer(waiting).data if waiting is not None else None


WAITING_HELP = "computed from the rows and the lock state when read, never stored"


class StepRunSerializer(serializers.ModelSerializer):
    device = serializers.CharField(source="device_name")
    waiting = serializers.SerializerMethodField(
        help_text=f"Why the step waits (null: it has finished); {WAITING_HELP}."
    )

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
            "waiting",
        ]

    @extend_schema_field(WaitingSerializer(allow_null=True))
    def get_waiting(self, row: StepRun) -> dict | None:
        known = self.context.get(WAITING_CONTEXT)
        if known is not None and row.run_id in known.runs_read:
            return waiting_data(known.steps.get(row.pk))
        return waiting_data(step_waiting(row))


class RunListSerializer(serializers.ListSerializer):
    """Reads the reasons of a whole page of runs at once, before writing any of them."""

    def to_representation(self, data):
        runs = list(data.all() if isinstance(data, Manager) else data)
        waiting_read(self.context, runs)
        return super().to_representation(runs)


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["created_at", "kind", "device", "message", "data"]


class RolloutWaveSerializer(serializers.Serializer):
    """One wave of a rollout as it stands (its spec's condition and gate keys besides)."""

    number = serializers.IntegerField(help_text="The wave's number, from 1.")
    size = serializers.IntegerField(help_text="How many devices the wave has.")
    label = serializers.CharField(help_text='A by_label wave\'s label value ("region=eu"); "" otherwise.')
    where = serializers.ChoiceField(
        choices=["done", "open", "next"], help_text="done, open (its devices may start) or next (to come)."
    )
    counts = serializers.DictField(
        child=serializers.IntegerField(), help_text="The wave's devices by status."
    )
    gate = serializers.CharField(required=False, help_text="auto (default), approval or webhook.")
    min_succeeded_percent = serializers.IntegerField(required=False)
    max_failed_percent = serializers.IntegerField(required=False)
    on_fail = serializers.CharField(required=False, help_text="pause (default) or abort.")
    soak_seconds = serializers.IntegerField(required=False)
    webhook_url = serializers.CharField(required=False)


class RolloutSerializer(serializers.ModelSerializer):
    """Where a fan-out in waves stands: its open wave, state and who decided last."""

    step = serializers.IntegerField(source="index", help_text="The fan-out step's index, from 0.")
    wave = serializers.SerializerMethodField(help_text="The open wave's number, from 1.")
    waves = serializers.SerializerMethodField(help_text="Every wave with its devices counted by status.")

    class Meta:
        model = Rollout
        fields = ["step", "wave", "state", "reason", "decided_by", "soak_until", "updated_at", "waves"]

    def get_wave(self, rollout: Rollout) -> int:
        return rollout.wave + 1

    @extend_schema_field(RolloutWaveSerializer(many=True))
    def get_waves(self, rollout: Rollout) -> list[dict]:
        return rollout_waves(rollout)


class RolloutActionSerializer(serializers.Serializer):
    """The body of POST /api/runs/<id>/rollout/<action>/ (both fields optional)."""

    step = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=32767,
        help_text="The fan-out step's index (default: the latest).",
    )
    reason = serializers.CharField(
        required=False, allow_blank=True, max_length=REASON_MAX_LENGTH, help_text="Why, for the timeline."
    )


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
    waiting = serializers.SerializerMethodField(
        help_text="Why the run waits, as its oldest unfinished step's reason (null: it has ended); "
        f"{WAITING_HELP}."
    )

    class Meta:
        list_serializer_class = RunListSerializer
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
            "not_before",
            "end_by",
            "end_behaviour",
            "windows",
            "created_at",
            "started_at",
            "finished_at",
            "waiting",
            "steps",
        ]

    def to_representation(self, instance: JobRun) -> dict:
        waiting_read(self.context, [instance])  # nothing to read when its page was read
        return super().to_representation(instance)

    @extend_schema_field(WaitingSerializer(allow_null=True))
    def get_waiting(self, run: JobRun) -> dict | None:
        return waiting_data(self.context[WAITING_CONTEXT].runs.get(run.pk))


# A run's detail shows its latest this many events; the whole timeline is paged at
# /api/runs/<id>/events/ (a device that floods must not make one answer megabytes).
RUN_DETAIL_EVENTS = 100


class ContinuousFanoutSerializer(serializers.ModelSerializer):
    """A continuous fan-out step of a run: open while closed_at is null."""

    index = serializers.IntegerField(help_text="The fan-out step's index in its run, from 0.")
    closes_at = serializers.DateTimeField(
        allow_null=True, help_text="Its end-by (open_seconds after it started); null: closed by hand only."
    )
    closed_at = serializers.DateTimeField(allow_null=True, help_text="When it closed; null while it is open.")
    closed_by = serializers.CharField(help_text="Who closed it by hand; empty when its end-by closed it.")

    class Meta:
        model = ContinuousFanout
        fields = ["index", "opened_at", "closes_at", "closed_at", "closed_by"]
        read_only_fields = fields


class FanoutCloseSerializer(serializers.Serializer):
    """What `POST /api/runs/<id>/fanout/close/` closes."""

    step = serializers.CharField(
        required=False,
        max_length=128,
        help_text="The fan-out step, by index (from 0) or name; default: the run's open continuous fan-out.",
    )


class RunDetailSerializer(RunSerializer):
    continuous_fanouts = ContinuousFanoutSerializer(
        many=True,
        read_only=True,
        help_text="The run's continuous fan-out steps: open ones take devices that come to match them.",
    )
    events = serializers.SerializerMethodField(
        help_text=f"The run's latest {RUN_DETAIL_EVENTS} events, oldest first; all of them, paged, "
        "at events_url."
    )
    events_total = serializers.SerializerMethodField(help_text="How many events the run has.")
    events_url = serializers.HyperlinkedIdentityField(
        view_name="run-events", help_text="The run's whole timeline, paged, oldest first."
    )

    rollouts = RolloutSerializer(
        many=True, read_only=True, help_text="The run's fan-outs in waves (jobs: waves and gates)."
    )

    class Meta(RunSerializer.Meta):
        fields = [
            *RunSerializer.Meta.fields,
            "continuous_fanouts",
            "events",
            "events_total",
            "events_url",
            "rollouts",
        ]

    @extend_schema_field(RunEventSerializer(many=True))
    def get_events(self, run: JobRun) -> list[dict]:
        latest = list(run.events.order_by("-id")[:RUN_DETAIL_EVENTS])
        return RunEventSerializer(reversed(latest), many=True).data

    def get_events_total(self, run: JobRun) -> int:
        return run.events.count()


class LockStepSerializer(serializers.Serializer):
    """A step row holding or waiting for a device's lock, named for people."""

    step_run = serializers.IntegerField()
    run = serializers.UUIDField()
    index = serializers.IntegerField(help_text="The step's index in its run, from 0.")
    action = serializers.CharField()
    template = serializers.CharField()
    queue_position = serializers.IntegerField(
        allow_null=True,
        help_text="1 = next in the device's lock queue; null: waiting for the device to come online.",
    )


class DeviceLockSerializer(LockStateSerializer):
    """A device's lock (holder, fence, queue as the lock stores them) with the runs behind them."""

    holder_step = LockStepSerializer(
        allow_null=True, help_text="The run and step holding the lock, if a step does."
    )
    waiting = LockStepSerializer(
        many=True,
        help_text="The steps waiting for the device, in the order they will get it: the lock queue, "
        "then those waiting for the device to come online.",
    )


class PreviewDeviceSerializer(serializers.Serializer):
    name = serializers.CharField()
    enabled = serializers.BooleanField()
    online = serializers.BooleanField()
    presence_required = serializers.BooleanField()
    holder = serializers.CharField(allow_null=True, help_text="Who holds the device's lock now (null: free).")
    queue_depth = serializers.IntegerField(help_text="Steps queued on the device's lock.")


class PreviewDevicesSerializer(serializers.Serializer):
    matched = serializers.IntegerField(help_text="Devices the step addresses, enabled or not.")
    enabled = serializers.IntegerField()
    disabled = serializers.IntegerField(help_text="Matched but disabled: a fan-out leaves them out.")
    online = serializers.IntegerField()
    reachable = serializers.IntegerField(help_text="Online, or presence not required.")
    offline_waiting = serializers.IntegerField(help_text="Enabled, offline and presence required: they wait.")
    busy = serializers.IntegerField(help_text="Devices whose lock is held now.")
    queued_ahead = serializers.IntegerField(help_text="Commands before this step's, over all devices.")
    listed = serializers.IntegerField(help_text="How many `items` list (the first by name, at most 100).")
    items = PreviewDeviceSerializer(many=True)


class PreviewFlowControlSerializer(serializers.Serializer):
    min_interval_devices = serializers.IntegerField()
    min_interval_seconds_max = serializers.FloatField(allow_null=True)
    max_per_minute_devices = serializers.IntegerField()
    max_per_minute_min = serializers.IntegerField(allow_null=True)


class PreviewLimitLargestSerializer(serializers.Serializer):
    value = serializers.CharField()
    devices = serializers.IntegerField()


class PreviewLimitSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField(help_text="e.g. limit 'site-downloads' (3 per site)")
    label = serializers.CharField(help_text="The device label the limit counts per.")
    max_concurrent = serializers.IntegerField(help_text="At most this many in flight per label value.")
    devices = serializers.IntegerField(help_text="Targets the limit applies to (those with the label).")
    label_values = serializers.IntegerField(help_text="How many label values the targets have.")
    largest = PreviewLimitLargestSerializer(help_text="The label value with the most targets.")


class PreviewStepEstimateSerializer(serializers.Serializer):
    seconds = serializers.FloatField(allow_null=True, help_text="null: no estimate (the step would fail).")
    method = serializers.ChoiceField(
        choices=[
            "fails_at_start",
            "delay",
            "typical",
            "queue_then_typical",
            "rollout_replay",
            "continuous_end_by",
            "continuous_until_closed",
            "waves_replay",
        ],
        help_text="rollout_replay: the fan-out's pumps replayed with the engine's rate, ramp and "
        "max-in-flight arithmetic; waves_replay: the same for each wave of a fan-out in waves, one "
        "after the other, with their soak times; queue_then_typical: the commands ahead, then one "
        "typical duration; continuous_end_by: a continuous fan-out, the replay or its open_seconds, "
        "whichever is longer; continuous_until_closed: one closed by hand only (no estimate).",
    )
    typical_seconds = serializers.FloatField(allow_null=True)
    typical_source = serializers.ChoiceField(
        choices=["recent_median", "default"],
        allow_null=True,
        help_text="recent_median: of the action's latest 50 succeeded rows; default: 2 s.",
    )
    queue_timeout_seconds = serializers.IntegerField(required=False)
    rows_timing_out = serializers.IntegerField(
        required=False, help_text="Rows expected to time out in the queue (offline, or too much ahead)."
    )
    waves = serializers.IntegerField(required=False, help_text="A fan-out in waves: how many waves.")
    soak_seconds = serializers.IntegerField(
        required=False, help_text="A fan-out in waves: the soak times between waves, included in seconds."
    )
    approval_gates = serializers.IntegerField(
        required=False,
        help_text="A fan-out in waves: gates that wait for an operator's approval; their time is not "
        "in seconds (add the time approvals take).",
    )


class PreviewContinuousSerializer(serializers.Serializer):
    open_seconds = serializers.IntegerField(
        allow_null=True,
        help_text="Its end-by, from the step's start; null: it stays open until closed by hand.",
    )
    note = serializers.CharField(help_text="The same, for people.")


class PreviewStepSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    name = serializers.CharField()
    kind = serializers.CharField()
    action = serializers.CharField()
    target = serializers.CharField()
    devices = PreviewDevicesSerializer()
    flow_control = PreviewFlowControlSerializer()
    limits = PreviewLimitSerializer(
        many=True, help_text="The shared concurrency limits that apply to the step's command on its targets."
    )
    rollout = serializers.DictField(allow_null=True, help_text="A fan-out's rate, ramp and abort settings.")
    continuous = PreviewContinuousSerializer(
        allow_null=True,
        help_text="A continuous fan-out (devices that come to match it while it is open get the step "
        "too); null for any other step.",
    )
    problems = serializers.ListField(child=serializers.CharField(), help_text="What would fail the step.")
    estimate = PreviewStepEstimateSerializer()


class PreviewEstimateSerializer(serializers.Serializer):
    seconds = serializers.FloatField(allow_null=True, help_text="The steps' estimates added up.")
    finish_at = serializers.DateTimeField(allow_null=True)
    steps_in_sequence = serializers.BooleanField()
    approval_gates = serializers.IntegerField(
        help_text="Gates of fan-outs in waves that wait for an operator: the finish is later by the "
        "time approvals take."
    )


class PreviewForEachSerializer(serializers.Serializer):
    matched = serializers.IntegerField()
    devices = serializers.ListField(child=serializers.CharField(), help_text="The first 100 by name.")


class PreviewWindowSerializer(serializers.Serializer):
    name = serializers.CharField()
    cron = serializers.CharField()
    duration_minutes = serializers.IntegerField()
    timezone = serializers.CharField()
    applies_to = serializers.CharField(help_text="The template's runs, `group NAME` or `label KEY=VALUE`.")
    devices = serializers.IntegerField(help_text="How many of the devices the steps address it holds.")
    open_now = serializers.BooleanField()
    closes_at = serializers.DateTimeField(allow_null=True, help_text="When open: when this opening closes.")
    next_opening = serializers.DateTimeField(allow_null=True, help_text="When closed: its next opening.")


class RunPreviewSerializer(serializers.Serializer):
    """What starting the run would do (jobs/preview.py); nothing is started or written."""

    template = serializers.CharField()
    template_version = serializers.IntegerField(allow_null=True)
    priority = serializers.IntegerField()
    runs = serializers.IntegerField(help_text="Runs the start would create (for_each: one per device).")
    for_each = PreviewForEachSerializer(allow_null=True)
    steps = PreviewStepSerializer(many=True)
    estimate = PreviewEstimateSerializer()
    problems = serializers.ListField(child=serializers.CharField())
    windows = PreviewWindowSerializer(
        many=True,
        help_text="Time windows: the maintenance windows that would apply to the run's devices (a "
        "command for a device outside all of them waits for the next opening).",
    )
    previewed_at = serializers.DateTimeField()


class ConcurrencyLimitSerializer(serializers.ModelSerializer):
    """A shared concurrency limit (jobs/limits.py); refusals are keyed by field."""

    class Meta:
        model = ConcurrencyLimit
        fields = [
            "name",
            "label",
            "max_concurrent",
            "applies_to",
            "match",
            "enabled",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]

    def validate(self, attrs):
        names = ("applies_to", "match", "label")
        values = {name: attrs.get(name, getattr(self.instance, name, None)) for name in names}
        applies_to = values["applies_to"] or LimitScope.ACTION
        match = values["match"] or ""
        if applies_to != LimitScope.ALL and not match:
            raise serializers.ValidationError(
                {"match": _("Say which action, prefix or template the limit applies to.")}
            )
        if applies_to == LimitScope.ALL and match:
            raise serializers.ValidationError(
                {"match": _("A limit on all commands matches nothing more: leave it empty.")}
            )
        if applies_to == LimitScope.TEMPLATE and not JobTemplate.objects.filter(name=match).exists():
            problem = _("No template is named %(name)s.") % {"name": match}
            raise serializers.ValidationError({"match": problem})
        if not (values["label"] or "").strip():
            raise serializers.ValidationError({"label": _("Name a device label key.")})
        return attrs


class MaintenanceWindowSerializer(serializers.ModelSerializer):
    """A recurring maintenance window (time windows): commands for the devices it applies to
    wait outside it. 400s name the field: `cron`, `timezone`, `duration_minutes`, the target."""

    template = serializers.SlugRelatedField(
        slug_field="name",
        queryset=JobTemplate.objects.all(),
        required=False,
        allow_null=True,
        help_text="For every run of this template (or give group, or label_key and label_value).",
    )
    group = serializers.SlugRelatedField(
        slug_field="name",
        queryset=DeviceGroup.objects.all(),
        required=False,
        allow_null=True,
        help_text="For the commands to the devices of this group.",
    )
    label_key = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=64,
        help_text="With label_value: devices with this label.",
    )
    label_value = serializers.CharField(required=False, allow_blank=True, max_length=128)
    applies_to = serializers.CharField(read_only=True)
    open_now = serializers.SerializerMethodField(help_text="Whether the window is open now.")
    next_opening = serializers.SerializerMethodField(help_text="Its next start after now (null: none found).")

    class Meta:
        model = MaintenanceWindow
        fields = [
            "name",
            "cron",
            "duration_minutes",
            "timezone",
            "template",
            "group",
            "label_key",
            "label_value",
            "applies_to",
            "open_now",
            "next_opening",
            "created_at",
        ]
        read_only_fields = ["created_at"]

    def validate(self, attrs):
        def current(field: str):
            return attrs[field] if field in attrs else getattr(self.instance, field, None)

        problems = window_target_problems(
            template=current("template"),
            group=current("group"),
            label_key=current("label_key") or "",
            label_value=current("label_value") or "",
        )
        if problems:
            raise serializers.ValidationError({field: [str(message)] for field, message in problems.items()})
        return attrs

    @staticmethod
    def _spec(window: MaintenanceWindow) -> WindowSpec:
        return WindowSpec(window.name, window.cron, window.duration_minutes, window.timezone)

    def get_open_now(self, window: MaintenanceWindow) -> bool:
        return window_open(self._spec(window), timezone.now()) is not None

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_next_opening(self, window: MaintenanceWindow):
        start = window_next_start(self._spec(window), timezone.now())
        return serializers.DateTimeField().to_representation(start) if start else None
