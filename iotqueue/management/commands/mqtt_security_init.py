"""`manage.py mqtt_security_init PATH`: the broker's first identity file, before it first starts."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from iotqueue.dynsec import config_write
from iotqueue.mqtt import broker_address


class Command(BaseCommand):
    help = (
        "Write Mosquitto's dynamic security file with the iotqueue service user of MQTT_URL "
        "(administrator of the plugin, all normal topics). Leaves an existing file alone."
    )
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="the plugin's file (plugin_opt_config_file)")
        parser.add_argument(
            "--force", action="store_true", help="overwrite an existing file (all devices lost)"
        )

    def handle(self, *args, path: Path, force: bool, **options):
        address = broker_address()
        if not address.username or not address.password:
            raise CommandError("MQTT_URL has no user and password: mqtt://iotqueue:<password>@host:1883")
        if config_write(path, address.username, address.password, force=force):
            self.stdout.write(f"{path}: written, service user {address.username!r}")
        else:
            self.stdout.write(f"{path}: exists, left alone (the broker keeps its identities there)")
