"""`manage.py mqtt_identities_sync`: make the broker's device identities match the Device rows."""

from django.core.management.base import BaseCommand, CommandError
from django.utils.translation import gettext as _

from devices.credentials import identities_sync, managed
from iotqueue.dynsec import DynsecError, service_role_complete


class Command(BaseCommand):
    help = (
        "Rewrite every device's broker user and role from its row and remove those of deleted "
        "devices (after restoring the broker's file, or rows changed with update()), and give "
        "iotqueue's service role the $-topic permissions it needs. Users and "
        "roles iotqueue did not create are reported and left alone; those from before iotqueue "
        "marked its own are adopted."
    )

    def handle(self, *args, **options):
        if not managed():
            raise CommandError("IOTQUEUE_MQTT_AUTH=none: iotqueue does not manage this broker's identities")
        try:
            # A broker set up before the AWS IoT Jobs profile learns the services' $aws ACLs.
            service_role_complete()
            report = identities_sync()
        except DynsecError as exc:
            raise CommandError(str(exc)) from exc
        for line in report.foreign:
            self.stderr.write(_("left alone, not iotqueue's: %(entry)s") % {"entry": line})
        self.stdout.write(
            _(
                "%(written)d device identities written, %(removed)d removed, "
                "%(foreign)d not iotqueue's left alone"
            )
            % {"written": report.written, "removed": report.removed, "foreign": len(report.foreign)}
        )
