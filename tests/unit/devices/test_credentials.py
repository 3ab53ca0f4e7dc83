"""A device's broker ACLs: its own topics, its legacy overrides, never the broker's own."""

from devices.credentials import device_acls
from devices.models import Device


def topics(device: Device, acltype: str) -> list[str]:
    return [acl["topic"] for acl in device_acls(device) if acl["acltype"] == acltype]


def test_a_legacy_device_gets_its_override_topics():
    device = Device(name="face-123", command_topic="dev/face/123", reply_topic="dev/face/123/Ack")
    assert "dev/face/123/Ack" in topics(device, "publishClientSend")
    assert "dev/face/123" in topics(device, "subscribePattern")


def test_a_dollar_topic_saved_before_validation_refused_it_gets_no_acl():
    # A row written before topic_validate refused $ topics (or by SQL) must not hand the
    # device the broker's administration topics.
    device = Device(
        name="leg-5",
        command_topic="$CONTROL/dynamic-security/v1/response",
        reply_topic="$CONTROL/dynamic-security/v1",
    )
    every = topics(device, "publishClientSend") + topics(device, "subscribePattern")
    assert not [t for t in every if t.startswith("$")], every
