# Joins the two migrations written side by side on 0009: protocol v1.1 and template versions.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("jobs", "0010_protocol_v11"), ("jobs", "0010_template_versions")]

    operations = []
