"""Celery tasks: thin entry points that take ids and JSON values and call the engine."""

from celery import shared_task

from devices.protocol import Reply

from . import engine


@shared_task(name="jobs.run_advance")
def run_advance_task(run_id: str) -> None:
    engine.run_advance(run_id=run_id)


@shared_task(name="jobs.step_reply")
def step_reply_task(device: str, reply: dict) -> None:
    engine.step_reply(device=device, reply=Reply(**reply))


@shared_task(name="jobs.command_resend")
def command_resend_task(step_run_id: int, command_id: str) -> None:
    engine.command_resend(step_run_id=step_run_id, command_id=command_id)
