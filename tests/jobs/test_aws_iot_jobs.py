"""The AWS IoT Jobs profile against the real stack, driven by the AWS IoT Device SDK v2 for Python.

A device of protocol `aws-iot-jobs` runs `awsiot.iotjobs.IotJobsClient` with a client
certificate iotqueue issued, on the broker's mTLS listener (or, on a broker given by
MQTT_URL, which has none of ours, with a password on a plain connection), and one test runs
the SDK's v2 client with the device's username and password (tests/aws_sdk_device.py): the
firmware of a fleet written for AWS IoT Jobs, unchanged. Skipped on amqtt, which refuses
clients' publishing on `$` topics. With -s each test prints its transcript.
"""

import queue
from pathlib import Path

import pytest
from awscrt import mqtt, mqtt_request_response
from awsiot import V2ServiceException, iotjobs

from devices.credentials import device_certificate_issue, device_password_issue, managed
from devices.profiles import DeviceProtocol
from jobs.cancel import run_cancel
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.aws_sdk_device import SdkDevice, Transcript, connection_open, connection_open_mtls
from tests.conftest import wait_for
from tests.devices.certificate_client import files_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client

QOS0 = mqtt.QoS.AT_MOST_ONCE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _broker_carries_aws_topics(services):
    """Skip on amqtt (the pip broker: `make test-pip`, a laptop without Mosquitto): it refuses
    every client PUBLISH to a topic beginning with `$` and drops the client (its check of
    MQTT-4.7.2-1), so no `$aws/things/...` request or notification would ever pass."""
    if services.broker is not None and services.broker.kind.startswith("amqtt"):
        pytest.skip("amqtt (the pip broker) refuses clients' PUBLISH to $ topics: no $aws/things/... traffic")


def sdk_connection(services, device, directory: Path) -> tuple[mqtt.Connection, str]:
    """The SDK's connection for `device`, and how it was made: with a client certificate
    iotqueue issued, on the broker's mTLS listener, where it has one (Mosquitto with
    identities iotqueue manages); else with its password on the plain listener (a broker
    given by MQTT_URL; without identities of iotqueue's, no password either)."""
    tls_url = services.broker.tls_url if services.broker is not None else ""
    if tls_url and managed():
        issued = device_certificate_issue(device)
        files = files_for(
            directory,
            certificate_pem=issued.certificate_pem,
            key_pem=issued.private_key_pem,
            ca_pem=issued.broker_ca_certificate_pem,
        )
        connection = connection_open_mtls(tls_url, certificate=files.certificate, key=files.key, ca=files.ca)
        return connection, f"to {tls_url} with certificate {issued.serial} (CN={device.name}), no password"
    password = device_password_issue(device) if managed() else None
    connection = connection_open(device.name, services.mqtt_url, password=password)
    return (
        connection,
        "with its password on the plain listener" if password else "anonymously (no identities)",
    )


@pytest.fixture
def transcript(request):
    """What the test's SDK devices did and saw; printed after the test (visible with -s)."""
    kept = Transcript()
    yield kept
    print("\n" + kept.text(request.node.name), flush=True)


@pytest.fixture
def aws_device(services, tmp_path, transcript):
    """aws_device() -> (Device, SdkDevice): a new aws-iot-jobs device, connected with the SDK
    (over mTLS with its certificate where the broker has a certificate listener)."""
    made = []

    def make():
        device = DeviceFactory(protocol=DeviceProtocol.AWS_IOT_JOBS)
        connection, how = sdk_connection(services, device, tmp_path / device.name)
        sdk = SdkDevice(device.name, connection, transcript=transcript, how=how)
        made.append(sdk)
        return device, sdk

    yield make
    for sdk in made:
        sdk.close()


def run_status(run: JobRun) -> str:
    run.refresh_from_db()
    return run.status


def run_started_on(sdk, device, **step_fields):
    """A one-step run of `firmware/update` on `device` (its step given `step_fields`), and
    the execution the SDK device was notified of and started."""
    template = template_with_steps((device, "firmware/update", {}))
    template.steps.update(**step_fields)
    run, _ = run_start(template=template)
    job = sdk.next("notify-next").execution
    sdk.start_next()
    sdk.next("start-next/accepted")
    return run, job


def test_an_sdk_device_lists_starts_and_completes_its_runs_one_after_the_other(
    stack, services, aws_device, manual_device, transcript
):
    # given an AWS IoT Jobs device (logged in with its certificate where the broker has an
    # mTLS listener: it has no password), and an iotqueue device working at the same time
    device, sdk = aws_device()
    if services.broker is not None and services.broker.tls_url and managed():
        device.refresh_from_db()
        assert device.certificate_serial
    first, _ = run_start(template=template_with_steps((device, "firmware/update", {"version": "2.1"})))
    second, _ = run_start(template=template_with_steps((device, "reboot", {})))
    other = DeviceFactory()
    hand = manual_device(other.name)
    beside, _ = run_start(template=template_with_steps((other, "noop", {})))
    transcript.note(
        "iotqueue",
        f"runs started: {first.pk} (firmware/update) and {second.pk} (reboot) on "
        f"{device.name}; {beside.pk} (noop) on {other.name}, an iotqueue v1.1 device with a password",
    )

    # when the first run's step is dispatched, notify-next wakes the device with it
    woken = sdk.next("notify-next").execution
    step = StepRun.objects.get(run=first)
    assert woken.job_id == step.command_id and woken.status == "QUEUED"
    assert woken.execution_number == step.attempt and woken.version_number == 1

    # and when the second run's step joins its queue, notify lists both, in their order
    listed = sdk.next("notify").jobs
    assert listed["QUEUED"][0].job_id == step.command_id
    assert len(listed["QUEUED"]) == 2

    # and get lists it first among the queued executions, the second run behind it
    sdk.get_pending(token="list-1")
    pending = sdk.next("get/accepted")
    assert pending.client_token == "list-1" and pending.in_progress_jobs == []
    assert pending.queued_jobs[0].job_id == step.command_id
    assert len(pending.queued_jobs) == 2

    # when it starts the next execution (with a step timeout), it gets the job document
    sdk.start_next(client_token="start-1", step_timeout_in_minutes=5)
    started = sdk.next("start-next/accepted")
    assert started.client_token == "start-1"
    assert started.execution.job_id == step.command_id and started.execution.status == "IN_PROGRESS"
    assert started.execution.job_document["action"] == "firmware/update"
    assert started.execution.job_document["args"] == {"version": "2.1"}
    step.refresh_from_db()
    assert step.status == StepStatus.IN_PROGRESS

    # and reports progress at the version it knows, then success
    sdk.update(
        step.command_id,
        "IN_PROGRESS",
        expected_version=2,
        status_details={"progress": "50"},
        include_job_execution_state=True,
    )
    progressed = sdk.next("update/accepted")
    assert (
        progressed.execution_state.status == "IN_PROGRESS" and progressed.execution_state.version_number == 3
    )
    sdk.update(step.command_id, "SUCCEEDED", status_details={"firmware": "2.1"}, client_token="done-1")
    assert sdk.next("update/accepted").client_token == "done-1"

    # then the step and the run succeeded with the device's statusDetails as the result
    wait_for(lambda: run_status(first) == RunStatus.SUCCEEDED, what="the first run succeeded")
    step.refresh_from_db()
    assert step.status == StepStatus.SUCCEEDED and step.result == {"firmware": "2.1"}
    transcript.note("iotqueue", f"run {first.pk} SUCCEEDED, step result {step.result}; run {second.pk} next")

    # and the second run is the next execution, run the same way
    following = sdk.next("notify-next").execution
    assert following.job_id == StepRun.objects.get(run=second).command_id
    sdk.start_next()
    assert sdk.next("start-next/accepted").execution.job_document["action"] == "reboot"
    sdk.update(following.job_id, "SUCCEEDED")
    sdk.next("update/accepted")
    wait_for(lambda: run_status(second) == RunStatus.SUCCEEDED, what="the second run succeeded")
    transcript.note("iotqueue", f"run {second.pk} SUCCEEDED (it started only after run {first.pk} ended)")

    # and a stale update of the first execution is refused, and recorded as protocol v1's are
    sdk.update(step.command_id, "SUCCEEDED", client_token="late")
    refused = sdk.next("update/rejected")
    assert refused.code == "TerminalStateReached" and refused.client_token == "late"
    wait_for(lambda: RunEvent.objects.filter(kind="reply.stale", step_run=step).exists(), what="stale event")
    transcript.note("iotqueue", f"run {first.pk}'s timeline: reply.stale recorded for the late update")

    # and nothing is left to start
    sdk.start_next(client_token="empty")
    nothing = sdk.next("start-next/accepted")
    assert nothing.client_token == "empty" and nothing.execution is None

    # and the iotqueue device's run, beside it all along, works as ever
    command = hand.next_command()
    transcript.note(other.name, f"<- {command['action']} command {command['id']} (protocol v1.1), -> done ok")
    hand.done(command["id"])
    wait_for(lambda: run_status(beside) == RunStatus.SUCCEEDED, what="the iotqueue device's run succeeded")
    transcript.note(
        "iotqueue", f"run {beside.pk} on the password device SUCCEEDED, untouched by the AWS device"
    )


def test_a_rejected_execution_ends_its_step_rejected_without_retry(stack, aws_device, transcript):
    # given an execution started on an AWS IoT Jobs device, of a step allowed three attempts
    device, sdk = aws_device()
    run, job = run_started_on(sdk, device, max_attempts=3)

    # when the device rejects it
    sdk.update(job.job_id, "REJECTED", status_details={"reason": "battery low"})
    sdk.next("update/accepted")

    # then the step ended rejected on its first attempt and the run failed
    wait_for(lambda: run_status(run) == RunStatus.FAILED, what="the run failed")
    step = StepRun.objects.get(run=run)
    assert step.status == StepStatus.REJECTED and step.attempt == 1
    transcript.note(
        "iotqueue", f"run {run.pk} FAILED: step {step.status} on attempt {step.attempt} of 3, not retried"
    )


def test_updates_that_answer_nothing_current_are_refused_with_aws_codes(stack, aws_device, transcript):
    # given an execution in progress on an AWS IoT Jobs device
    device, sdk = aws_device()
    run, _ = run_start(template=template_with_steps((device, "firmware/update", {})))
    job = sdk.next("notify-next").execution
    sdk.start_next()
    sdk.next("start-next/accepted")

    # when it updates at a version it does not hold
    sdk.update(job.job_id, "IN_PROGRESS", expected_version=7)
    mismatch = sdk.next("update/rejected")
    # then VersionMismatch, with the execution's state
    assert mismatch.code == "VersionMismatch" and mismatch.execution_state.version_number == 2

    # when it updates a job it never had
    sdk.update("999999-1-abc", "SUCCEEDED")
    assert sdk.next("update/rejected").code == "ResourceNotFound"

    # when it sends a malformed request
    sdk.publish_raw(f"{job.job_id}/update", b'{"status": "DONE", "clientToken": "bad-1"}')
    malformed = sdk.next("update/rejected")
    assert malformed.code == "InvalidRequest" and malformed.client_token == "bad-1"

    # when it describes the execution
    sdk.describe(job.job_id)
    described = sdk.next("describe/accepted").execution
    assert described.status == "IN_PROGRESS" and described.job_document["action"] == "firmware/update"

    # when it updates an execution still queued behind this one, before starting it
    behind, _ = run_start(template=template_with_steps((device, "reboot", {})))
    (queued,) = sdk.next("notify").jobs["QUEUED"]
    sdk.update(queued.job_id, "SUCCEEDED", client_token="early")
    # then InvalidStateTransition
    early = sdk.next("update/rejected")
    assert early.code == "InvalidStateTransition" and early.client_token == "early"

    # then none of that moved the step: it still succeeds
    sdk.update(job.job_id, "SUCCEEDED")
    sdk.next("update/accepted")
    wait_for(lambda: run_status(run) == RunStatus.SUCCEEDED, what="the run succeeded")
    transcript.note("iotqueue", f"run {run.pk} SUCCEEDED: the refused updates moved nothing")
    # and the queued run's step, untouched by the early update, runs when it is next
    following = sdk.next("notify-next").execution
    sdk.start_next()
    sdk.next("start-next/accepted")
    sdk.update(following.job_id, "SUCCEEDED")
    wait_for(lambda: run_status(behind) == RunStatus.SUCCEEDED, what="the queued run succeeded")


def test_a_canceled_execution_leaves_the_list_and_its_update_is_refused(stack, aws_device, transcript):
    # given an execution started on an AWS IoT Jobs device
    device, sdk = aws_device()
    run, _ = run_start(template=template_with_steps((device, "firmware/update", {})))
    job = sdk.next("notify-next").execution
    sdk.start_next()
    sdk.next("start-next/accepted")

    # when its run is canceled
    run_cancel(run=run, by="test")
    transcript.note("iotqueue", f"run {run.pk} canceled by the operator")

    # then the device is told what is pending now: nothing
    assert sdk.next("notify").jobs in (None, {})
    # and its update of the canceled execution is refused
    sdk.update(job.job_id, "SUCCEEDED")
    assert sdk.next("update/rejected").code == "TerminalStateReached"
    assert StepRun.objects.get(run=run).status == StepStatus.CANCELED


def test_an_aws_device_cannot_listen_to_another_things_jobs(stack, services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")
    # given two AWS IoT Jobs devices
    device = DeviceFactory(protocol=DeviceProtocol.AWS_IOT_JOBS)
    other = DeviceFactory(protocol=DeviceProtocol.AWS_IOT_JOBS)
    password = device_password_issue(device)
    client = mqtt_client(services.mqtt_url, username=device.name, password=password)
    granted: queue.Queue = queue.Queue()
    client.on_subscribe = lambda c, u, mid, codes, p: granted.put(codes)
    try:
        # when it subscribes to its own jobs topics and to the other's
        client.subscribe(f"$aws/things/{device.name}/jobs/#", qos=1)
        own = granted.get(timeout=10)
        client.subscribe(f"$aws/things/{other.name}/jobs/#", qos=1)
        foreign = granted.get(timeout=10)
    finally:
        client.loop_stop()
        client.disconnect()
    # then the broker grants its own and refuses the other's
    assert not own[0].is_failure and foreign[0].is_failure


def test_the_sdks_request_response_client_gets_its_answers_by_client_token(stack, services, transcript):
    # given an AWS IoT Jobs device using the SDK's v2 client (IotJobsClientV2), which
    # subscribes to .../accepted|rejected as `+` and matches answers by their clientToken
    # (over its password, so that both ways in are run with the SDK)
    device = DeviceFactory(protocol=DeviceProtocol.AWS_IOT_JOBS)
    password = device_password_issue(device) if managed() else None
    connection = connection_open(device.name, services.mqtt_url, password=password)
    options = mqtt_request_response.ClientOptions(
        max_request_response_subscriptions=4, max_streaming_subscriptions=2
    )
    client = iotjobs.IotJobsClientV2(connection, options)
    try:
        run, _ = run_start(template=template_with_steps((device, "firmware/update", {"version": "3"})))
        wait_for(
            lambda: StepRun.objects.filter(run=run, status=StepStatus.DISPATCHED).exists(), what="dispatch"
        )
        thing = {"thing_name": device.name}

        # when it lists, starts and completes its execution
        pending = client.get_pending_job_executions(iotjobs.GetPendingJobExecutionsRequest(**thing)).result(
            15
        )
        started = client.start_next_pending_job_execution(
            iotjobs.StartNextPendingJobExecutionRequest(**thing)
        ).result(15)
        job_id = started.execution.job_id
        client.update_job_execution(
            iotjobs.UpdateJobExecutionRequest(**thing, job_id=job_id, status="SUCCEEDED")
        ).result(15)

        # then each answer came back, and the run succeeded
        assert [job.job_id for job in pending.queued_jobs] == [job_id]
        assert started.execution.job_document["args"] == {"version": "3"}
        wait_for(lambda: run_status(run) == RunStatus.SUCCEEDED, what="the run succeeded")

        # and a stale update fails with AWS's error code
        late = client.update_job_execution(
            iotjobs.UpdateJobExecutionRequest(**thing, job_id=job_id, status="FAILED")
        )
        with pytest.raises(V2ServiceException) as refused:
            late.result(15)
        assert refused.value.modeled_error.code == "TerminalStateReached"
        document = started.execution.job_document
        for line in (
            "IotJobsClientV2, logged in with its password",
            f"get -> queuedJobs=[{job_id}]",
            f"start-next -> {job_id} document={{action: {document['action']}, args: {document['args']}}}",
            f"{job_id}/update SUCCEEDED -> accepted; run {run.pk} SUCCEEDED",
            f"{job_id}/update FAILED (late) -> V2ServiceException {refused.value.modeled_error.code}",
        ):
            transcript.note(device.name, line)
    finally:
        connection.disconnect().result(15)


def test_a_failed_execution_is_retried_as_a_new_execution_number(stack, aws_device, transcript):
    # given an execution of a step allowed two attempts, started on an AWS IoT Jobs device
    device, sdk = aws_device()
    run, first = run_started_on(sdk, device, max_attempts=2, backoff_seconds=0)

    # when the device reports it FAILED
    sdk.update(first.job_id, "FAILED", status_details={"reason": "flash error"})
    sdk.next("update/accepted")

    # then the step's second attempt is the next execution: a new jobId, executionNumber 2
    again = sdk.next("notify-next").execution
    assert again.job_id != first.job_id and again.execution_number == 2
    sdk.start_next()
    sdk.update(again.job_id, "SUCCEEDED")
    wait_for(lambda: run_status(run) == RunStatus.SUCCEEDED, what="the run succeeded on its second attempt")
    transcript.note("iotqueue", f"run {run.pk} SUCCEEDED on its second attempt")


def test_one_things_flood_of_requests_does_not_hold_up_another_things_answers(stack, aws_device, transcript):
    # given two AWS IoT Jobs devices
    _, flooding = aws_device()
    _, quiet = aws_device()

    # when one sends a thousand get requests at once
    sent = 1000
    flooding.note(f"-> get x {sent} at QoS 0, as fast as the SDK sends them")
    for n in range(sent):
        flooding.connection.publish(
            f"$aws/things/{flooding.name}/jobs/get", b'{"clientToken": "%d"}' % n, QOS0
        )

    # then the other's request is still answered
    quiet.get_pending(token="still-heard")
    assert quiet.next("get/accepted").client_token == "still-heard"
    # and the flood beyond its device's budget was dropped, and said so on the timeline
    dropped = RunEvent.objects.filter(kind="message.dropped", device=flooding.name)
    wait_for(dropped.exists, what="the flood's dropped-message summary")
    transcript.note("iotqueue", f"{flooding.name}'s timeline: {dropped.first().message}")
