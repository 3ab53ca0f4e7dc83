from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DevicesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "devices"
    verbose_name = _("Devices")

    def ready(self) -> None:
        from django.core import checks

        from iotqueue.bridge import handler_register
        from iotqueue.metrics import gauge_register

        from . import credentials, metrics, presence, protocol, task_lock, topic_claims
        from .locks import grant_handler_register

        # The topic prefix is a topic the broker accepts (devices/topic_claims.py).
        checks.register(topic_claims.topic_prefix_check)

        # Device rows keep their broker identities in step (devices/credentials.py).
        credentials.signals_connect()

        # Every bridge replica sees every status: it is retained, and brokers do not send
        # retained messages to shared subscriptions.
        handler_register(protocol.device_topic("+", "status"), presence.presence_message_handle, shared=False)
        handler_register(protocol.device_topic("+", "heartbeat"), presence.presence_message_handle)
        # A lock released to a parked locked task sends that task again (devices/task_lock.py).
        grant_handler_register(task_lock.HOLDER_KIND, task_lock.task_handoff)
        # /metrics lists the wait queue of every device that has one (devices/metrics.py).
        gauge_register(metrics.DEVICE_QUEUE_DEPTH, metrics.queue_depths_read)
