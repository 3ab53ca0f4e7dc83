"""The AWS IoT Jobs profile in code (devices/aws_jobs.py): its topics, the validation of what a
device sends (InvalidRequest naming the field, with its clientToken), its versions and ACLs."""

from __future__ import annotations

import json

import pytest

from devices import aws_jobs
from devices.credentials import device_acls
from devices.models import Device
from devices.profiles import DeviceProtocol


def parse(operation: str, body: dict | bytes, job_id: str = "") -> aws_jobs.Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return aws_jobs.request_parse("gw-1", operation, job_id, raw)


@pytest.mark.parametrize(
    ("topic", "parsed"),
    [
        ("$aws/things/gw-1/jobs/get", ("gw-1", aws_jobs.GET, "")),
        ("$aws/things/gw-1/jobs/start-next", ("gw-1", aws_jobs.START_NEXT, "")),
        ("$aws/things/gw-1/jobs/12-1-ab/get", ("gw-1", aws_jobs.DESCRIBE, "12-1-ab")),
        ("$aws/things/gw-1/jobs/12-1-ab/update", ("gw-1", aws_jobs.UPDATE, "12-1-ab")),
        ("$aws/things/gw-1/jobs/get/accepted", None),  # an answer, not a request
        ("$aws/things/gw-1/jobs/notify-next", None),
        ("$aws/things/gw 1/jobs/get", None),  # no device's name
        ("iotqueue/gw-1/jobs/get", None),
    ],
)
def test_request_topics_name_the_device_operation_and_job(topic, parsed):
    assert aws_jobs.request_topic_parse(topic) == parsed


def test_answers_go_to_the_request_topic_accepted_or_rejected():
    update = aws_jobs.Request(device="gw-1", operation=aws_jobs.UPDATE, job_id="7-1-ab")
    assert aws_jobs.answer_topic(update, True) == "$aws/things/gw-1/jobs/7-1-ab/update/accepted"
    get = aws_jobs.Request(device="gw-1", operation=aws_jobs.GET)
    assert aws_jobs.answer_topic(get, False) == "$aws/things/gw-1/jobs/get/rejected"


def test_an_update_is_read_with_every_field_aws_documents():
    request = parse(
        aws_jobs.UPDATE,
        {
            "status": "IN_PROGRESS",
            "statusDetails": {"progress": "40"},
            "expectedVersion": 2,
            "executionNumber": 1,
            "includeJobExecutionState": True,
            "includeJobDocument": True,
            "stepTimeoutInMinutes": 30,
            "clientToken": "t-1",
        },
        job_id="7-1-ab",
    )
    assert (request.status, request.expected_version, request.execution_number) == ("IN_PROGRESS", 2, 1)
    assert request.status_details == {"progress": "40"} and request.step_timeout_minutes == 30
    assert request.include_execution_state and request.include_job_document and request.client_token == "t-1"


def test_an_empty_body_is_an_empty_request():
    assert parse(aws_jobs.GET, b"").client_token is None
    assert parse(aws_jobs.DESCRIBE, b"", job_id="$next").include_job_document  # AWS's default


@pytest.mark.parametrize(
    ("operation", "body", "field"),
    [
        (aws_jobs.UPDATE, {"status": "DONE"}, "status"),
        (aws_jobs.UPDATE, {"status": "QUEUED"}, "status"),  # not one a device may set
        (aws_jobs.UPDATE, {"status": "SUCCEEDED", "expectedVersion": "2"}, "expectedVersion"),
        (aws_jobs.UPDATE, {"status": "SUCCEEDED", "statusDetails": {"a": 1}}, "statusDetails"),
        (aws_jobs.UPDATE, {"status": "SUCCEEDED", "statusDetails": ["x"]}, "statusDetails"),
        (aws_jobs.START_NEXT, {"stepTimeoutInMinutes": 10081}, "stepTimeoutInMinutes"),
        (aws_jobs.START_NEXT, {"stepTimeoutInMinutes": True}, "stepTimeoutInMinutes"),
        (aws_jobs.DESCRIBE, {"includeJobDocument": "yes"}, "includeJobDocument"),
        (aws_jobs.DESCRIBE, {"executionNumber": 0}, "executionNumber"),
    ],
)
def test_a_malformed_field_is_an_invalid_request_naming_it_with_the_client_token(operation, body, field):
    with pytest.raises(aws_jobs.RequestInvalid, match=field) as refused:
        parse(operation, {**body, "clientToken": "c-9"}, job_id="7-1-ab")
    assert refused.value.client_token == "c-9"


@pytest.mark.parametrize("raw", [b"[1]", b"not json", b'{"clientToken": 5}', b"x" * 600_000])
def test_a_body_that_is_no_json_object_is_an_invalid_request(raw):
    with pytest.raises(aws_jobs.RequestInvalid, match=r"JSON|payload|clientToken"):
        aws_jobs.request_parse("gw-1", aws_jobs.GET, "", raw)


def test_a_job_id_aws_would_not_accept_is_refused():
    with pytest.raises(aws_jobs.RequestInvalid, match="jobId"):
        parse(aws_jobs.UPDATE, {"status": "SUCCEEDED"}, job_id="a.b")
    with pytest.raises(aws_jobs.RequestInvalid, match="jobId"):
        parse(aws_jobs.UPDATE, {"status": "SUCCEEDED"}, job_id="$next")  # describe only


def test_the_no_step_timer_value_is_no_extension():
    assert parse(aws_jobs.START_NEXT, {"stepTimeoutInMinutes": -1}).step_timeout_minutes is None


def test_versions_count_the_start_each_update_and_the_end():
    assert aws_jobs.version_number(started=False, updates=0, ended=False) == 1
    assert aws_jobs.version_number(started=True, updates=0, ended=False) == 2
    assert aws_jobs.version_number(started=True, updates=2, ended=False) == 4
    assert aws_jobs.version_number(started=True, updates=2, ended=True) == 5
    assert aws_jobs.version_number(started=False, updates=0, ended=True) == 2


def test_a_rejection_echoes_the_client_token_and_leaves_out_what_it_lacks():
    body = aws_jobs.rejection(aws_jobs.VERSION_MISMATCH, "stale", "t-2", {"versionNumber": 3})
    assert body["code"] == "VersionMismatch" and body["clientToken"] == "t-2"
    assert body["executionState"] == {"versionNumber": 3} and isinstance(body["timestamp"], int)
    assert "clientToken" not in aws_jobs.rejection(aws_jobs.INVALID_REQUEST, "bad", None)


def test_an_aws_device_may_use_its_own_jobs_topics_and_no_other_things():
    device = Device(name="gw-1", protocol=DeviceProtocol.AWS_IOT_JOBS)
    acls = device_acls(device)
    publish = [acl["topic"] for acl in acls if acl["acltype"] == "publishClientSend"]
    subscribe = [acl["topic"] for acl in acls if acl["acltype"] == "subscribePattern"]
    assert "$aws/things/gw-1/jobs/+/update" in publish and "$aws/things/gw-1/jobs/start-next" in publish
    assert "$aws/things/gw-1/jobs/#" in subscribe
    every = publish + subscribe
    assert all(not t.startswith("$") or t.startswith("$aws/things/gw-1/jobs/") for t in every), every


def test_an_iotqueue_device_gets_no_aws_topics():
    every = [acl["topic"] for acl in device_acls(Device(name="gw-2"))]
    assert not [t for t in every if t.startswith("$")], every
