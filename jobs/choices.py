"""The step choices that both the models and the template checks (jobs/validation.py) use.

A module of its own so validation can name step kinds without importing jobs.models
(models sit below the domain code). `jobs.models` re-exports both classes.
"""

from django.db import models
from django.utils.translation import gettext_lazy as _


class OnFailure(models.TextChoices):
    ABORT = "abort", _("Abort the run")
    CONTINUE = "continue", _("Continue with the next step")
    ROLLBACK = "rollback", _("Roll back completed steps")


class RolloutIncrementOn(models.TextChoices):
    SUCCEEDED = "succeeded", _("Devices that succeeded")
    NOTIFIED = "notified", _("Devices that were sent the command")


class AbortCause(models.TextChoices):
    FAILED = "failed", _("Failed")
    REJECTED = "rejected", _("Rejected by the device")
    TIMED_OUT = "timed_out", _("Timed out")
    ANY = "any", _("Any of these")


class DevicesFromOutcome(models.TextChoices):
    SUCCEEDED = "succeeded", _("Devices that succeeded")
    FAILED = "failed", _("Devices that failed, were rejected, timed out or were canceled")


# What later steps' references may read of a fan-out step beside its `result` (one
# device's): {{ steps.NAME.counts }} and the per-device values (jobs/engine/plan.py
# fanout_values reads them).
FANOUT_VALUES = ("results", "errors", "counts", "succeeded", "failed")


class StepKind(models.TextChoices):
    COMMAND = "command", _("Send a command")
    DELAY = "delay", _("Wait a number of seconds")
    WAIT_ONLINE = "wait_online", _("Wait until the device is online")
    TASK = "task", _("Run a registered Celery task")


# How far past its timeout a device may push an attempt by default (progress extend_seconds):
# an hour covers a slow firmware flash, while a device stuck in a loop of extensions still
# times out within the hour.
DEFAULT_MAX_EXTEND_SECONDS = 3600

# The largest rollout increment factor: AWS IoT Jobs' exponentialRate allows 1.1 to 5; past
# that a ramp reaches any fleet size within a couple of step-ups and is no ramp at all.
MAX_INCREMENT_FACTOR = 5.0
# A continuous fan-out's longest end-by: a year covers any rollout; a larger number is a typo
# (and, near the integer column's limit, past what a date can hold).
OPEN_SECONDS_MAX = 366 * 24 * 3600


# Waves with gates (jobs/engine/waves.py).
class WaveGate(models.TextChoices):
    AUTO = "auto", _("Go on by itself")
    APPROVAL = "approval", _("Wait for an operator's approval")
    WEBHOOK = "webhook", _("Ask a webhook")


class WaveOnFail(models.TextChoices):
    PAUSE = "pause", _("Pause the rollout")
    ABORT = "abort", _("Abort the rollout")


class RolloutState(models.TextChoices):
    RUNNING = "running", _("Running")
    SOAKING = "soaking", _("Soaking")
    AWAITING_APPROVAL = "awaiting_approval", _("Awaiting approval")
    AWAITING_WEBHOOK = "awaiting_webhook", _("Awaiting the webhook")
    PAUSED = "paused", _("Paused")
    ENDED = "ended", _("Ended")
