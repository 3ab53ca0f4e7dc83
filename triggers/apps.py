"""The triggers app: beat schedules and MQTT trigger rules that start runs."""

from django.apps import AppConfig


class TriggersConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "triggers"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from iotqueue.bridge import dynamic_topics_register
        from jobs.models import RunEvent

        from . import rules, schedules
        from .models import Schedule

        dynamic_topics_register(rules.rule_topics)
        post_save.connect(schedules.run_ended, sender=RunEvent, dispatch_uid="triggers.run_ended")
        post_delete.connect(
            schedules.schedule_deleted, sender=Schedule, dispatch_uid="triggers.schedule_deleted"
        )
