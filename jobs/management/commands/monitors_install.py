"""`manage.py monitors_install`: install the jobs app's periodic tasks in beat's table (idempotent)."""

from django.utils.translation import gettext as _
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from iotqueue.cli_language import LocalizedCommand
from jobs.beat import beat_entries


class Command(LocalizedCommand):
    help = "Create or update the beat entries the engine needs; re-running changes nothing."

    def handle(self, *args, **options):
        for name, entry in beat_entries().items():
            every = max(1, round(float(entry["schedule"])))
            seconds = IntervalSchedule.SECONDS
            interval, _created = IntervalSchedule.objects.get_or_create(every=every, period=seconds)
            task = PeriodicTask.objects.filter(name=name).first()
            if (
                task is not None
                and task.task == entry["task"]
                and task.interval_id == interval.pk
                and task.enabled
            ):
                self.stdout.write(_("%(name)s: up to date") % {"name": name})
                continue
            PeriodicTask.objects.update_or_create(
                name=name,
                defaults={"task": entry["task"], "interval": interval, "crontab": None, "enabled": True},
            )
            self.stdout.write(
                _("%(name)s: %(task)s every %(every)ss installed")
                % {"name": name, "task": entry["task"], "every": every}
            )
