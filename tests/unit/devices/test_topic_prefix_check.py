"""IOTQUEUE_TOPIC_PREFIX is checked as the broker will check it (issue 31, finding 3)."""

import pytest

from devices.topic_claims import topic_prefix_check


@pytest.mark.parametrize("prefix", ["iotqueue", "acme/iotqueue", "ünï"])
def test_a_valid_prefix_passes(settings, prefix):
    settings.IOTQUEUE_TOPIC_PREFIX = prefix
    assert topic_prefix_check() == []


@pytest.mark.parametrize("prefix", ["", "iot\x01queue", "iot/+", "iot/#", "iot\ufffe", "$SYS"])
def test_a_prefix_the_broker_would_refuse_is_a_system_check_error(settings, prefix):
    settings.IOTQUEUE_TOPIC_PREFIX = prefix
    (error,) = topic_prefix_check()
    assert error.id == "devices.E001"
