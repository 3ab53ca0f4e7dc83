"""`manage.py healthcheck worker|beat|bridge`: exit 0 when healthy, 1 when not, one line saying why."""

import sys

from django.core.management.base import BaseCommand

from iotqueue.bridge import bridge_client_id
from iotqueue.health import CHECK_TIMEOUT_SECONDS, Check, beat_check, bridge_check, worker_check


class Command(BaseCommand):
    help = (
        "Check one process of this host (container): worker (answers a Celery ping), beat (ticked "
        "recently, leader or standby), bridge (heartbeat recent, MQTT network thread alive, connected). "
        "Exit status 0 when healthy, 1 when not."
    )
    # Run every few seconds by a supervisor: the system checks (URLconf, admin) are not its business.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("process", choices=("worker", "beat", "bridge"))
        parser.add_argument(
            "--any-host",
            action="store_true",
            help="worker: any worker answering will do, not only one named <name>@<this host>",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=CHECK_TIMEOUT_SECONDS,
            help="worker: seconds to wait for the ping's answers",
        )

    def handle(self, *args, **options):
        process = options["process"]
        if process == "worker":
            check = worker_check(any_host=options["any_host"], timeout=options["timeout"])
        elif process == "beat":
            check = beat_check()
        else:
            check = bridge_check(bridge_client_id())
        self._exit(check)

    def _exit(self, check: Check) -> None:
        line = f"{check.name}: {'ok' if check.ok else 'FAIL'}: {check.reason}"
        (self.stdout if check.ok else self.stderr).write(line)
        sys.exit(0 if check.ok else 1)
