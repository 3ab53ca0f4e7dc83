"""`manage.py locks [DEVICE ...] [--force-release]`: inspect device locks and wait queues."""

from datetime import UTC, datetime

from django.core.management.base import CommandError
from django.utils.translation import gettext as _

from devices.models import Device
from iotqueue.cli_language import LocalizedCommand
from jobs.cancel import lock_force_release
from jobs.cli import printable, table_row
from jobs.waiting import DeviceWork, devices_work

# Waiting steps named after the queue length; the rest are counted, not listed.
QUEUED_SHOWN = 3
# Devices read per round (one Redis pipeline and one query each): a fleet of 100,000 stays
# within SQLite's limit of query parameters and prints as it goes.
DEVICES_PER_READ = 1000
# DEVICE, HOLDER, FENCE, SINCE, LEASE UNTIL, QUEUE: (display width, right-aligned).
COLUMNS = ((24, False), (36, False), (6, True), (8, False), (11, False), (5, True))


def _when(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%S") if ms else "-"


def holder_text(work: DeviceWork) -> str:
    """The holder's run and step (`run 0a1b2c3d step #1 on`), or the raw holder name when it is
    not a step (a locked Celery task), or "-"."""
    if work.holder is not None:
        return work.holder.label()
    return work.lock.holder or "-"


def queued_text(work: DeviceWork) -> str:
    """Who waits, in order: lock queue entries with their position, then the steps waiting
    outside the lock queue for the device to come online."""
    names = []
    for ref in work.queued[:QUEUED_SHOWN]:
        where = f"{ref.queue_position}." if ref.queue_position else _("(offline)")
        names.append(f"{where} {ref.label()}")
    names += work.others[: max(0, QUEUED_SHOWN - len(names))]
    more = work.queue_length - len(names)
    if more > 0:
        names.append(_("and %(count)s more") % {"count": more})
    return "; ".join(names)


def lock_header() -> str:
    header = [_("DEVICE"), _("HOLDER"), _("FENCE"), _("SINCE"), _("LEASE UNTIL"), _("QUEUE")]
    return table_row(header, COLUMNS, _("WAITING"))


def lock_lines(works: list[DeviceWork]) -> list[str]:
    lines = []
    for work in works:
        cells = [
            work.device,
            holder_text(work),
            str(work.lock.fence or "-"),
            _when(work.lock.since_ms),
            _when(work.lock.lease_until_ms),
            str(work.queue_length),
        ]
        lines.append(table_row(cells, COLUMNS, queued_text(work)))
    return lines


class Command(LocalizedCommand):
    help = (
        "Show who holds each device's lock (run and step) and who waits for the device, "
        "including steps waiting for it to come online; optionally force-release (audited). "
        "Times are UTC."
    )

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
                raise CommandError(_("no such device: %(names)s") % {"names": ", ".join(sorted(missing))})
        if options["force_release"]:
            for device in devices:
                holder = lock_force_release(device=device, by=options["by"])
                name = printable(device.name)
                released = _("%(device)s: released from %(holder)s") % {"device": name, "holder": holder}
                self.stdout.write(released if holder else _("%(device)s: free") % {"device": name})
            return
        names = list(devices.values_list("name", flat=True))
        self.stdout.write(lock_header())
        for start in range(0, len(names), DEVICES_PER_READ):
            page = names[start : start + DEVICES_PER_READ]
            works = devices_work(page)
            for line in lock_lines([works[name] for name in page]):
                self.stdout.write(line)
