"""`manage.py webhook_demo --url URL`: point the dev stack's demo webhook at a local receiver."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from webhooks.models import EVENT_KINDS, Webhook

DEMO_WEBHOOK = "Demo receiver"
# Printed in the docs and the dev stack's output; development only (DEBUG).
DEMO_SECRET = "demo-webhook-secret-for-development-only"


class Command(BaseCommand):
    help = "Create or update the demo webhook (every event kind) to URL; DEBUG only."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--url", required=True, help="where the demo receiver listens")

    def handle(self, *args, **options):
        if not settings.DEBUG:
            raise CommandError("the demo webhook is for development (DEBUG=true) only")
        Webhook.objects.update_or_create(
            name=DEMO_WEBHOOK,
            defaults={
                "url": options["url"],
                "events": list(EVENT_KINDS),
                "secret": DEMO_SECRET,
                "enabled": True,
            },
        )
        self.stdout.write(f"demo webhook {DEMO_WEBHOOK!r} -> {options['url']}")
