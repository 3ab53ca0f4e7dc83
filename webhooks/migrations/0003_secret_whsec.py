"""Secrets take the Standard Webhooks form, whsec_<base64 of the key>, keeping their key."""

import base64

from django.db import migrations, models

import webhooks.models


def secrets_to_whsec(apps, schema_editor) -> None:
    # Every secret set so far is text whose UTF-8 bytes were the HMAC key: keep that key, so
    # receivers checking the old X-Iotqueue-Signature header keep working.
    Webhook = apps.get_model("webhooks", "Webhook")
    for webhook in Webhook.objects.exclude(secret="").only("pk", "secret").iterator():
        secret = "whsec_" + base64.b64encode(webhook.secret.encode()).decode()
        Webhook.objects.filter(pk=webhook.pk).update(secret=secret)


def secrets_from_whsec(apps, schema_editor) -> None:
    Webhook = apps.get_model("webhooks", "Webhook")
    for webhook in Webhook.objects.filter(secret__startswith="whsec_").only("pk", "secret").iterator():
        key = base64.b64decode(webhook.secret[len("whsec_") :])
        try:
            secret = key.decode()
        except UnicodeDecodeError:
            secret = base64.urlsafe_b64encode(key).decode()  # a generated key: new text
        Webhook.objects.filter(pk=webhook.pk).update(secret=secret[:200])


class Migration(migrations.Migration):

    dependencies = [
        ("webhooks", "0002_event_step_rejected"),
    ]

    operations = [
        migrations.AlterField(
            model_name="webhook",
            name="secret",
            field=models.CharField(
                default=webhooks.models.secret_generate,
                help_text="whsec_<base64>: the HMAC-SHA256 key of the signatures",
                max_length=300,
            ),
        ),
        migrations.RunPython(secrets_to_whsec, secrets_from_whsec),
    ]
