"""Job templates (what to do), runs (doing it) and the append-only event timeline."""

import uuid
from datetime import date, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils.translation import gettext_lazy as _

from devices.models import Device, DeviceGroup, time_zone_validate
from devices.protocol import EXTEND_SECONDS_LIMIT
from devices.selectors import SELECTOR_MAX_LENGTH
from iotqueue.names import url_name_validator

from .choices import (
    DEFAULT_MAX_EXTEND_SECONDS,
    MAX_INCREMENT_FACTOR,
    OPEN_SECONDS_MAX,
    OnFailure,
    RolloutIncrementOn,
    RolloutState,
    StepKind,
)

# Defined apart so jobs/validation.py need not import the models; `from jobs.models import
# StepKind` keeps working.
from .timewindows import OPENING_SEARCH_DAYS, WINDOW_MAX_MINUTES, cron_parse


class JobTemplate(models.Model):
    """A named, ordered list of steps that a trigger can start as a run."""

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[url_name_validator])
    description = models.TextField(_("description"), blank=True)
    default_priority = models.SmallIntegerField(
        _("default priority"),
        default=5,
        validators=[MinValueValidator(0), MaxValueValidator(9)],
        help_text=_("0 lowest .. 9 most urgent"),
    )
    max_duration = models.PositiveIntegerField(
        _("max duration"),
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=_(
            "Seconds a run may take from its start; past it the run ends timed_out and its "
            "in-flight commands are canceled. Empty: no limit."
        ),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("job template")
        verbose_name_plural = _("job templates")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class JobStep(models.Model):
    """One command to one device (or to every device of a group/selector), with its
    timeout, retry budget and failure policy; or a delay / wait-for-online step."""

    template = models.ForeignKey(
        JobTemplate, on_delete=models.CASCADE, related_name="steps", verbose_name=_("template")
    )
    position = models.PositiveSmallIntegerField(
        _("position"), help_text=_("Steps run in ascending position.")
    )
    name = models.CharField(
        _("name"), max_length=128, blank=True, help_text=_("Lets later steps say {{ steps.NAME.result }}.")
    )
    kind = models.CharField(_("kind"), max_length=16, choices=StepKind.choices, default=StepKind.COMMAND)
    # Target: exactly one of device, device_param, group, labels, selector, devices_from (delay
    # steps have none).
    device = models.ForeignKey(
        Device,
        on_delete=models.PROTECT,
        related_name="steps",
        null=True,
        blank=True,
        verbose_name=_("device"),
    )
    device_param = models.CharField(
        _("device param"),
        max_length=64,
        blank=True,
        help_text=_("Run parameter holding the device name (for-each runs use 'device')."),
    )
    group = models.ForeignKey(
        DeviceGroup,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="steps",
        verbose_name=_("group"),
    )
    labels = models.JSONField(
        _("labels"),
        default=dict,
        blank=True,
        help_text=_('Fan out to every enabled device with these labels, e.g. {"kind": "pump"}.'),
    )
    selector = models.CharField(
        _("selector"),
        max_length=SELECTOR_MAX_LENGTH,
        blank=True,
        help_text=_(
            "Fan out to every enabled device a label selector matches when the step starts, "
            "e.g. site in (berlin,paris),!legacy."
        ),
    )
    action = models.CharField(
        _("action"), max_length=128, blank=True, help_text=_("e.g. unlock, on, snapshot, firmware/check")
    )
    args = models.JSONField(
        _("args"), default=dict, blank=True, help_text=_('JSON object, may use "{{ params.name }}".')
    )
    delay_seconds = models.FloatField(
        _("delay seconds"), default=0, help_text=_("Delay steps: how long to wait.")
    )
    timeout_seconds = models.PositiveIntegerField(
        _("timeout seconds"), default=60, help_text=_("From dispatch to the device's done.")
    )
    ack_timeout_seconds = models.PositiveIntegerField(
        _("ack timeout seconds"),
        default=0,
        help_text=_("From dispatch to the device's ack; 0 = no separate ack deadline."),
    )
    queue_timeout_seconds = models.PositiveIntegerField(
        _("queue timeout seconds"),
        default=600,
        help_text=_("How long the step may wait for a busy or offline device."),
    )
    max_extend_seconds = models.PositiveIntegerField(
        _("max extend seconds"),
        default=DEFAULT_MAX_EXTEND_SECONDS,
        validators=[MaxValueValidator(EXTEND_SECONDS_LIMIT)],
        help_text=_(
            "How far past its timeout a device may push an attempt's deadline (progress "
            "extend_seconds); 0 = never."
        ),
    )
    max_attempts = models.PositiveSmallIntegerField(
        _("max attempts"), default=1, validators=[MinValueValidator(1)]
    )
    backoff_seconds = models.FloatField(
        _("backoff seconds"), default=1.0, help_text=_("First retry delay; doubles each attempt.")
    )
    on_failure = models.CharField(
        _("on failure"), max_length=16, choices=OnFailure.choices, default=OnFailure.ABORT
    )
    compensation_action = models.CharField(_("compensation action"), max_length=128, blank=True)
    compensation_args = models.JSONField(_("compensation args"), default=dict, blank=True)
    # Urgent (docs/orchestration.md): past quiet hours and maintenance windows, and, at a high
    # enough priority, preempting (urgent preemption).
    urgent = models.BooleanField(
        _("urgent"),
        default=False,
        help_text=_(
            "Ignores the devices' quiet hours and maintenance windows; in a run at or above the "
            "deployment's IOTQUEUE_PREEMPT_PRIORITY it also takes a busy device from a "
            "lower-priority run: that command is canceled on the device and queued again."
        ),
    )
    # Fan-out (group / labels targets).
    rollout_per_minute = models.PositiveIntegerField(
        _("rollout per minute"), default=0, help_text=_("Devices started per minute; 0 = no limit.")
    )
    max_in_flight = models.PositiveIntegerField(
        _("max in flight"), default=0, help_text=_("Devices working at once; 0 = no limit.")
    )
    abort_failure_percent = models.PositiveSmallIntegerField(
        _("abort failure percent"),
        null=True,
        blank=True,
        validators=[MaxValueValidator(100)],
        help_text=_(
            "Stop starting devices and fail the step when more than this percentage of finished "
            "devices failed."
        ),
    )
    abort_min_devices = models.PositiveIntegerField(
        _("abort min devices"),
        default=0,
        help_text=_("... but only once at least this many devices have finished."),
    )
    abort_criteria = models.JSONField(
        _("abort criteria"),
        default=list,
        blank=True,
        help_text=_(
            'Abort by cause: a list of {"cause": "failed"|"rejected"|"timed_out"|"any", '
            '"threshold_percent": 0-100, "min_executed": N}.'
        ),
    )
    # Exponential rollout (AWS IoT Jobs' exponentialRate): rollout_per_minute is the base rate.
    rollout_increment_factor = models.FloatField(
        _("rollout increment factor"),
        default=1.0,
        validators=[MinValueValidator(1.0), MaxValueValidator(MAX_INCREMENT_FACTOR)],
        help_text=_("Multiply the rollout rate by this at each step-up; 1 = a fixed rate."),
    )
    rollout_increment_every = models.PositiveIntegerField(
        _("rollout increment every"),
        default=0,
        help_text=_("Step the rate up after each this many devices (see rollout_increment_on)."),
    )
    rollout_increment_on = models.CharField(
        _("rollout increment on"),
        max_length=16,
        choices=RolloutIncrementOn.choices,
        default=RolloutIncrementOn.SUCCEEDED,
        help_text=_("What counts towards a step-up: devices that succeeded, or that were notified."),
    )
    rollout_max_per_minute = models.PositiveIntegerField(
        _("rollout max per minute"), default=0, help_text=_("The ramp's maximum rate; 0 = no maximum.")
    )
    success_percent = models.PositiveSmallIntegerField(
        _("success percent"),
        default=100,
        validators=[MaxValueValidator(100)],
        help_text=_("The step succeeds when this percentage of devices did."),
    )
    # Rollback on abort (issue 36): the pace of a fan-out's compensation on its devices.
    compensation_per_minute = models.PositiveIntegerField(
        _("compensation per minute"),
        default=0,
        help_text=_(
            "Fan-out rolled back (on_failure rollback): devices whose compensation starts per "
            "minute; 0 = no limit."
        ),
    )
    # Continuous fan-out: the step stays open for devices that come to match it.
    continuous = models.BooleanField(
        _("continuous"),
        default=False,
        help_text=_(
            "Keep the fan-out open: devices that come to match it (or come back online) while "
            "it is open get the step too, once each; it closes after open seconds or by hand."
        ),
    )
    open_seconds = models.PositiveIntegerField(
        _("open seconds"),
        null=True,
        blank=True,
        validators=[MaxValueValidator(OPEN_SECONDS_MAX)],
        help_text=_("A continuous fan-out closes this long after it started; empty = only by hand."),
    )
    # Results that flow on: a fan-out over the devices of an earlier fan-out by outcome.
    devices_from = models.JSONField(
        _("devices from"),
        default=dict,
        blank=True,
        help_text=_(
            "Fan out to the devices that succeeded or failed in an earlier fan-out step of the run, "
            'e.g. {"step": "flash", "outcome": "succeeded"}.'
        ),
    )
    # Waves with gates (jobs/engine/waves.py): the fan-out in ordered waves, each with a condition.
    waves = models.JSONField(
        _("waves"),
        default=list,
        blank=True,
        help_text=_(
            'Ordered waves, e.g. [{"percent": 1, "gate": "approval"}, {"percent": 10, '
            '"max_failed_percent": 2}, {"by_label": "region"}]; empty = one wave.'
        ),
    )

    class Meta:
        verbose_name = _("job step")
        verbose_name_plural = _("job steps")
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
        if self.devices_from:
            return f"devices that {self.devices_from.get('outcome')} in step {self.devices_from.get('step')}"
        return "-"


class TemplateVersion(models.Model):
    """What a template executed at one point: its steps and the template-level fields that
    change a run (default priority), numbered 1..n per template. Never changed once written.

    `steps` holds the same entries a run's plan does (jobs/services.py template_plan), so a
    run of any version is started from its snapshot.
    """

    template = models.ForeignKey(
        JobTemplate, on_delete=models.CASCADE, related_name="versions", verbose_name=_("template")
    )
    number = models.PositiveIntegerField(
        _("number"),
    )
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text=_("Who saved the template; empty for the system (demo data, shell, a run's start)."),
        verbose_name=_("author"),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    default_priority = models.SmallIntegerField(
        _("default priority"),
    )
    max_duration = models.PositiveIntegerField(_("max duration"), null=True, blank=True)
    steps = models.JSONField(_("steps"), default=list)

    class Meta:
        verbose_name = _("template version")
        verbose_name_plural = _("template versions")
        ordering = ["template", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["template", "number"], name="templateversion_unique_number"),
        ]

    def __str__(self) -> str:
        return f"{self.template.name} v{self.number}"

    def save(self, *args, **kwargs) -> None:
        # A version the database numbered (any version stored: they are only ever created,
        # by the ORM or loaded from the database) has its primary key.
        if self.pk is not None:
            raise ValueError(f"{self} is immutable: a template's change is a new version")
        super().save(*args, **kwargs)


class RunStatus(models.TextChoices):
    PENDING = "pending", _("Pending")
    RUNNING = "running", _("Running")
    SUCCEEDED = "succeeded", _("Succeeded")
    FAILED = "failed", _("Failed")
    TIMED_OUT = "timed_out", _("Timed Out")
    CANCELED = "canceled", _("Canceled")
    COMPENSATING = "compensating", _("Compensating")
    COMPENSATED = "compensated", _("Compensated")


RUN_TERMINAL = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.TIMED_OUT,
    RunStatus.CANCELED,
    RunStatus.COMPENSATED,
)


def cron_validate(value: str) -> None:
    """A five-field cron expression that opens at least once (jobs/timewindows.py)."""
    try:
        cron = cron_parse(value)
    except ValueError as exc:
        raise ValidationError(_("Not a cron expression: %(problem)s"), params={"problem": exc}) from None
    if not any(cron.day_matches(day) for day in _eight_years()):
        raise ValidationError(_("The cron expression names no date that exists."))


def _eight_years():
    first = date(2028, 1, 1)  # a leap year first: 29 February is found
    return (first + timedelta(days=n) for n in range(OPENING_SEARCH_DAYS))


def window_target_problems(*, template: object, group: object, label_key: str, label_value: str) -> dict:
    """What a maintenance window applies to: exactly one of a template, a device group or a
    label key=value; {field: message} naming the fields at fault."""
    given = [name for name, value in (("template", template), ("group", group)) if value]
    if label_key or label_value:
        given.append("label_key")
    if len(given) != 1:
        message = _("Name exactly one of a template, a device group or a label key=value.")
        return {name: message for name in given or ["template", "group", "label_key"]}
    if (label_key or label_value) and not (label_key and label_value):
        return {
            "label_value" if label_key else "label_key": _("A label window needs both the key and the value.")
        }
    return {}


# The scope of the windows every run keeps (a device group's or a label's).
DEVICE_WINDOWS_SCOPE = "devices"


def window_scope(template_id: int | None) -> str:
    """The runs a maintenance window is kept by: one template's, or every run."""
    return f"template:{template_id}" if template_id else DEVICE_WINDOWS_SCOPE


class EndBehaviour(models.TextChoices):
    """What a run's end by ends (time windows)."""

    CANCEL = "cancel", _("Cancel")
    FINISH = "finish", _("Finish")


class MaintenanceWindow(models.Model):
    """When commands may go (time windows): a recurring window, opening at the times a cron
    expression names in its time zone and open `duration_minutes`, for one template's runs,
    one device group or the devices with one label value. A device outside every window
    that applies to a command waits for the next opening (jobs/engine/holds.py)."""

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[url_name_validator])
    cron = models.CharField(
        _("cron"),
        max_length=128,
        validators=[cron_validate],
        help_text=_("When it opens: minute hour day-of-month month day-of-week, e.g. 0 2 * * *"),
    )
    duration_minutes = models.PositiveIntegerField(
        _("duration (minutes)"),
        validators=[MinValueValidator(1), MaxValueValidator(WINDOW_MAX_MINUTES)],
        help_text=_("How long it stays open after each start (at most a week)."),
    )
    timezone = models.CharField(
        _("time zone"),
        max_length=64,
        default="UTC",
        validators=[time_zone_validate],
        help_text=_("An IANA name, e.g. Europe/Berlin."),
    )
    # What it applies to: exactly one of a template, a device group, a label key=value.
    template = models.ForeignKey(
        JobTemplate,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="windows",
        verbose_name=_("template"),
    )
    group = models.ForeignKey(
        DeviceGroup,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="windows",
        verbose_name=_("device group"),
    )
    label_key = models.CharField(_("label key"), max_length=64, blank=True)
    label_value = models.CharField(_("label value"), max_length=128, blank=True)
    # Which runs keep it (`window_scope`): one template's, or every run (a group or label
    # window, decided per device). A run's start reads its windows by it in one indexed
    # read without the ORM's query compilation (jobs/services.py run_windows_snapshot).
    scope = models.CharField(_("scope"), max_length=32, db_index=True, editable=False, default="")
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("maintenance window")
        verbose_name_plural = _("maintenance windows")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        self.scope = window_scope(self.template_id)
        if kwargs.get("update_fields") is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "scope"}
        super().save(*args, **kwargs)

    def clean(self) -> None:
        problems = window_target_problems(
            template=self.template_id,
            group=self.group_id,
            label_key=self.label_key,
            label_value=self.label_value,
        )
        if problems:
            raise ValidationError(problems)

    @property
    def applies_to(self) -> str:
        if self.template_id:
            return f"template {self.template.name}"
        if self.group_id:
            return f"group {self.group.name}"
        return f"label {self.label_key}={self.label_value}"


class Trigger(models.TextChoices):
    REST = "rest", _("REST API")
    ADMIN = "admin", _("Admin")
    SCHEDULE = "schedule", _("Schedule")
    MQTT = "mqtt", _("MQTT")
    CLI = "cli", _("CLI")
    CANVAS = "canvas", _("Canvas")  # a device command link of a Celery chain, group or chord (jobs/canvas.py)


class JobRun(models.Model):
    """One execution of a template; `cursor` is the position index of the current step."""

    id = models.UUIDField(_("id"), primary_key=True, default=uuid.uuid4, editable=False)
    template = models.ForeignKey(
        JobTemplate, on_delete=models.PROTECT, related_name="runs", verbose_name=_("template")
    )
    parameters = models.JSONField(_("parameters"), default=dict, blank=True)
    plan = models.JSONField(
        _("plan"),
        default=list,
        blank=True,
        editable=False,
        help_text=_("The template's steps as they were when the run started."),
    )
    template_version = models.ForeignKey(
        TemplateVersion,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        editable=False,
        related_name="runs",
        help_text=_(
            "The version the plan was taken from (empty: a canvas command, or a run from before versions)."
        ),
        verbose_name=_("template version"),
    )
    status = models.CharField(
        _("status"), max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING
    )
    cursor = models.PositiveSmallIntegerField(_("cursor"), default=0)
    trigger = models.CharField(_("trigger"), max_length=16, choices=Trigger.choices, default=Trigger.REST)
    triggered_by = models.CharField(_("triggered by"), max_length=150, blank=True)
    priority = models.SmallIntegerField(
        _("priority"), default=5, validators=[MinValueValidator(0), MaxValueValidator(9)]
    )
    idempotency_key = models.CharField(
        _("idempotency key"), max_length=200, null=True, blank=True, unique=True
    )
    retry_of = models.OneToOneField(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="retried_as",
        help_text=_("The failed run this run retries from its failed step."),
        verbose_name=_("retry of"),
    )
    error = models.TextField(_("error"), blank=True)
    max_duration = models.PositiveIntegerField(
        _("max duration"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("From its template version: seconds from start."),
    )
    deadline = models.DateTimeField(
        _("deadline"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("started_at + max_duration: then it times out."),
    )
    # Time windows: when the run may start, when it must end, what ends then, and the
    # maintenance windows that applied to it when it was created (jobs/timewindows.py).
    not_before = models.DateTimeField(
        _("start not before"), null=True, blank=True, help_text=_("The run stays pending until then.")
    )
    end_by = models.DateTimeField(
        _("end by"), null=True, blank=True, help_text=_("Then the end behaviour decides what still runs.")
    )
    end_behaviour = models.CharField(
        _("end behaviour"),
        max_length=8,
        choices=EndBehaviour.choices,
        default=EndBehaviour.CANCEL,
        help_text=_(
            "At end by: cancel (the run is canceled: commands not sent are not sent, those at work "
            "are told to stop) or finish (commands at work finish, nothing new starts)."
        ),
    )
    windows = models.JSONField(
        _("maintenance windows"),
        default=list,
        blank=True,
        editable=False,
        help_text=_("The maintenance windows that applied when the run was created."),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)

    class Meta:
        verbose_name = _("job run")
        verbose_name_plural = _("job runs")
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
    PENDING = "pending", _("Pending")
    QUEUED = "queued", _("Queued")
    DISPATCHED = "dispatched", _("Dispatched")
    IN_PROGRESS = "in_progress", _("In Progress")
    RETRYING = "retrying", _("Retrying")
    SUCCEEDED = "succeeded", _("Succeeded")
    FAILED = "failed", _("Failed")
    # The device refused the command (protocol v1.1 `"status": "rejected"`): never retried.
    REJECTED = "rejected", _("Rejected")
    TIMED_OUT = "timed_out", _("Timed Out")
    CANCELED = "canceled", _("Canceled")
    SKIPPED = "skipped", _("Skipped")


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
    FORWARD = "forward", _("Forward")
    COMPENSATION = "compensation", _("Compensation")


class StepRun(models.Model):
    """One step of one run on one device; the committed row is the command's outbox entry.

    A fan-out step has one row per device; a compensation (rollback) has its own row in
    the compensation phase, with the index of the step it undoes.
    """

    run = models.ForeignKey(JobRun, on_delete=models.CASCADE, related_name="step_runs", verbose_name=_("run"))
    index = models.PositiveSmallIntegerField(
        _("index"), help_text=_("Position of the step in the run, from 0.")
    )
    phase = models.CharField(_("phase"), max_length=16, choices=Phase.choices, default=Phase.FORWARD)
    device = models.ForeignKey(
        Device,
        on_delete=models.PROTECT,
        related_name="step_runs",
        null=True,
        blank=True,
        verbose_name=_("device"),
    )
    action = models.CharField(_("action"), max_length=128)
    args = models.JSONField(_("args"), default=dict, blank=True)
    status = models.CharField(
        _("status"), max_length=16, choices=StepStatus.choices, default=StepStatus.PENDING
    )
    attempt = models.PositiveSmallIntegerField(_("attempt"), default=0)
    command_id = models.CharField(_("command id"), max_length=64, null=True, blank=True, unique=True)
    fence = models.BigIntegerField(
        _("fence"), null=True, blank=True, help_text=_("Lock fencing token of the current attempt.")
    )
    deadline = models.DateTimeField(_("deadline"), null=True, blank=True)
    progress = models.PositiveSmallIntegerField(_("progress"), null=True, blank=True)
    # What the device said last and how often: progress of an attempt is kept here, and
    # only its first few messages are also timeline events (jobs/engine/progress.py).
    progress_detail = models.CharField(
        _("progress detail"),
        max_length=500,
        blank=True,
        help_text=_("The latest progress detail of the current attempt."),
    )
    progress_messages = models.PositiveIntegerField(
        _("progress messages"), default=0, help_text=_("Progress messages received for the current attempt.")
    )
    result = models.JSONField(_("result"), null=True, blank=True)
    error = models.TextField(_("error"), blank=True)
    queued_at = models.DateTimeField(_("queued at"), null=True, blank=True)
    dispatched_at = models.DateTimeField(_("dispatched at"), null=True, blank=True)
    acked_at = models.DateTimeField(_("acked at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    # Waves with gates: the wave of a fan-out row (from 0); the pump starts open waves only.
    wave = models.PositiveSmallIntegerField(_("wave"), default=0)

    class Meta:
        verbose_name = _("step run")
        verbose_name_plural = _("step runs")
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
            # A fan-out step's rows by status, in id order: its pump takes the next pending
            # rows and checks for rows at work without reading the step's other rows.
            models.Index(fields=["run", "phase", "index", "status", "id"], name="steprun_step_status"),
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


class Rollout(models.Model):
    """Where a fan-out step in waves stands (jobs/engine/waves.py): its open wave, its state
    and who decided last. Written under the run's row lock, so two workers never both decide."""

    run = models.ForeignKey(JobRun, on_delete=models.CASCADE, related_name="rollouts", verbose_name=_("run"))
    index = models.PositiveSmallIntegerField(
        _("index"), help_text=_("Position of the step in the run, from 0.")
    )
    waves = models.JSONField(
        _("waves"), default=list, help_text=_("The waves as expanded: size, label, condition, gate.")
    )
    wave = models.PositiveSmallIntegerField(_("wave"), default=0, help_text=_("The open wave, from 0."))
    wave_checked = models.BooleanField(
        _("wave checked"), default=False, help_text=_("The open wave ended and its condition was checked.")
    )
    state = models.CharField(
        _("state"), max_length=24, choices=RolloutState.choices, default=RolloutState.RUNNING
    )
    reason = models.CharField(_("reason"), max_length=500, blank=True)
    decided_by = models.CharField(_("decided by"), max_length=150, blank=True)
    soak_until = models.DateTimeField(_("soak until"), null=True, blank=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("rollout")
        verbose_name_plural = _("rollouts")
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="rollout_unique_run_index")]
        # The monitor's sweep of soaks and webhook gates whose Redis trace was lost (gaps).
        indexes = [models.Index(fields=["state", "updated_at"], name="rollout_state_updated")]

    def __str__(self) -> str:
        return (
            f"{str(self.run_id)[:8]} step {self.index}: wave {self.wave + 1}/{len(self.waves)} {self.state}"
        )


class RunEvent(models.Model):
    """Append-only audit timeline: every transition, and every message dropped or ignored.

    Events about messages that match no run (unknown command id, malformed payload) have
    no run; they carry the device name and topic instead.
    """

    run = models.ForeignKey(
        JobRun, on_delete=models.CASCADE, null=True, blank=True, related_name="events", verbose_name=_("run")
    )
    step_run = models.ForeignKey(
        StepRun,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="events",
        verbose_name=_("step run"),
    )
    kind = models.CharField(
        _("kind"), max_length=48, db_index=True, help_text=_("e.g. step.dispatched, reply.stale")
    )
    device = models.CharField(_("device"), max_length=128, blank=True)
    message = models.TextField(_("message"), blank=True)
    data = models.JSONField(_("data"), default=dict, blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True, db_index=True)

    class Meta:
        verbose_name = _("run event")
        verbose_name_plural = _("run events")
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

    run = models.OneToOneField(
        JobRun, on_delete=models.CASCADE, related_name="canvas_link", primary_key=True, verbose_name=_("run")
    )
    task_id = models.CharField(_("task id"), max_length=255, unique=True)
    request = models.JSONField(_("request"), default=dict)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    resumed_at = models.DateTimeField(_("resumed at"), null=True, blank=True)

    class Meta:
        verbose_name = _("canvas link")
        verbose_name_plural = _("canvas links")

    def __str__(self) -> str:
        return f"canvas link {self.task_id}"


class ContinuousFanout(models.Model):
    """A continuous fan-out step of a run while it is open, and how it closed.

    Open while `closed_at` is empty: devices that come to match the step's target then get
    a row too (jobs/engine/continuous.py). At most one per step; the row stays as a record.
    """

    run = models.ForeignKey(
        JobRun, on_delete=models.CASCADE, related_name="continuous_fanouts", verbose_name=_("run")
    )
    index = models.PositiveSmallIntegerField(_("index"))
    opened_at = models.DateTimeField(_("opened at"), auto_now_add=True)
    closes_at = models.DateTimeField(
        _("closes at"), null=True, blank=True, help_text=_("Its end-by; empty: it is closed by hand.")
    )
    closed_at = models.DateTimeField(_("closed at"), null=True, blank=True)
    closed_by = models.CharField(_("closed by"), max_length=150, blank=True)

    class Meta:
        verbose_name = _("continuous fan-out")
        verbose_name_plural = _("continuous fan-outs")
        constraints = [
            models.UniqueConstraint(fields=["run", "index"], name="continuousfanout_unique_step"),
        ]
        indexes = [
            # "Is any fan-out open?" is asked for every presence batch and device change.
            models.Index(fields=["closed_at"], name="continuousfanout_closed"),
        ]

    def __str__(self) -> str:
        return f"{str(self.run_id)[:8]} step {self.index} ({'closed' if self.closed_at else 'open'})"

    @property
    def is_open(self) -> bool:
        return self.closed_at is None


# Shared concurrency limits (issue 36 point 6): at most N commands per label value, across runs.
class LimitScope(models.TextChoices):
    ALL = "all", _("all commands")
    ACTION = "action", _("an action")
    PREFIX = "prefix", _("actions starting with")
    TEMPLATE = "template", _("a template's commands")


class ConcurrencyLimit(models.Model):
    """At most `max_concurrent` of the commands it applies to in flight at once per value of
    a device label (e.g. 3 `firmware/download` per `site`), across every run and worker:
    the others wait, by priority then arrival (jobs/limits.py, devices/locks.py slots)."""

    name = models.CharField(
        _("name"),
        max_length=64,
        unique=True,
        help_text=_("The limit's name, as the waiting reasons and events say it."),
        validators=[
            RegexValidator(r"\A[A-Za-z0-9._-]+\Z", _("Use letters, digits and . _ - only."), code="invalid")
        ],
    )
    label = models.CharField(
        _("label key"),
        max_length=64,
        help_text=_("The device label whose value the limit counts per, e.g. site."),
    )
    max_concurrent = models.PositiveIntegerField(
        _("max concurrent"),
        validators=[MinValueValidator(1)],
        help_text=_("How many of its commands may be in flight at once per label value."),
    )
    applies_to = models.CharField(
        _("applies to"), max_length=16, choices=LimitScope.choices, default=LimitScope.ACTION
    )
    match = models.CharField(
        _("match"),
        max_length=128,
        blank=True,
        help_text=_(
            "The action, the action prefix or the template name it applies to; empty for all commands."
        ),
    )
    enabled = models.BooleanField(_("enabled"), default=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("concurrency limit")
        verbose_name_plural = _("concurrency limits")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.applies_to != LimitScope.ALL and not self.match:
            raise ValidationError({"match": _("Say which action, prefix or template the limit applies to.")})
        if self.applies_to == LimitScope.ALL and self.match:
            raise ValidationError(
                {"match": _("A limit on all commands matches nothing more: leave it empty.")}
            )
        if self.label and not self.label.strip():
            raise ValidationError({"label": _("Name a device label key.")})
