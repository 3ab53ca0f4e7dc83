from django.apps import AppConfig


class DevicesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "devices"

    def ready(self) -> None:
        from iotqueue.bridge import handler_register
        from iotqueue.metrics import DEVICE_QUEUE_DEPTH, gauge_register

        from . import presence, protocol, task_lock
        from .locks import grant_handler_register

        for kind in protocol.PRESENCE_KINDS:
            handler_register(protocol.device_topic("+", kind), presence.presence_message_handle)
        # A lock released to a parked locked task sends that task again (devices/task_lock.py).
        grant_handler_register(task_lock.HOLDER_KIND, task_lock.task_handoff)
        # /metrics lists the wait queue of every device that has one (devices/locks.py).
        gauge_register(DEVICE_QUEUE_DEPTH, _queue_depths)


def _queue_depths() -> dict[tuple[str], int]:
    from .locks import device_queue_depths

    return {(device,): depth for device, depth in device_queue_depths().items()}
