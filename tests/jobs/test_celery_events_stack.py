"""Celery's own tools see the engine's tasks: task events are on by default, and a task
carries its run's id in the summary `celery events` and Flower show (docs/operations.md)."""

from __future__ import annotations

import threading

import pytest

from iotqueue import celery_app
from iotqueue.redis_conn import redis_connection
from jobs import inbox
from jobs.models import RunStatus, StepKind
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory, template_with_steps
from tests.jobs import step_tasks  # noqa: F401  (registers the test step tasks here too)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]


class EventLog:
    """Every Celery event on the session's broker, captured in a thread until stopped."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.receiver = None
        self.thread = threading.Thread(target=self._capture, name="celery-events", daemon=True)

    def _capture(self) -> None:
        with celery_app.connection_for_read() as connection:
            self.receiver = celery_app.events.Receiver(connection, handlers={"*": self.events.append})
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> EventLog:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(10)

    def naming(self, text: str) -> list[dict]:
        return [e for e in self.events if text in f"{e.get('args', '')} {e.get('kwargs', '')}"]


def test_celery_task_events_name_the_run_a_task_belongs_to(stack):
    # given a listener on the broker's event channel, hearing the workers already
    log = EventLog().start()
    try:
        wait_for(lambda: log.events, what="a first Celery event (a worker's heartbeat)")
        template = JobTemplateFactory()
        JobStepFactory(
            template=template,
            position=0,
            kind=StepKind.TASK,
            device=None,
            action="tests.firmware_url",
            args={"version": "2.1"},
        )

        # when a run with a task step goes through
        run, _ = run_start(template=template)
        wait_for(lambda: run.refresh_from_db() or run.status == RunStatus.SUCCEEDED, what="the run")

        # then its task was sent and received with the run's id in the summary, not bare ids
        def step_task_events() -> list[dict]:
            return [e for e in log.naming(str(run.pk)) if e.get("name") == "jobs.task_step_run"]

        wait_for(
            lambda: {"task-sent", "task-received"} <= {e["type"] for e in step_task_events()},
            what="task-sent and task-received events naming the run",
        )
        received = next(e for e in step_task_events() if e["type"] == "task-received")
        assert received["kwargs"] == f"runs=[{run.pk}], step=0, task=tests.firmware_url"
    finally:
        log.stop()


def test_the_inbox_drain_names_what_woke_it_and_each_batch_it_applies(stack, manual_device):
    # given a listener on the broker's event channel, and a run of one command step whose
    # command reached its hand-driven device, with no drain under way any more
    log = EventLog().start()
    try:
        wait_for(lambda: log.events, what="a first Celery event (a worker's heartbeat)")
        device = DeviceFactory()
        hand = manual_device(device.name)
        run, _ = run_start(template=template_with_steps((device, "blink", {})))
        command = hand.next_command()
        wait_for(lambda: not redis_connection().exists(inbox.INBOX.wake_key()), what="the drain to end")

        # when the device answers
        hand.done(command["id"])
        wait_for(lambda: run.refresh_from_db() or run.status == RunStatus.SUCCEEDED, what="the run")

        # then the drain the answer woke was sent with the device in its summary, and a
        # drain's batch event named the run it started
        def sent_naming_device() -> list[dict]:
            return [
                e
                for e in log.events
                if e["type"] == "task-sent"
                and e["name"] == inbox.DRAIN_TASK
                and f"devices=[{device.name}]" in e["args"]
            ]

        wait_for(sent_naming_device, what="a drain task sent with the device in its summary")
        assert sent_naming_device()[0]["args"].startswith("wake: size=1, steps=[")
        wait_for(
            lambda: [e for e in log.events if e["type"] == "task-batch" and str(run.pk) in e.get("runs", "")],
            what="a drain's batch event naming the run",
        )
    finally:
        log.stop()
