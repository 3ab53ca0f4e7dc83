"""The Celery application; tasks are discovered in each app's tasks.py."""

import os
from functools import cached_property

from celery import Celery
from celery.apps.beat import Beat
from celery.signals import (
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
)
from django.conf import settings

from . import kombu_fix
from .gcfreeze import startup_objects_freeze

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "iotqueue.settings")

kombu_fix.apply()


class CheckedBeat(Beat):
    """`celery beat` that checks the database and Redis first (iotqueue/startup.py; beat does
    not use MQTT), failing in one line with exit status 1. Before the scheduler is made:
    the database scheduler reads its tables as it is made, so the `beat_init` signal comes
    too late for an unmigrated database."""

    def start_scheduler(self) -> None:
        from .startup import BEAT_CHECKS, startup_check_or_exit

        startup_check_or_exit("beat", BEAT_CHECKS)
        super().start_scheduler()


class IotqueueCelery(Celery):
    @cached_property
    def Beat(self):
        return self.subclass_with_self(CheckedBeat)


app = IotqueueCelery("iotqueue")


@app.on_configure.connect
def _settings_load(sender, **kwargs) -> None:
    """Just before Celery first reads its configuration from Django's settings: settings
    that fail closed (no SECRET_KEY or ALLOWED_HOSTS without DEBUG) end a `celery` command
    in one line and exit status 1, not in a traceback (iotqueue/startup.py). Named after
    the command (`worker: ...`, `beat: ...`) when Celery's command line is reading it."""
    import click

    from .startup import settings_load_or_exit

    command = click.get_current_context(silent=True)
    settings_load_or_exit(command.info_name if command else "celery")


app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _worker_startup_check(**kwargs) -> None:
    """Before the worker connects to anything: the database migrated, Redis and the MQTT
    broker reachable, else one line and exit status 1 (iotqueue/startup.py)."""
    from .startup import WORKER_CHECKS, startup_check_or_exit

    startup_check_or_exit("worker", WORKER_CHECKS)


@worker_process_init.connect
def _pool_process_init(**kwargs) -> None:
    """Connect each pool process's MQTT publisher at start, not on its first command; then
    take its start-up objects, the publisher's client included, out of its full garbage
    collections (iotqueue/gcfreeze.py)."""
    from .mqtt import publisher

    publisher.connect()
    startup_objects_freeze("worker process")


@worker_ready.connect
def _main_process_freeze(**kwargs) -> None:
    """The same for the worker's main process (it receives and hands out the tasks)."""
    startup_objects_freeze("worker")


@worker_process_shutdown.connect
def _publisher_close(**kwargs) -> None:
    from .mqtt import publisher

    publisher.close()


@task_prerun.connect
def _database_connection_check(**kwargs) -> None:
    """With connection reuse on, drop a connection that broke or outlived CONN_MAX_AGE."""
    from django.db import close_old_connections

    close_old_connections()


def io_route(name, args, kwargs, options, task=None, **kw) -> dict | None:
    """Celery router (CELERY_TASK_ROUTES): the tasks that wait on HTTP or SMTP go to the io
    queue (IOTQUEUE_IO_QUEUE), every other task to the default (engine) queue."""
    if name in settings.IOTQUEUE_IO_TASKS:
        return {"queue": settings.IOTQUEUE_IO_QUEUE}
    return None
