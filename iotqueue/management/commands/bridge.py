"""`manage.py bridge`: run the MQTT bridge until SIGINT/SIGTERM (or, non-zero, until it cannot serve)."""

import logging
import signal
import sys

from django.core.management.base import BaseCommand

from iotqueue.bridge import Bridge
from iotqueue.gcfreeze import startup_objects_freeze
from iotqueue.startup import StartupError, startup_check

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Subscribe to device topics and hand replies and presence to the engine."
    # System checks import the URLconf (REST API, schema, admin): ~18 MiB the bridge never
    # uses, against its 100 MB budget with 10,000 devices (bench/README.md, memory soak).
    # The web service and `migrate` run the checks.
    requires_system_checks = []

    def handle(self, *args, **options):
        try:
            # Migrations (~2 MiB of migration modules loaded), Redis, the broker and its plugin.
            startup_check()
        except StartupError as exc:
            # One line, no traceback: what is wrong and what to do (docs/operations.md).
            sys.stderr.write(f"bridge: {exc}\n")
            raise SystemExit(1) from None
        bridge = Bridge()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: bridge.stop())
        log.info("bridge: starting")
        startup_objects_freeze("bridge")
        bridge.run()
        log.info("bridge: stopped (%s)", dict(bridge.stats))
        if bridge.exit_code:
            # Its MQTT network thread died: a non-zero status makes the supervisor restart it.
            raise SystemExit(bridge.exit_code)
