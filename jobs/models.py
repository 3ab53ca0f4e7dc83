"""Job templates (what to do), runs (doing it) and the append-only event timeline."""

import uuid

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from devices.models import Device, DeviceGroup

# Defined apart so jobs/validation.py need not import the models; `from jobs.models import
# StepKind` keeps working.
from .choices import OnFailure, StepKind


class JobTemplate(models.Model):
    """A named, ordered list of steps that a trigger can start as a run."""

    name = models.CharField(max_length=128, unique=True)
    description = models.TextField(blank=True)
    default_priority = models.SmallIntegerField(
        default=5,
        validators=[MinValueValidator(0), MaxValueValidator(9)],
        help_text="0 lowest .. 9 most urgent",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class JobStep(models.Model):
    """One command to one device (or to every device of a group/selector), with its
    timeout, retry budget and failure policy; or a delay / wait-for-online step."""

    template = models.ForeignKey(JobTemplate, on_delete=models.CASCADE, related_name="steps")
    position = models.PositiveSmallIntegerField(help_text="Steps run in ascending position.")
    name = models.CharField(
        max_length=128, blank=True, help_text="Lets later steps say {{ steps.NAME.result }}."
    )
    kind = models.CharField(max_length=16, choices=StepKind.choices, default=StepKind.COMMAND)
    # Target: exactly one of device, device_param, group, labels (delay steps have none).
    device = models.ForeignKey(Device, on_delete=models.PROTECT, related_name="steps", null=True, blank=True)
    device_param = models.CharField(
        max_length=64,
        blank=True,
        help_text="Run parameter holding the device name (for-each runs use 'device').",
    )
    group = models.ForeignKey(
        DeviceGroup, on_delete=models.PROTECT, null=True, blank=True, related_name="steps"
    )
    labels = models.JSONField(
        default=dict,
        blank=True,
        help_text='Fan out to every enabled device with these labels, e.g. {"kind": "pump"}.',
    )
    action = models.CharField(
        max_length=128, blank=True, help_text="e.g. unlock, on, snapshot, firmware/check"
    )
    args = models.JSONField(default=dict, blank=True, help_text='JSON object, may use "{{ params.name }}".')
    delay_seconds = models.FloatField(default=0, help_text="Delay steps: how long to wait.")
    timeout_seconds = models.PositiveIntegerField(default=60, help_text="From dispatch to the device's done.")
    ack_timeout_seconds = models.PositiveIntegerField(
        default=0, help_text="From dispatch to the device's ack; 0 = no separate ack deadline."
    )
    queue_timeout_seconds = models.PositiveIntegerField(
        default=600, help_text="How long the step may wait for a busy or offline device."
    )
    max_attempts = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    backoff_seconds = models.FloatField(default=1.0, help_text="First retry delay; doubles each attempt.")
    on_failure = models.CharField(max_length=16, choices=OnFailure.choices, default=OnFailure.ABORT)
    compensation_action = models.CharField(max_length=128, blank=True)
    compensation_args = models.JSONField(default=dict, blank=True)
    # Fan-out (group / labels targets).
    rollout_per_minute = models.PositiveIntegerField(
        default=0, help_text="Devices started per minute; 0 = no limit."
    )
    max_in_flight = models.PositiveIntegerField(default=0, help_text="Devices working at once; 0 = no limit.")
    abort_failure_percent = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        validators=[MaxValueValidator(100)],
        help_text="Stop starting devices and fail the step when more than this % of finished devices failed.",
    )
    abort_min_devices = models.PositiveIntegerField(
        default=0, help_text="... but only once at least this many devices have finished."
    )
    success_percent = models.PositiveSmallIntegerField(
        default=100,
        validators=[MaxValueValidator(100)],
        help_text="The step succeeds when this % of devices did.",
    )

    class Meta:
        ordering = ["template", "position"]
        constraints = [
            models.UniqueConstraint(fields=["template", "position"], name="jobstep_unique_position"),
        ]

    def __str__(self) -> str:
        return f"{self.template.name} #{self.position}: {self.target_label} {self.action or self.kind}"

    @property
    def target_label(self) -> str:
        if self.device_id:
            return self.device.name
        if self.device_param:
            return f"{{{{ params.{self.device_param} }}}}"
        if self.group_id:
            return f"group {self.group.name}"
        if self.labels:
            return "labels " + ",".join(f"{k}={v}" for k, v in self.labels.items())
        return "-"


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELED = "canceled"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"


RUN_TERMINAL = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.TIMED_OUT,
    RunStatus.CANCELED,
    RunStatus.COMPENSATED,
)


class Trigger(models.TextChoices):
    REST = "rest"
    ADMIN = "admin"
    SCHEDULE = "schedule"
    MQTT = "mqtt"
    CLI = "cli"


class JobRun(models.Model):
    """One execution of a template; `cursor` is the position index of the current step."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    template = models.ForeignKey(JobTemplate, on_delete=models.PROTECT, related_name="runs")
    parameters = models.JSONField(default=dict, blank=True)
    plan = models.JSONField(
        default=list,
        blank=True,
        editable=False,
        help_text="The template's steps as they were when the run started.",
    )
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    cursor = models.PositiveSmallIntegerField(default=0)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.REST)
    triggered_by = models.CharField(max_length=150, blank=True)
    priority = models.SmallIntegerField(default=5, validators=[MinValueValidator(0), MaxValueValidator(9)])
    idempotency_key = models.CharField(max_length=200, null=True, blank=True, unique=True)
    retry_of = models.OneToOneField(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="retried_as",
        help_text="The failed run this run retries from its failed step.",
    )
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["status", "created_at"], name="jobrun_status_created"),
            models.Index(fields=["triggered_by"], name="jobrun_triggered_by"),  # admin search
        ]

    def __str__(self) -> str:
        return f"{self.template.name} {str(self.id)[:8]} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in RUN_TERMINAL


class StepStatus(models.TextChoices):
    PENDING = "pending"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    IN_PROGRESS = "in_progress"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELED = "canceled"
    SKIPPED = "skipped"


STEP_TERMINAL = (
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.TIMED_OUT,
    StepStatus.CANCELED,
    StepStatus.SKIPPED,
)
# States in which the device holds (or is about to execute) the step's command.
STEP_IN_FLIGHT = (StepStatus.DISPATCHED, StepStatus.IN_PROGRESS)


class Phase(models.TextChoices):
    FORWARD = "forward"
    COMPENSATION = "compensation"


class StepRun(models.Model):
    """One step of one run on one device; the committed row is the command's outbox entry.

    A fan-out step has one row per device; a compensation (rollback) has its own row in
    the compensation phase, with the index of the step it undoes.
    """

    run = models.ForeignKey(JobRun, on_delete=models.CASCADE, related_name="step_runs")
    index = models.PositiveSmallIntegerField(help_text="Position of the step in the run, from 0.")
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.FORWARD)
    device = models.ForeignKey(
        Device, on_delete=models.PROTECT, related_name="step_runs", null=True, blank=True
    )
    action = models.CharField(max_length=128)
    args = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=StepStatus.choices, default=StepStatus.PENDING)
    attempt = models.PositiveSmallIntegerField(default=0)
    command_id = models.CharField(max_length=64, null=True, blank=True, unique=True)
    fence = models.BigIntegerField(
        null=True, blank=True, help_text="Lock fencing token of the current attempt."
    )
    deadline = models.DateTimeField(null=True, blank=True)
    progress = models.PositiveSmallIntegerField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        # Column ids, not the relations: ordering by "run" would sort by JobRun's own ordering
        # and join jobs_jobrun into every query of this table, hot path included.
        ordering = ["run_id", "phase", "index", "device_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "phase", "index", "device"], name="steprun_unique_run_phase_index_device"
            ),
        ]
        indexes = [
            models.Index(fields=["device", "status"], name="steprun_device_status"),
            models.Index(fields=["status", "deadline"], name="steprun_status_deadline"),
        ]

    def __str__(self) -> str:
        where = self.device.name if self.device_id else "-"
        return f"{str(self.run_id)[:8]} step {self.index} on {where}: {self.action} ({self.status})"

    @property
    def device_name(self) -> str:
        return self.device.name if self.device_id else ""

    @property
    def is_terminal(self) -> bool:
        return self.status in STEP_TERMINAL


class RunEvent(models.Model):
    """Append-only audit timeline: every transition, and every message dropped or ignored.

    Events about messages that match no run (unknown command id, malformed payload) have
    no run; they carry the device name and topic instead.
    """

    run = models.ForeignKey(JobRun, on_delete=models.CASCADE, null=True, blank=True, related_name="events")
    step_run = models.ForeignKey(
        StepRun, on_delete=models.CASCADE, null=True, blank=True, related_name="events"
    )
    kind = models.CharField(max_length=48, db_index=True, help_text="e.g. step.dispatched, reply.stale")
    device = models.CharField(max_length=128, blank=True)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["run", "id"], name="runevent_run_id"),
            models.Index(fields=["device", "id"], name="runevent_device_id"),  # a device's events
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%H:%M:%S} {self.kind} {self.message}"[:120]
