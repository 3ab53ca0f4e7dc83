from importlib import import_module

from celery import current_app
from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

# The modules that declare the step engine's kinds with jobs/engine/kinds.py's decorators:
# step kinds, row owners, failure policies, deadline kinds. `ready` imports them, then checks.
KIND_MODULES = (
    "jobs.engine.command",  # command
    "jobs.engine.waits",  # delay, wait_online (and its resume on presence); the `wake` deadline
    "jobs.engine.fanout",  # fan-out and its rows; the `pump` deadline
    "jobs.engine.fanout_progress",  # a fan-out's rows ending; the `soak` deadline (a wave's soak)
    "jobs.engine.continuous",  # the `fanout_close` deadline (a continuous fan-out's end-by)
    "jobs.engine.taskstep",  # task
    "jobs.engine.rollback",  # the rollback policy and its compensation rows
    "jobs.engine.fanout_rollback",  # a fan-out's rollback: a compensation row per device
    "jobs.engine.due",  # the deadlines of an attempt
    "jobs.cancel",  # the `run` deadline (max_duration)
    "jobs.run_windows",  # the `start` and `end` deadlines (a run's start-not-before, end-by)
)


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"
    verbose_name = _("Jobs")

    def ready(self) -> None:
        from devices import protocol, task_lock
        from devices.lock_recovery import (
            lease_expiry_register,
            rebuild_after_register,
            rebuild_source_register,
        )
        from devices.locks import grant_handler_register
        from devices.presence import devices_presence_changed
        from iotqueue.bridge import BRIDGE_MESSAGES, dynamic_topics_register, handler_register
        from iotqueue.budget import drop_sink_register
        from iotqueue.metrics import family_values_add

        # Importing metrics declares the app's /metrics families.
        from . import (
            beat,
            canvas,
            gauges,
            limits,
            metrics,
            replies,
            step_locks,
        )
        from .engine.batch import step_handoff
        from .engine.plan import HOLDER_KIND
        from .events import run_ended

        # Before anything can start a step: a kind declared twice or not at all stops the app.
        kinds_load()
        limits.limits_signals_connect()

        # The device lock starts, reclaims and rebuilds "step:" holders through these.
        grant_handler_register(HOLDER_KIND, step_handoff)
        lease_expiry_register(HOLDER_KIND, step_locks.step_lease_expired)
        # Other holders (a DeviceLockedTask) are passed on as without jobs, with an event.
        lease_expiry_register(task_lock.HOLDER_KIND, step_locks.step_lease_expired)
        rebuild_source_register(step_locks.step_lock_records)
        rebuild_after_register(step_locks.steps_after_rebuild)
        for kind in protocol.REPLY_KINDS:
            handler_register(protocol.device_topic("+", kind), replies.reply_message_handle)
        # Protocol v1.1: a device asks for its current command (jobs/current.py answers).
        handler_register(protocol.device_topic("+", protocol.JOBS_GET), replies.jobs_get_handle)
        dynamic_topics_register(replies.legacy_reply_topics)
        aws_jobs_register(handler_register)
        # The bridge reports what its handlers dropped here (from its run loop, a few rows a window).
        drop_sink_register(replies.dropped_summaries_record)
        # What the reply handlers and the engine decide about a message the bridge received.
        family_values_add(BRIDGE_MESSAGES, *metrics.BRIDGE_MESSAGE_KINDS)
        # /metrics reports runs, steps, the fleet, stuck runs, the inbox and the beat lease as they stand.
        gauges.gauges_register()
        devices_presence_changed.connect(_presence_changed, dispatch_uid="jobs.presence")
        # Devices that come to match an open continuous fan-out join it (jobs/engine/continuous.py).
        continuous_hooks_connect()
        # A canvas command's run ending sends its Celery canvas on (jobs/canvas.py).
        run_ended.connect(canvas.run_ended, dispatch_uid="jobs.canvas")
        # The monitor tick and retention, fired by beat (jobs/beat.py).
        beat.beat_entries_register(current_app)


# The modules that declare a device protocol's messages with devices/profiles.py's
# decorators; `aws_jobs_register` imports them, then checks every protocol has its builders.
PROFILE_MODULES = ("jobs.aws_executions",)


def aws_jobs_register(handler_register) -> None:
    """The AWS IoT Jobs device profile: its requests reach jobs/aws_requests.py through the
    bridge, and its messages are built where PROFILE_MODULES declare them (devices/profiles.py)."""
    from devices import aws_jobs
    from devices.profiles import profiles_check

    from . import aws_requests

    for module in PROFILE_MODULES:
        import_module(module)
    profiles_check()

    for topic_filter in aws_jobs.request_filters():
        # Outside the shared group: Mosquitto (2.0.11 here) delivers no $-topic to a $share/
        # subscription. Each replica then hands on every request; the worker answers the
        # first copy only (aws_requests.request_first_copy).
        handler_register(topic_filter, aws_requests.aws_request_handle, shared=False)


def kinds_load() -> None:
    """Import the modules that declare the engine's kinds, then check every kind is declared
    once; raises ImproperlyConfigured naming what is missing or doubled (the app does not load)."""
    from .engine.kinds import kinds_check

    for module in KIND_MODULES:
        import_module(module)
    kinds_check()


def continuous_hooks_connect() -> None:
    """Device saves, group changes and bulk label edits tell open continuous fan-outs
    (after the commit, and only while one is open: jobs/engine/continuous.py)."""
    from django.db.models.signals import m2m_changed, post_save

    from devices.labels import devices_labels_changed
    from devices.models import Device

    from .engine import continuous
    from .events import run_ended

    post_save.connect(continuous.device_saved, sender=Device, dispatch_uid="jobs.continuous.saved")
    m2m_changed.connect(
        continuous.device_groups_changed, sender=Device.groups.through, dispatch_uid="jobs.continuous.groups"
    )
    devices_labels_changed.connect(continuous.devices_relabelled, dispatch_uid="jobs.continuous.labels")
    # A run that ends while its continuous fan-out is open closes it (runs with one only).
    run_ended.connect(continuous.run_ended, dispatch_uid="jobs.continuous.run_ended")


# The task that lets runs react to devices' presence (jobs/tasks.py), by name.
PRESENCE_TASK = "jobs.devices_presence"


def _presence_changed(sender, *, changes: list[tuple[str, bool]], **kwargs) -> None:
    """One task for a presence group's changes ([[name, online], ...]), however many devices."""
    shown = ", ".join(f"{name}:{'online' if online else 'offline'}" for name, online in changes[:3])
    more = f", +{len(changes) - 3}" if len(changes) > 3 else ""
    argsrepr = f"devices=[{shown}{more}]"
    current_app.signature(PRESENCE_TASK, args=([list(change) for change in changes],)).apply_async(
        argsrepr=argsrepr
    )
