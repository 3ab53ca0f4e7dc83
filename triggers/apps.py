"""The triggers app: beat schedules and MQTT trigger rules that start runs."""

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class TriggersConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "triggers"
    verbose_name = _("Triggers")

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from devices.topic_claims import topic_listeners_register
        from iotqueue.bridge import dynamic_topics_register
        from jobs.events import run_ended

        from . import rules, schedules, validation
        from .models import Schedule

        dynamic_topics_register(rules.rule_topics)
        # A device's topic override may not take a topic a rule listens on (devices/topic_claims.py).
        topic_listeners_register("trigger rule", validation.rule_listened_topics)
        run_ended.connect(schedules.run_ended, dispatch_uid="triggers.run_ended")
        post_delete.connect(
            schedules.schedule_deleted, sender=Schedule, dispatch_uid="triggers.schedule_deleted"
        )
