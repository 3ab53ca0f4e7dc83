"""Device protocol v1 in code (devices/protocol.py): topics, command bodies, and decoding and
validating what devices send; bodies nested too deeply are protocol errors, dropped with an event."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

from devices import protocol
from iotqueue import budget
from iotqueue.metrics import CounterBuffer
from jobs import replies
from jobs.models import RunEvent


def deep_result(depth: int) -> bytes:
    """A done reply whose result holds an array nested `depth` levels (the body: depth + 2)."""
    return b'{"id": "c-1", "ok": true, "result": {"x": ' + b"[" * depth + b"]" * depth + b"}}"


def test_a_payload_python_cannot_decode_for_its_depth_is_a_protocol_error():
    with pytest.raises(protocol.ProtocolError, match="nested more than 32 levels"):
        protocol.payload_json(b"[" * 5000 + b"]" * 5000)


def test_a_payload_nested_beyond_the_limit_is_a_protocol_error():
    with pytest.raises(protocol.ProtocolError, match="nested more than 32 levels"):
        protocol.payload_json(deep_result(40))


@override_settings(IOTQUEUE_JSON_MAX_DEPTH=5)
def test_the_depth_limit_is_the_setting():
    assert protocol.payload_json(deep_result(2))["result"] == {"x": [[]]}
    with pytest.raises(protocol.ProtocolError, match="nested more than 5 levels"):
        protocol.payload_json(deep_result(4))


@pytest.mark.django_db(transaction=True)  # the summary writer recycles the connection
def test_a_deep_reply_is_dropped_with_an_event(monkeypatch):
    # given the bridge's tally of dropped messages, counted in this process
    tally = budget.DropTally()
    monkeypatch.setattr(budget, "drop_tally", tally)
    monkeypatch.setattr(replies, "counter_buffer", CounterBuffer(flush_seconds=3600))

    # when a device's reply nests deeper than Python can decode
    replies.reply_accept("lamp-1", "done", "iotqueue/lamp-1/done", deep_result(5000))
    replies.dropped_summaries_record(tally.summaries_take())

    # then it is dropped, and the timeline says why
    dropped = RunEvent.objects.get(kind="message.dropped")
    assert dropped.device == "lamp-1" and "nested more than 32 levels" in dropped.message


@pytest.fixture
def prefix(settings) -> str:
    settings.IOTQUEUE_TOPIC_PREFIX = "site-a"
    return settings.IOTQUEUE_TOPIC_PREFIX


def test_topics_live_under_the_prefix_and_legacy_devices_keep_their_own(prefix):
    assert protocol.device_topic("lamp-2", "done") == "site-a/lamp-2/done"
    assert protocol.command_topic("lamp-2", "firmware/check") == "site-a/lamp-2/cmd/firmware/check"
    assert protocol.command_topic("face-1", "add", override="dev/face/123") == "dev/face/123"
    assert protocol.device_subscriptions() == [f"site-a/+/{kind}" for kind in protocol.DEVICE_KINDS]


@pytest.mark.parametrize(
    ("topic", "parsed"),
    [
        ("site-a/lamp-2/done", ("lamp-2", "done")),
        ("site-a/lamp-2/heartbeat", ("lamp-2", "heartbeat")),
        ("site-b/lamp-2/done", None),  # another prefix
        ("site-a/lamp-2/cmd", None),  # not a device kind
        ("site-a/lamp-2/cmd/on", None),
        ("site-a//done", None),  # no device
        ("site-a/lamp-2", None),
        ("site-a-old/lamp-2/done", None),  # the prefix is a whole level
    ],
)
def test_a_device_topic_parses_to_device_and_kind(prefix, topic, parsed):
    assert protocol.topic_parse(topic) == parsed


def test_a_command_body_is_exactly_the_documented_fields():
    # when a command is encoded
    raw = protocol.command_payload(
        command_id="c-1",
        run="r-1",
        step=2,
        attempt=1,
        token=7,
        action="on",
        args={"level": 80},
        deadline="2030-01-01T00:00:00Z",
    )

    # then it is compact JSON with the fields in docs/protocol.md's order
    assert raw == (
        b'{"id":"c-1","run":"r-1","step":2,"attempt":1,"token":7,"action":"on",'
        b'"args":{"level":80},"deadline":"2030-01-01T00:00:00Z"}'
    )


def test_ack_progress_and_done_parse_to_replies():
    assert protocol.reply_parse("ack", {"id": "c-1"}) == protocol.Reply(kind="ack", command_id="c-1")
    progress = protocol.reply_parse("progress", {"id": "c-1", "progress": 42.9, "detail": {"stage": "flash"}})
    # a v1 object detail is kept, as text (v1.1 details are text)
    assert (progress.progress, progress.detail) == (42, '{"stage":"flash"}')
    done = protocol.reply_parse("done", {"id": "c-1", "ok": True, "result": {"serial": "SN-1"}})
    assert (done.ok, done.result, done.error) == (True, {"serial": "SN-1"}, "")


def test_a_failed_done_carries_its_error_and_whether_to_retry():
    # when a device reports failure, with and without an error text
    failed = protocol.reply_parse("done", {"id": "c-1", "ok": False, "error": "jammed", "retryable": True})
    bare = protocol.reply_parse("done", {"id": "c-1", "ok": False})

    # then the reply says so; without a text it gets a generic one, and it is not retried
    assert (failed.ok, failed.error, failed.retryable) == (False, "jammed", True)
    assert (bare.error, bare.retryable) == ("device reported failure", False)


@pytest.mark.parametrize(
    ("kind", "body", "problem"),
    [
        ("done", ["c-1"], "payload must be a JSON object"),
        ("ack", {}, "field 'id' must be a non-empty string"),
        ("ack", {"id": 7}, "field 'id' must be a non-empty string"),
        ("progress", {"id": "c", "progress": 101}, "field 'progress' must be a number from 0 to 100"),
        ("progress", {"id": "c", "progress": True}, "field 'progress' must be a number from 0 to 100"),
        (
            "progress",
            {"id": "c", "progress": 5, "detail": [1]},
            "field 'detail' must be a string or a JSON object",
        ),
        ("done", {"id": "c", "ok": "yes"}, "field 'ok' must be true or false"),
        ("done", {"id": "c", "ok": True, "result": "fine"}, "field 'result' must be a JSON object"),
        ("done", {"id": "c", "ok": False, "error": 5}, "field 'error' must be a string"),
        ("done", {"id": "c", "ok": False, "retryable": 1}, "field 'retryable' must be true or false"),
        ("status", {"id": "c"}, "unknown reply kind 'status'"),
    ],
)
def test_a_reply_breaking_the_protocol_is_an_error_naming_the_field(kind, body, problem):
    with pytest.raises(protocol.ProtocolError) as error:
        protocol.reply_parse(kind, body)
    assert str(error.value) == problem


def test_a_null_result_or_detail_counts_as_empty():
    assert protocol.reply_parse("done", {"id": "c", "ok": True, "result": None}).result == {}


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"id": "c", "type": "progress", "ok": True}, "progress"),  # an explicit type wins
        ({"id": "c", "ok": False}, "done"),
        ({"id": "c", "progress": 10}, "progress"),
        ({"id": "c"}, "ack"),
        ({"id": "c", "type": "reboot"}, "ack"),
        ("not an object", "ack"),
    ],
)
def test_a_legacy_reply_kind_is_inferred_from_its_body(body, kind):
    assert protocol.reply_kind_infer(body) == kind


@override_settings(IOTQUEUE_MAX_PAYLOAD_BYTES=64)
def test_payloads_over_the_size_limit_are_refused_before_decoding():
    assert protocol.payload_json(json.dumps({"id": "x" * 50}).encode()) == {"id": "x" * 50}
    with pytest.raises(protocol.ProtocolError, match="payload of 65 bytes exceeds 64"):
        protocol.payload_json(b" " * 65)


@pytest.mark.parametrize("raw", [b"not json", b'{"id": ', b"\xff\xfe"])
def test_a_body_that_is_not_json_is_a_protocol_error(raw):
    with pytest.raises(protocol.ProtocolError, match="payload is not JSON"):
        protocol.payload_json(raw)


def test_a_nul_character_is_refused_with_where_it_is():
    # PostgreSQL cannot store it: refused on entry, naming the place
    with pytest.raises(protocol.ProtocolError, match=r"result.name: a NUL character \(\\u0000\)"):
        protocol.payload_json(b'{"id": "c", "ok": true, "result": {"name": "a\\u0000b"}}')


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"id": "poison-\\ud800", "ok": true}', "id"),
        (b'{"id": "c", "ok": true, "result": {"x": "\\ud800"}}', "result.x"),
        (b'{"id": "c", "ok": false, "error": "\\udfff"}', "error"),
        (b'{"id": "c", "progress": 5, "detail": "\\udc80"}', "detail"),
    ],
)
def test_a_lone_surrogate_is_refused_with_where_it_is(raw, where):
    # given a body whose JSON escape decodes to half of a UTF-16 pair: valid JSON, no UTF-8
    # then it is refused on entry, naming the place, before anything could try to store it
    with pytest.raises(protocol.ProtocolError, match=rf"^payload holds text .*: {where}: a lone surrogate"):
        protocol.payload_json(raw)


@pytest.mark.parametrize(
    ("raw", "online"),
    [(b"online", True), (b'"online"', True), (b" Offline\n", False), (b'"offline"', False)],
)
def test_status_is_online_or_offline_bare_or_quoted(raw, online):
    assert protocol.status_parse(raw) is online


@pytest.mark.parametrize("raw", [b"", b"up", b'{"status": "online"}'])
def test_any_other_status_is_a_protocol_error(raw):
    with pytest.raises(protocol.ProtocolError, match="status must be 'online' or 'offline'"):
        protocol.status_parse(raw)


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("lamp-2", True),
        ("dev.face:123_a", True),
        ("-lamp", False),
        ("a/b", False),
        ("a+", False),
        ("a" * 129, False),
    ],
)
def test_a_device_name_is_one_topic_level(name, valid):
    assert bool(protocol.DEVICE_NAME_RE.match(name)) is valid


# --- v1.1 ----------------------------------------------------------------------------------


def test_a_rejected_done_ends_as_a_refusal_that_is_never_retryable():
    reply = protocol.reply_parse("done", {"id": "c-1", "ok": False, "status": "rejected", "retryable": True})
    assert (reply.ok, reply.rejected, reply.retryable, reply.error) == (False, True, False, "device rejected")
    # `ok` may be left out when the status says it
    assert protocol.reply_parse("done", {"id": "c-1", "status": "rejected", "error": "busy"}).error == "busy"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"id": "c", "ok": True, "status": "rejected"}, "cannot say ok: true"),
        ({"id": "c", "ok": False, "status": "refused"}, "'status' must be 'rejected'"),
        ({"id": "c", "status": 1}, "'status' must be 'rejected'"),
    ],
)
def test_a_done_status_other_than_rejected_is_a_protocol_error(body, problem):
    with pytest.raises(protocol.ProtocolError, match=problem):
        protocol.reply_parse("done", body)


def test_a_v1_done_is_not_rejected():
    reply = protocol.reply_parse("done", {"id": "c", "ok": False, "retryable": True})
    assert (reply.rejected, reply.retryable) == (False, True)


def test_a_legacy_topic_infers_done_from_a_rejected_status():
    assert protocol.reply_kind_infer({"id": "c", "status": "rejected"}) == "done"


def test_progress_carries_extend_seconds_and_a_text_detail():
    reply = protocol.reply_parse(
        "progress", {"id": "c", "progress": 40, "extend_seconds": 90, "detail": "flashing bank 2"}
    )
    assert (reply.progress, reply.extend_seconds, reply.detail) == (40, 90.0, "flashing bank 2")
    assert protocol.Reply(**reply.as_task_payload()) == reply


@pytest.mark.parametrize("value", [0, -5, True, "60", protocol.EXTEND_SECONDS_LIMIT + 1, [60]])
def test_extend_seconds_must_be_a_positive_bounded_number(value):
    with pytest.raises(protocol.ProtocolError, match="'extend_seconds'"):
        protocol.reply_parse("progress", {"id": "c", "progress": 1, "extend_seconds": value})


def test_a_long_detail_is_cut_and_a_v1_object_detail_is_kept_as_text():
    long = protocol.reply_parse("progress", {"id": "c", "progress": 1, "detail": "x" * 2000}).detail
    assert len(long) == protocol.DETAIL_MAX_CHARS and long.endswith("…")
    v1 = protocol.reply_parse("progress", {"id": "c", "progress": 1, "detail": {"bank": 2}})
    assert v1.detail == '{"bank":2}'
    assert protocol.reply_parse("progress", {"id": "c", "progress": 1, "detail": {}}).detail == ""
    with pytest.raises(protocol.ProtocolError, match="'detail'"):
        protocol.reply_parse("progress", {"id": "c", "progress": 1, "detail": 7})


@override_settings(IOTQUEUE_TOPIC_PREFIX="iq")
@pytest.mark.parametrize(
    ("topic", "device"),
    [
        ("iq/lamp-2/jobs/get", "lamp-2"),
        ("iq/lamp-2/jobs/current", None),
        ("iq/a/b/jobs/get", None),
        ("other/lamp-2/jobs/get", None),
        ("iq//jobs/get", None),
    ],
)
def test_jobs_get_names_one_device(topic, device):
    assert protocol.jobs_get_device(topic) == device


@pytest.mark.parametrize("raw", [b"", b"  ", b"{}", b'{"client": "fw 2.1"}'])
def test_a_jobs_get_body_is_empty_or_an_object(raw):
    protocol.jobs_get_parse(raw)


@pytest.mark.parametrize("raw", [b"[]", b"null", b"hello", b'"get"'])
def test_any_other_jobs_get_body_is_a_protocol_error(raw):
    with pytest.raises(protocol.ProtocolError):
        protocol.jobs_get_parse(raw)


def test_jobs_current_carries_the_command_verbatim_or_null():
    command = protocol.command_payload(
        command_id="7-1-ab", run="r", step=0, attempt=1, token=3, action="on", args={}, deadline="d"
    )
    answer = json.loads(protocol.jobs_current_payload(command=command, queued=2))
    assert answer == {"command": json.loads(command), "queued": 2}
    assert json.loads(protocol.jobs_current_payload(command=None, queued=0)) == {"command": None, "queued": 0}
