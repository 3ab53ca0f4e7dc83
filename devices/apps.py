from django.apps import AppConfig


class DevicesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "devices"

    def ready(self) -> None:
        from iotqueue.bridge import handler_register

        from . import presence, protocol

        for kind in protocol.PRESENCE_KINDS:
            handler_register(protocol.device_topic("+", kind), presence.presence_message_handle)
