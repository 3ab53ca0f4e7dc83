"""`manage.py locks [DEVICE ...] [--force-release]`: inspect device locks and wait queues."""

from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError

from devices.locks import device_lock_state
from devices.models import Device
from jobs.cancel import lock_force_release


def _when(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%S") if ms else "-"


class Command(BaseCommand):
    help = "Show who holds each device's lock and who waits; optionally force-release (audited)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("devices", nargs="*", help="device names (default: every device)")
        parser.add_argument("--force-release", action="store_true", help="take the lock from its holder")
        parser.add_argument("--by", default="cli", help="who is force-releasing, for the audit event")

    def handle(self, *args, **options):
        devices = Device.objects.all()
        if options["devices"]:
            devices = devices.filter(name__in=options["devices"])
            missing = set(options["devices"]) - {d.name for d in devices}
            if missing:
                raise CommandError(f"no such device: {', '.join(sorted(missing))}")
        for device in devices:
            if options["force_release"]:
                holder = lock_force_release(device=device, by=options["by"])
                self.stdout.write(
                    f"{device.name}: released from {holder}" if holder else f"{device.name}: free"
                )
                continue
            state = device_lock_state(device.name)
            self.stdout.write(
                f"{device.name:<24} holder={state.holder or '-':<14} fence={state.fence or '-':<6} "
                f"since={_when(state.since_ms)} lease_until={_when(state.lease_until_ms)} "
                f"queue={len(state.queue)} {' '.join(state.queue[:5])}"
            )
