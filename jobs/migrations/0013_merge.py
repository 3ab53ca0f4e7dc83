# Joins the two migrations written side by side on 0011: label selectors and rollouts by cause.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("jobs", "0012_jobstep_selector"), ("jobs", "0012_rollout_by_cause")]

    operations = []
