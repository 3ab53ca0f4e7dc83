"""Celery tasks of the webhooks app: thin entry points taking ids and JSON values."""

from __future__ import annotations

from typing import Any

from celery import current_app, shared_task
from django.db import DatabaseError
from redis.exceptions import RedisError

from . import delivery, gates, mail, outbox

# Mail goes through an SMTP server that may be away for a moment.
MAIL_RETRIES = 3
MAIL_RETRY_SECONDS = 30


@shared_task(
    name=outbox.EVENTS_OUT_TASK,
    autoretry_for=(DatabaseError, RedisError),
    default_retry_delay=1.0,
    max_retries=10,
)
def events_out_task(events: list[dict[str, Any]] | None = None) -> int:
    """Send out the run events waiting in the outbox; or `events`, as a message queued
    before the outbox existed carries them."""
    if events:
        outbox.events_out(events=events)
        return len(events)
    return outbox.events_out_drain()


@shared_task(name=outbox.DELIVER_TASK)
def deliver_task(delivery_id: int, attempt: int = 1) -> None:
    wait = delivery.delivery_attempt(delivery_id=delivery_id, attempt=attempt)
    if wait is not None:
        current_app.signature(
            outbox.DELIVER_TASK, kwargs={"delivery_id": delivery_id, "attempt": attempt + 1}
        ).apply_async(countdown=wait)


@shared_task(
    name=outbox.FAILED_RUN_MAIL_TASK,
    autoretry_for=(OSError,),
    max_retries=MAIL_RETRIES,
    default_retry_delay=MAIL_RETRY_SECONDS,
)
def failed_run_mail_task(event: dict[str, Any]) -> None:
    mail.failed_run_mail_send(event=event)


@shared_task(
    name=gates.WAVE_GATE_TASK, autoretry_for=(DatabaseError,), default_retry_delay=1.0, max_retries=10
)
def wave_gate_task(run_id: str, index: int, wave: int) -> None:
    gates.wave_gate_ask(run_id=run_id, index=index, wave=wave)
