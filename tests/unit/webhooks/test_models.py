"""webhooks/models.py: what a webhook may subscribe to, and its secret's stored form."""

import importlib

import pytest
from django.apps import apps as django_apps

from jobs.events import LIFECYCLE_KINDS
from webhooks import signing
from webhooks.models import EVENT_KINDS, Webhook, events_validate


def test_a_webhook_may_subscribe_to_every_lifecycle_event_and_nothing_else():
    # given the kinds the engine tells other systems about, then webhooks offer exactly those
    assert set(EVENT_KINDS) == LIFECYCLE_KINDS


def test_a_rejection_is_a_kind_a_webhook_subscribes_to():
    # given a subscription to rejections, then it validates (a device's refusal is news)
    events_validate(["step.rejected", "run.failed"])


@pytest.mark.django_db
def test_the_migration_to_whsec_secrets_keeps_each_webhooks_key():
    # given a webhook whose secret was stored as text before secrets took the whsec_ form
    webhook = Webhook.objects.create(name="old", url="https://example.com/h", events=["run.failed"])
    Webhook.objects.filter(pk=webhook.pk).update(secret="an-old-plain-secret-text")
    # when the data migration runs, then the secret is whsec_ with the text's bytes as the key
    migration = importlib.import_module("webhooks.migrations.0003_secret_whsec")
    migration.secrets_to_whsec(django_apps, None)
    webhook.refresh_from_db()
    assert webhook.secret.startswith("whsec_")
    assert signing.secret_key(webhook.secret) == b"an-old-plain-secret-text"
    # and back again
    migration.secrets_from_whsec(django_apps, None)
    webhook.refresh_from_db()
    assert webhook.secret == "an-old-plain-secret-text"
