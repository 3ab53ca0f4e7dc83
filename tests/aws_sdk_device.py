"""A device driven by the AWS IoT Device SDK v2 for Python (`awsiotsdk`), as firmware uses it.

It connects the way AWS IoT firmware does, with a client certificate on the broker's mTLS
listener (`awsiot.mqtt_connection_builder.mtls_from_path`, `connection_open_mtls`): the
certificate's CN is its identity, whatever username and client id the SDK sends. Where the
broker has no such listener (one given by MQTT_URL), it uses awscrt's own MQTT 3.1.1 client
(`awscrt.mqtt.Connection`) over plain TCP with the device's username and password,
with `disable_metrics=True`: otherwise awscrt (0.36) appends its metrics
(`?SDK=...&Metadata=...`) to the username, which is then no device's name and the broker
refuses the login (`mqtt_connection_builder` says the same with
`enable_metrics_collection=False`). Every request goes through
`awsiot.iotjobs.IotJobsClient`; every answer and notification lands in a queue per topic
kind, read with a bound. A Transcript keeps what the device sent and what the test read back,
one line each, for a reader of the run (pytest -s prints it after each test).
"""

from __future__ import annotations

import json
import queue
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from awscrt import mqtt
from awsiot import iotjobs, mqtt_connection_builder

from iotqueue.mqtt import broker_address

# How long the test waits for an answer, a notification or the broker's acknowledgement.
ANSWER_WAIT_SECONDS = 15.0
QOS = mqtt.QoS.AT_LEAST_ONCE


def connection_open(name: str, url: str, *, password: str | None) -> mqtt.Connection:
    """A connected awscrt MQTT 3.1.1 connection as device `name` (any client id, no TLS)."""
    address = broker_address(url)
    connection = mqtt.Connection(
        client=mqtt.Client(None, None),
        host_name=address.host,
        port=address.port,
        client_id=f"sdk-{uuid.uuid4().hex[:8]}",
        username=name if password else address.username,
        password=password if password else address.password,
        clean_session=True,
        keep_alive_secs=30,
        disable_metrics=True,
    )
    connection.connect().result(ANSWER_WAIT_SECONDS)
    return connection


def connection_open_mtls(tls_url: str, *, certificate: Path, key: Path, ca: Path) -> mqtt.Connection:
    """A connected SDK connection on the broker's mTLS listener, as AWS IoT firmware makes
    it: the client certificate and key, the CA that signed the broker's certificate, a
    random client id, the SDK's metrics left on (a certificate device's username is
    ignored: its identity is the certificate)."""
    address = urlsplit(tls_url)
    connection = mqtt_connection_builder.mtls_from_path(
        endpoint=address.hostname,
        port=address.port,
        cert_filepath=str(certificate),
        pri_key_filepath=str(key),
        ca_filepath=str(ca),
        client_id=f"sdk-{uuid.uuid4().hex[:8]}",
        clean_session=True,
        keep_alive_secs=30,
    )
    connection.connect().result(ANSWER_WAIT_SECONDS)
    return connection


class Transcript:
    """What the SDK devices of one test did and saw, a line per request or answer read."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.lines: list[str] = []

    def note(self, who: str, text: str) -> None:
        self.lines.append(f"{time.monotonic() - self.started:6.2f}s  {who:<14} {text}")

    def text(self, title: str) -> str:
        return "\n".join([f"--- {title}", *self.lines, ""])


def _jobs(summaries) -> str:
    return "[" + ", ".join(job.job_id for job in summaries or ()) + "]"


def _execution(execution) -> str:
    if execution is None:
        return "no execution"
    document = execution.job_document or {}
    shown = f" document={{action: {document['action']}, args: {document.get('args')}}}" if document else ""
    return (
        f"{execution.job_id} {execution.status} executionNumber={execution.execution_number}"
        f" versionNumber={execution.version_number}{shown}"
    )


def message_summary(kind: str, message) -> str:
    """One line for an answer or notification as the SDK parsed it (the fields a reader checks)."""
    if kind.endswith("/rejected"):
        text = f"code={message.code} ({message.message})"
    elif kind == "notify":
        jobs = message.jobs or {}
        text = " ".join(f"{status}={_jobs(listed)}" for status, listed in jobs.items()) or "nothing pending"
    elif kind == "get/accepted":
        text = f"inProgressJobs={_jobs(message.in_progress_jobs)} queuedJobs={_jobs(message.queued_jobs)}"
    elif kind == "update/accepted":
        state = message.execution_state
        text = f"executionState={state.status} versionNumber={state.version_number}" if state else "accepted"
    else:  # notify-next, start-next/accepted, describe/accepted
        text = _execution(message.execution)
    token = getattr(message, "client_token", None)
    return f"<- {kind}: {text}" + (f" clientToken={token}" if token else "")


def _fields(fields: dict[str, Any]) -> str:
    """Request fields as the JSON carries them (client_token -> clientToken)."""
    return "".join(f" {_camel(key)}={value}" for key, value in fields.items() if value is not None)


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


class SdkDevice:
    """One thing: a connected IotJobsClient subscribed to all its answers and notifications."""

    def __init__(
        self, name: str, connection: mqtt.Connection, *, transcript: Transcript | None = None, how: str = ""
    ) -> None:
        self.name = name
        self.connection = connection
        self.transcript = transcript or Transcript()
        self.who = name
        self.note(f"connected {how}".strip())
        self.jobs = iotjobs.IotJobsClient(self.connection)
        self.received: dict[str, queue.Queue[dict[str, Any]]] = {}
        self._subscribe_all()

    def _collect(self, kind: str):
        self.received[kind] = queue.Queue()

        def callback(response) -> None:
            self.received[kind].put(response)

        return callback

    def _subscribe_all(self) -> None:
        thing, any_job = {"thing_name": self.name}, {"thing_name": self.name, "job_id": "+"}
        subscriptions = [
            ("notify-next", self.jobs.subscribe_to_next_job_execution_changed_events,
             iotjobs.NextJobExecutionChangedSubscriptionRequest(**thing)),
            ("notify", self.jobs.subscribe_to_job_executions_changed_events,
             iotjobs.JobExecutionsChangedSubscriptionRequest(**thing)),
            ("get/accepted", self.jobs.subscribe_to_get_pending_job_executions_accepted,
             iotjobs.GetPendingJobExecutionsSubscriptionRequest(**thing)),
            ("get/rejected", self.jobs.subscribe_to_get_pending_job_executions_rejected,
             iotjobs.GetPendingJobExecutionsSubscriptionRequest(**thing)),
            ("start-next/accepted", self.jobs.subscribe_to_start_next_pending_job_execution_accepted,
             iotjobs.StartNextPendingJobExecutionSubscriptionRequest(**thing)),
            ("start-next/rejected", self.jobs.subscribe_to_start_next_pending_job_execution_rejected,
             iotjobs.StartNextPendingJobExecutionSubscriptionRequest(**thing)),
            ("describe/accepted", self.jobs.subscribe_to_describe_job_execution_accepted,
             iotjobs.DescribeJobExecutionSubscriptionRequest(**any_job)),
            ("describe/rejected", self.jobs.subscribe_to_describe_job_execution_rejected,
             iotjobs.DescribeJobExecutionSubscriptionRequest(**any_job)),
            ("update/accepted", self.jobs.subscribe_to_update_job_execution_accepted,
             iotjobs.UpdateJobExecutionSubscriptionRequest(**any_job)),
            ("update/rejected", self.jobs.subscribe_to_update_job_execution_rejected,
             iotjobs.UpdateJobExecutionSubscriptionRequest(**any_job)),
        ]  # fmt: skip
        for kind, subscribe, request in subscriptions:
            future, _topic = subscribe(request=request, qos=QOS, callback=self._collect(kind))
            granted = future.result(ANSWER_WAIT_SECONDS)
            assert granted == QOS, f"{self.name}: the broker refused the {kind} subscription ({granted})"
        self.note(f"subscribed to {len(subscriptions)} $aws/things/{self.name}/jobs/... topics, all granted")

    def note(self, text: str) -> None:
        self.transcript.note(self.who, text)

    def next(self, kind: str, timeout: float = ANSWER_WAIT_SECONDS):
        """The next message of `kind` (e.g. "update/rejected"), as the SDK parsed it."""
        message = self.received[kind].get(timeout=timeout)
        self.note(message_summary(kind, message))
        return message

    def get_pending(self, token: str = "") -> None:
        self.note(f"-> get{_fields({'clientToken': token or None})}")
        request = iotjobs.GetPendingJobExecutionsRequest(thing_name=self.name, client_token=token or None)
        self.jobs.publish_get_pending_job_executions(request, QOS).result(ANSWER_WAIT_SECONDS)

    def start_next(self, **fields) -> None:
        self.note(f"-> start-next{_fields(fields)}")
        request = iotjobs.StartNextPendingJobExecutionRequest(thing_name=self.name, **fields)
        self.jobs.publish_start_next_pending_job_execution(request, QOS).result(ANSWER_WAIT_SECONDS)

    def describe(self, job_id: str, **fields) -> None:
        self.note(f"-> {job_id}/get{_fields(fields)}")
        request = iotjobs.DescribeJobExecutionRequest(thing_name=self.name, job_id=job_id, **fields)
        self.jobs.publish_describe_job_execution(request, QOS).result(ANSWER_WAIT_SECONDS)

    def update(self, job_id: str, status: str, **fields) -> None:
        self.note(f"-> {job_id}/update {status}{_fields(fields)}")
        request = iotjobs.UpdateJobExecutionRequest(
            thing_name=self.name, job_id=job_id, status=status, **fields
        )
        self.jobs.publish_update_job_execution(request, QOS).result(ANSWER_WAIT_SECONDS)

    def publish_raw(self, suffix: str, payload: bytes) -> None:
        """Publish bytes the SDK would never send, on $aws/things/<name>/jobs/<suffix>."""
        topic = f"$aws/things/{self.name}/jobs/{suffix}"
        self.note(f"-> {suffix} (raw) {payload.decode(errors='replace')}")
        future, _ = self.connection.publish(topic, payload, QOS)
        future.result(ANSWER_WAIT_SECONDS)

    def close(self) -> None:
        self.connection.disconnect().result(ANSWER_WAIT_SECONDS)


def as_dict(payload: Any) -> dict:
    """A raw JSON payload, for asserting on what the SDK's model does not keep."""
    return json.loads(payload) if isinstance(payload, (bytes, str)) else payload
