"""The step choices that both the models and the template checks (jobs/validation.py) use.

A module of its own so validation can name step kinds without importing jobs.models
(models sit below the domain code). `jobs.models` re-exports both classes.
"""

from django.db import models


class OnFailure(models.TextChoices):
    ABORT = "abort", "Abort the run"
    CONTINUE = "continue", "Continue with the next step"
    ROLLBACK = "rollback", "Roll back completed steps"


class RolloutIncrementOn(models.TextChoices):
    SUCCEEDED = "succeeded", "Devices that succeeded"
    NOTIFIED = "notified", "Devices that were sent the command"


class AbortCause(models.TextChoices):
    FAILED = "failed", "Failed"
    REJECTED = "rejected", "Rejected by the device"
    TIMED_OUT = "timed_out", "Timed out"
    ANY = "any", "Any of these"


class StepKind(models.TextChoices):
    COMMAND = "command", "Send a command"
    DELAY = "delay", "Wait a number of seconds"
    WAIT_ONLINE = "wait_online", "Wait until the device is online"
    TASK = "task", "Run a registered Celery task"


# How far past its timeout a device may push an attempt by default (progress extend_seconds):
# an hour covers a slow firmware flash, while a device stuck in a loop of extensions still
# times out within the hour.
DEFAULT_MAX_EXTEND_SECONDS = 3600

# The largest rollout increment factor: AWS IoT Jobs' exponentialRate allows 1.1 to 5; past
# that a ramp reaches any fleet size within a couple of step-ups and is no ramp at all.
MAX_INCREMENT_FACTOR = 5.0
