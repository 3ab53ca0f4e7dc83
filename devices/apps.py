from django.apps import AppConfig


class DevicesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "devices"

    def ready(self) -> None:
        from iotqueue.bridge import handler_register

        from . import presence, protocol, task_lock
        from .locks import grant_handler_register

        for kind in protocol.PRESENCE_KINDS:
            handler_register(protocol.device_topic("+", kind), presence.presence_message_handle)
        # A lock released to a parked locked task sends that task again (devices/task_lock.py).
        grant_handler_register(task_lock.HOLDER_KIND, task_lock.task_handoff)
