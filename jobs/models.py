"""Job templates (what to do), runs (doing it) and the append-only event timeline."""

import uuid

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from devices.models import Device, DeviceGroup
from devices.protocol import EXTEND_SECONDS_LIMIT
from devices.selectors import SELECTOR_MAX_LENGTH
from iotqueue.names import url_name_validator

# Defined apart so jobs/validation.py need not import the models; `from jobs.models import
# StepKind` keeps working.
from .choices import (
    DEFAULT_MAX_EXTEND_SECONDS,
    MAX_INCREMENT_FACTOR,
    OnFailure,
    RolloutIncrementOn,
    StepKind,
)


class JobTemplate(models.Model):
    """A named, ordered list of steps that a trigger can start as a run."""

    name = models.CharField(max_length=128, unique=True, validators=[url_name_validator])
    description = models.TextField(blank=True)
    default_priority = models.SmallIntegerField(
        default=5,
        validators=[MinValueValidator(0), MaxValueValidator(9)],
        help_text="0 lowest .. 9 most urgent",
    )
    max_duration = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Seconds a run may take from its start; past it the run ends timed_out and its "
        "in-flight commands are canceled. Empty: no limit.",
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
    # Target: exactly one of device, device_param, group, labels, selector (delay steps have none).
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
    selector = models.CharField(
        max_length=SELECTOR_MAX_LENGTH,
        blank=True,
        help_text="Fan out to every enabled device a label selector matches when the step starts, "
        "e.g. site in (berlin,paris),!legacy.",
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
    max_extend_seconds = models.PositiveIntegerField(
        default=DEFAULT_MAX_EXTEND_SECONDS,
        validators=[MaxValueValidator(EXTEND_SECONDS_LIMIT)],
        help_text="How far past its timeout a device may push an attempt's deadline (progress "
        "extend_seconds); 0 = never.",
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
    abort_criteria = models.JSONField(
        default=list,
        blank=True,
        help_text='Abort by cause: a list of {"cause": "failed"|"rejected"|"timed_out"|"any", '
        '"threshold_percent": 0-100, "min_executed": N}.',
    )
    # Exponential rollout (AWS IoT Jobs' exponentialRate): rollout_per_minute is the base rate.
    rollout_increment_factor = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(1.0), MaxValueValidator(MAX_INCREMENT_FACTOR)],
        help_text="Multiply the rollout rate by this at each step-up; 1 = a fixed rate.",
    )
    rollout_increment_every = models.PositiveIntegerField(
        default=0, help_text="Step the rate up after each this many devices (see rollout_increment_on)."
    )
    rollout_increment_on = models.CharField(
        max_length=16,
        choices=RolloutIncrementOn.choices,
        default=RolloutIncrementOn.SUCCEEDED,
        help_text="What counts towards a step-up: devices that succeeded, or that were notified.",
    )
    rollout_max_per_minute = models.PositiveIntegerField(
        default=0, help_text="The ramp's maximum rate; 0 = no maximum."
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
        if self.selector:
            return f"selector {self.selector}"
        return "-"


class TemplateVersion(models.Model):
    """What a template executed at one point: its steps and the template-level fields that
    change a run (default priority), numbered 1..n per template. Never changed once written.

    `steps` holds the same entries a run's plan does (jobs/services.py template_plan), so a
    run of any version is started from its snapshot.
    """

    template = models.ForeignKey(JobTemplate, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="Who saved the template; empty for the system (demo data, shell, a run's start).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    default_priority = models.SmallIntegerField()
    max_duration = models.PositiveIntegerField(null=True, blank=True)
    steps = models.JSONField(default=list)

    class Meta:
        ordering = ["template", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["template", "number"], name="templateversion_unique_number"),
        ]

    def __str__(self) -> str:
        return f"{self.template.name} v{self.number}"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            raise ValueError(f"{self} is immutable: a template's change is a new version")
        super().save(*args, **kwargs)


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
    CANVAS = "canvas"  # a device command link of a Celery chain, group or chord (jobs/canvas.py)


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
    template_version = models.ForeignKey(
        TemplateVersion,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        editable=False,
        related_name="runs",
        help_text="The version the plan was taken from (empty: a canvas command, or a run "
        "from before versions).",
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
    max_duration = models.PositiveIntegerField(
        null=True, blank=True, editable=False, help_text="From its template version: seconds from start."
    )
    deadline = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="started_at + max_duration: then it times out."
    )
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
    # The device refused the command (protocol v1.1 `"status": "rejected"`): never retried.
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"
    CANCELED = "canceled"
    SKIPPED = "skipped"


STEP_TERMINAL = (
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.REJECTED,
    StepStatus.TIMED_OUT,
    StepStatus.CANCELED,
    StepStatus.SKIPPED,
)
# States in which the device holds (or is about to execute) the step's command.
STEP_IN_FLIGHT = (StepStatus.DISPATCHED, StepStatus.IN_PROGRESS)
# Rows with work still to come: waiting for the lock, at the device, or about to retry.
STEP_AT_WORK = (StepStatus.QUEUED, StepStatus.DISPATCHED, StepStatus.IN_PROGRESS, StepStatus.RETRYING)


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
    # What the device said last and how often: progress of an attempt is kept here, and
    # only its first few messages are also timeline events (jobs/engine/reply.py).
    progress_detail = models.CharField(
        max_length=500, blank=True, help_text="The latest progress detail of the current attempt."
    )
    progress_messages = models.PositiveIntegerField(
        default=0, help_text="Progress messages received for the current attempt."
    )
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


class CanvasLink(models.Model):
    """The Celery canvas a `device_command` link belongs to, parked until its run ends.

    `request` holds what Celery's tracer would have used to go on after the link returned
    (its task id, chain, callbacks, errbacks, chord and group): jobs/canvas.py clears them
    from the task so that nothing goes on, and sends them on with the device's result (or
    failure) once the run ended. `resumed_at` makes that happen once.
    """

    run = models.OneToOneField(JobRun, on_delete=models.CASCADE, related_name="canvas_link", primary_key=True)
    task_id = models.CharField(max_length=255, unique=True)
    request = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)
    resumed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"canvas link {self.task_id}"
