"""`manage.py mqtt_identities_sync`: make the broker's device identities match the Device rows."""

from django.core.management.base import BaseCommand, CommandError

from devices.credentials import identities_sync, managed
from iotqueue.dynsec import DynsecError


class Command(BaseCommand):
    help = (
        "Rewrite every device's broker user and role from its row and remove those of deleted "
        "devices (after restoring the broker's file, or rows changed with update())."
    )

    def handle(self, *args, **options):
        if not managed():
            raise CommandError("IOTQUEUE_MQTT_AUTH=none: iotqueue does not manage this broker's identities")
        try:
            written, removed = identities_sync()
        except DynsecError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{written} device identities written, {removed} removed")
