"""webhooks/models.py: what a webhook may subscribe to."""

from jobs.events import LIFECYCLE_KINDS
from webhooks.models import EVENT_KINDS, events_validate


def test_a_webhook_may_subscribe_to_every_lifecycle_event_and_nothing_else():
    # given the kinds the engine tells other systems about, then webhooks offer exactly those
    assert set(EVENT_KINDS) == LIFECYCLE_KINDS


def test_a_rejection_is_a_kind_a_webhook_subscribes_to():
    # given a subscription to rejections, then it validates (a device's refusal is news)
    events_validate(["step.rejected", "run.failed"])
