"""Schedules (beat-driven runs) and MQTT trigger rules: what starts a run without a caller."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from django_celery_beat.models import PeriodicTask

from iotqueue.names import url_name_validator
from jobs.models import JobRun, JobTemplate, TemplateVersion

PRIORITY_VALIDATORS = [MinValueValidator(0), MaxValueValidator(9)]
# A new rule's limits: a sensor reporting once a second stays within them, a flood (or a
# publisher in a loop) is cut off after a minute's worth of runs. Raise them per rule.
RULE_RUNS_PER_MINUTE_DEFAULT = 60
RULE_ACTIVE_RUNS_DEFAULT = 10


TEMPLATE_VERSION_HELP = _("empty: the template as it is when a run starts; else always this version")


def template_version_field() -> models.ForeignKey:
    """The optional pin of a schedule or rule to one version of its template.

    PROTECT: a pinned version going away must not silently turn the pin into "current".
    """
    return models.ForeignKey(
        TemplateVersion,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("template version"),
        help_text=TEMPLATE_VERSION_HELP,
    )


def template_version_problem(template_id: int | None, version: TemplateVersion | None) -> str | None:
    """Why `version` cannot be the pin of something starting template `template_id`, or None."""
    if version is None or template_id is None or version.template_id == template_id:
        return None
    template = JobTemplate.objects.filter(pk=template_id).values_list("name", flat=True).first()
    return gettext("version %(number)d belongs to template '%(other)s', not '%(template)s'") % {
        "number": version.number,
        "other": version.template.name,
        "template": template,
    }


def template_version_clean(instance: Schedule | TriggerRule) -> None:
    """Model.clean of both: the pinned version must be one of the template's own."""
    problem = template_version_problem(instance.template_id, instance.template_version)
    if problem:
        raise ValidationError({"template_version": problem})


def pinned_version_number(starter: Schedule | TriggerRule) -> int | None:
    """The version number run_start gets: the pin, or None (the template as it is now)."""
    return starter.template_version.number if starter.template_version_id else None


class Overlap(models.TextChoices):
    SKIP = "skip", _("Skip the fire while the previous run is active")
    QUEUE = "queue", _("Start after the previous run ends (at most one waiting)")
    ALLOW = "allow", _("Start regardless (runs may overlap)")


class Schedule(models.Model):
    """A template started by beat, every N seconds or on a crontab in a timezone.

    The schedule owns one django-celery-beat PeriodicTask (`triggers.schedules.schedule_save`
    creates and updates it); beat fires `triggers.schedule_fire`, which applies the overlap
    policy and starts the run.
    """

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[url_name_validator])
    template = models.ForeignKey(
        JobTemplate, on_delete=models.PROTECT, related_name="schedules", verbose_name=_("template")
    )
    template_version = template_version_field()
    parameters = models.JSONField(_("parameters"), default=dict, blank=True)
    priority = models.SmallIntegerField(
        _("priority"),
        null=True,
        blank=True,
        validators=PRIORITY_VALIDATORS,
        help_text=_("empty: the template's default"),
    )
    interval_seconds = models.PositiveIntegerField(
        _("interval seconds"),
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=_("fire every N seconds"),
    )
    crontab = models.CharField(
        _("crontab"),
        max_length=200,
        blank=True,
        help_text=_('"minute hour day-of-month month day-of-week", e.g. "0 2 * * *"'),
    )
    timezone = models.CharField(
        _("timezone"), max_length=64, default="UTC", help_text=_("of the crontab, e.g. Europe/Berlin")
    )
    enabled = models.BooleanField(_("enabled"), default=True)
    overlap = models.CharField(_("overlap"), max_length=8, choices=Overlap.choices, default=Overlap.SKIP)
    periodic_task = models.OneToOneField(
        PeriodicTask,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.SET_NULL,
        related_name="+",
        verbose_name=_("periodic task"),
    )
    # Written by the fire task only (queryset updates, never save()).
    fire_count = models.PositiveIntegerField(_("fire count"), default=0, editable=False)
    last_fired_at = models.DateTimeField(_("last fired at"), null=True, blank=True, editable=False)
    queued_fire = models.PositiveIntegerField(
        _("queued fire"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("a fire waiting for the active run (overlap=queue)"),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        template_version_clean(self)

    @property
    def when(self) -> str:
        """The schedule in words: "every 30 s" or "0 2 * * * Europe/Berlin"."""
        if self.interval_seconds:
            return _("every %(seconds)d s") % {"seconds": self.interval_seconds}
        return f"{self.crontab} {self.timezone}" if self.crontab else "-"


class ScheduledRun(models.Model):
    """Which schedule (and which of its fires) started a run; the overlap policy reads it."""

    schedule = models.ForeignKey(
        Schedule, on_delete=models.CASCADE, related_name="scheduled_runs", verbose_name=_("schedule")
    )
    run = models.OneToOneField(
        JobRun, on_delete=models.CASCADE, related_name="scheduled_run", verbose_name=_("run")
    )
    fire = models.PositiveIntegerField(
        _("fire"),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("scheduled run")
        verbose_name_plural = _("scheduled runs")
        ordering = ["-id"]
        indexes = [models.Index(fields=["schedule", "-id"], name="scheduledrun_schedule_id")]

    def __str__(self) -> str:
        return f"{self.schedule.name} fire {self.fire}"


class TriggerRule(models.Model):
    """An MQTT topic filter that starts a template, with parameters taken from the message.

    `parameters` and `idempotency_key` may reference `{{ topic.N }}` (the N-th topic level,
    from 0) and `{{ message.path }}` (a field of the JSON object payload); see
    docs/triggers.md.
    """

    name = models.CharField(_("name"), max_length=128, unique=True, validators=[url_name_validator])
    topic_filter = models.CharField(
        _("topic filter"),
        max_length=512,
        help_text=_("absolute MQTT filter, + and # allowed, e.g. site/+/door/+/opened"),
    )
    template = models.ForeignKey(
        JobTemplate, on_delete=models.PROTECT, related_name="trigger_rules", verbose_name=_("template")
    )
    template_version = template_version_field()
    parameters = models.JSONField(
        _("parameters"),
        default=dict,
        blank=True,
        help_text=_('e.g. {"door": "{{ topic.3 }}", "badge": "{{ message.badge }}"}'),
    )
    idempotency_key = models.CharField(
        _("idempotency key"),
        max_length=200,
        blank=True,
        help_text=_("dedupe: messages rendering the same key start one run, e.g. {{ message.event_id }}"),
    )
    priority = models.SmallIntegerField(
        _("priority"),
        null=True,
        blank=True,
        validators=PRIORITY_VALIDATORS,
        help_text=_("empty: the template's default"),
    )
    enabled = models.BooleanField(_("enabled"), default=True)
    max_runs_per_minute = models.PositiveIntegerField(
        _("max runs per minute"),
        default=RULE_RUNS_PER_MINUTE_DEFAULT,
        validators=[MinValueValidator(1)],
        help_text=_("matching messages acted on in any 60 s (all bridges together); more are dropped"),
    )
    max_active_runs = models.PositiveIntegerField(
        _("max active runs"),
        default=RULE_ACTIVE_RUNS_DEFAULT,
        validators=[MinValueValidator(1)],
        help_text=_("runs of this rule that have not ended; a message beyond it is dropped"),
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("trigger rule")
        verbose_name_plural = _("trigger rules")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        template_version_clean(self)


class TriggeredRun(models.Model):
    """Which rule started a run; the rule's cap on active runs counts these."""

    rule = models.ForeignKey(
        TriggerRule, on_delete=models.CASCADE, related_name="triggered_runs", verbose_name=_("rule")
    )
    run = models.OneToOneField(
        JobRun, on_delete=models.CASCADE, related_name="triggered_run", verbose_name=_("run")
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("triggered run")
        verbose_name_plural = _("triggered runs")
        ordering = ["-id"]
        indexes = [models.Index(fields=["rule", "-id"], name="triggeredrun_rule_id")]

    def __str__(self) -> str:
        return f"{self.rule.name} run {self.run_id}"
