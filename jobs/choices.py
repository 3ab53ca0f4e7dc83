"""The step choices that both the models and the template checks (jobs/validation.py) use.

A module of its own so validation can name step kinds without importing jobs.models
(models sit below the domain code). `jobs.models` re-exports both classes.
"""

from django.db import models


class OnFailure(models.TextChoices):
    ABORT = "abort", "Abort the run"
    CONTINUE = "continue", "Continue with the next step"
    ROLLBACK = "rollback", "Roll back completed steps"


class StepKind(models.TextChoices):
    COMMAND = "command", "Send a command"
    DELAY = "delay", "Wait a number of seconds"
    WAIT_ONLINE = "wait_online", "Wait until the device is online"
