# Rollouts that ramp and abort by cause, and a run-level max_duration (issue 14, item 3).
# Written by hand beside 0012_jobstep_selector; 0013_merge joins the two.

import django.core.validators
from django.db import migrations, models

# The step fields this migration adds, with their defaults: written into the recorded
# versions' steps too, so a template whose steps did not change records no new version on
# its next run merely because its latest version predates these fields.
STEP_DEFAULTS = {
    "abort_criteria": [],
    "rollout_increment_factor": 1.0,
    "rollout_increment_every": 0,
    "rollout_increment_on": "succeeded",
    "rollout_max_per_minute": 0,
}


def versions_fill(apps, schema_editor):
    TemplateVersion = apps.get_model("jobs", "TemplateVersion")
    for version in TemplateVersion.objects.all().iterator():
        steps = [{**STEP_DEFAULTS, **step} for step in version.steps]
        if steps != version.steps:
            TemplateVersion.objects.filter(pk=version.pk).update(steps=steps)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0011_merge")]

    operations = [
        migrations.AddField(
            model_name="jobstep",
            name="abort_criteria",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text='Abort by cause: a list of {"cause": "failed"|"rejected"|"timed_out"|"any", '
                '"threshold_percent": 0-100, "min_executed": N}.',
            ),
        ),
        migrations.AddField(
            model_name="jobstep",
            name="rollout_increment_factor",
            field=models.FloatField(
                default=1.0,
                help_text="Multiply the rollout rate by this at each step-up; 1 = a fixed rate.",
                validators=[
                    django.core.validators.MinValueValidator(1.0),
                    django.core.validators.MaxValueValidator(5.0),
                ],
            ),
        ),
        migrations.AddField(
            model_name="jobstep",
            name="rollout_increment_every",
            field=models.PositiveIntegerField(
                default=0,
                help_text="Step the rate up after each this many devices (see rollout_increment_on).",
            ),
        ),
        migrations.AddField(
            model_name="jobstep",
            name="rollout_increment_on",
            field=models.CharField(
                choices=[
                    ("succeeded", "Devices that succeeded"),
                    ("notified", "Devices that were sent the command"),
                ],
                default="succeeded",
                help_text="What counts towards a step-up: devices that succeeded, or that were notified.",
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="jobstep",
            name="rollout_max_per_minute",
            field=models.PositiveIntegerField(
                default=0, help_text="The ramp's maximum rate; 0 = no maximum."
            ),
        ),
        migrations.AddField(
            model_name="jobtemplate",
            name="max_duration",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Seconds a run may take from its start; past it the run ends timed_out and its "
                "in-flight commands are canceled. Empty: no limit.",
                null=True,
                validators=[django.core.validators.MinValueValidator(1)],
            ),
        ),
        migrations.AddField(
            model_name="templateversion",
            name="max_duration",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="jobrun",
            name="max_duration",
            field=models.PositiveIntegerField(
                blank=True,
                editable=False,
                help_text="From its template version: seconds from start.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="jobrun",
            name="deadline",
            field=models.DateTimeField(
                blank=True,
                editable=False,
                help_text="started_at + max_duration: then it times out.",
                null=True,
            ),
        ),
        migrations.RunPython(versions_fill, migrations.RunPython.noop),
    ]
