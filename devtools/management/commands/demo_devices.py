"""`manage.py demo_devices`: the demo's devices on the device agent library, until a signal.

Each enabled demo device (devtools/demo.py DEVICES and BULBS) gets an `Agent`
(devtools/demo_devices.py). Where iotqueue manages the broker's identities, each is issued a
new password and logs in as itself (demo devices only: nothing real has their passwords).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from devices.credentials import device_password_issue, managed
from devices.models import Device
from devtools.demo import BULBS, DEVICES
from devtools.demo_devices import demo_agent

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long the devices get to subscribe before the command says they are online anyway.
CONNECT_SECONDS = 15.0


class Command(BaseCommand):
    help = "Play the demo's devices with the device agent library (iotqueue_device.Agent)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--state-dir", required=True, help="where the devices keep their state files")

    def handle(self, *args: Any, **options: Any) -> None:
        devices = list(Device.objects.filter(enabled=True, name__in=[*DEVICES, *BULBS]).order_by("name"))
        agents = [
            demo_agent(
                device.name,
                settings.MQTT_URL,
                password=device_password_issue(device) if managed() else None,
                state_dir=Path(options["state_dir"]),
                prefix=settings.IOTQUEUE_TOPIC_PREFIX,
            )
            for device in devices
        ]
        stopping = threading.Event()
        previous = {signum: signal.signal(signum, lambda *_: stopping.set()) for signum in STOP_SIGNALS}
        try:
            for agent in agents:
                agent.start()
            missing = [agent.device for agent in agents if not agent.ready.wait(CONNECT_SECONDS)]
            if missing:
                log.warning("demo devices not subscribed yet: %s", ", ".join(missing))
            # The dev stack waits for this line.
            log.info("demo devices: %d online", len(agents) - len(missing))
            stopping.wait()
        finally:
            for agent in agents:
                agent.stop()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
