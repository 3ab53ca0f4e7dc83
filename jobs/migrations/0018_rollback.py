# Rollback on abort (issue 36, item 4): the pace of a fan-out's compensation.

from django.db import migrations, models

# The step field this migration adds, with its default: written into the recorded versions'
# steps too, so a template whose steps did not change records no new version on its next
# run merely because its latest version predates the field (as 0012_rollout_by_cause does).
STEP_DEFAULTS = {"compensation_per_minute": 0}


def versions_fill(apps, schema_editor):
    TemplateVersion = apps.get_model("jobs", "TemplateVersion")
    for version in TemplateVersion.objects.all().iterator():
        steps = [{**STEP_DEFAULTS, **step} for step in version.steps]
        if steps != version.steps:
            TemplateVersion.objects.filter(pk=version.pk).update(steps=steps)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0017_preempt")]

    operations = [
        migrations.AddField(
            model_name="jobstep",
            name="compensation_per_minute",
            field=models.PositiveIntegerField(
                default=0,
                help_text="Fan-out rolled back (on_failure rollback): devices whose compensation starts "
                "per minute; 0 = no limit.",
                verbose_name="compensation per minute",
            ),
        ),
        migrations.RunPython(versions_fill, migrations.RunPython.noop),
    ]
