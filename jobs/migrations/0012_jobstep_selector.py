from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0011_merge")]

    operations = [
        migrations.AddField(
            model_name="jobstep",
            name="selector",
            field=models.CharField(
                blank=True,
                help_text="Fan out to every enabled device a label selector matches when the step starts, "
                "e.g. site in (berlin,paris),!legacy.",
                max_length=1024,
            ),
        ),
    ]
