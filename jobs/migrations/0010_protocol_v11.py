# Protocol v1.1: a per-step bound on deadline extensions, and the step outcome `rejected`.

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_jobstep_kind_task"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobstep",
            name="max_extend_seconds",
            field=models.PositiveIntegerField(
                default=3600,
                help_text="How far past its timeout a device may push an attempt's deadline (progress extend_seconds); 0 = never.",
                validators=[django.core.validators.MaxValueValidator(604800)],
            ),
        ),
        migrations.AlterField(
            model_name="steprun",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("queued", "Queued"),
                    ("dispatched", "Dispatched"),
                    ("in_progress", "In Progress"),
                    ("retrying", "Retrying"),
                    ("succeeded", "Succeeded"),
                    ("failed", "Failed"),
                    ("rejected", "Rejected"),
                    ("timed_out", "Timed Out"),
                    ("canceled", "Canceled"),
                    ("skipped", "Skipped"),
                ],
                default="pending",
                max_length=16,
            ),
        ),
    ]
