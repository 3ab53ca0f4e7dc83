from django.apps import AppConfig


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"

    def ready(self) -> None:
        from devices import protocol
        from devices.presence import device_presence_changed
        from iotqueue.bridge import dynamic_topics_register, handler_register

        from . import engine, replies  # noqa: F401  (engine registers its lock hand-off)

        for kind in protocol.REPLY_KINDS:
            handler_register(protocol.device_topic("+", kind), replies.reply_message_handle)
        dynamic_topics_register(replies.legacy_reply_topics)
        device_presence_changed.connect(_presence_changed, dispatch_uid="jobs.presence")


def _presence_changed(sender, *, name: str, online: bool, **kwargs) -> None:
    from .tasks import device_presence_task

    device_presence_task.delay(name, online)
