"""Workaround for a kombu 5.7 / Celery 5.7 crash when Redis drops the broker connection.

After a connection loss the worker still holds channels of the dead connection: closing
them re-queues unacknowledged messages, and acking a task that finished meanwhile goes
through them too. Both build a new Redis pool from a connection that is already gone and
raise AttributeError ('NoneType' object has no attribute 'hostname'), which Celery treats
as unrecoverable: the worker stops consuming and hangs. Here such a channel raises a Redis
ConnectionError instead, which kombu and Celery handle as the connection error it is; the
affected messages come back after the broker's visibility timeout (the engine's monitor
rescues their steps sooner). Remove when kombu handles it.

`_connparams` is private: the import checks that the installed kombu is the version this was
written for (iotqueue/private_api.py).
"""

import redis
from kombu.transport import redis as kombu_redis

from .private_api import private_api_check

WRITTEN_FOR = ("kombu", "5.7.0")

private_api_check(
    WRITTEN_FOR, owner=kombu_redis.Channel, attributes=("_connparams",), where="iotqueue/kombu_fix.py"
)

_connparams = kombu_redis.Channel._connparams


def _connparams_of_live_connection(self, *args, **kwargs):
    if self.connection.client is None:
        raise redis.exceptions.ConnectionError("broker connection already closed")
    return _connparams(self, *args, **kwargs)


def apply() -> None:
    kombu_redis.Channel._connparams = _connparams_of_live_connection
