"""Celery tasks of the devices app: thin entry points into the lock's recovery.

`devices.locks_maintain` is the device lock's own maintenance pass (rebuild after Redis lost
its data, hand expired leases to `devices.lease_reclaim`). The jobs app's monitor tick runs
the same pass every tick; a project that uses only DeviceLockedTask schedules this task in
beat instead (every second or so).
"""

from celery import shared_task

from .lock_recovery import LEASE_RECLAIM_TASK, device_lease_reclaim, locks_maintain


@shared_task(name=LEASE_RECLAIM_TASK)
def lease_reclaim_task(device: str, holder: str, fence: int) -> None:
    device_lease_reclaim(device=device, holder=holder, fence=fence)


@shared_task(name="devices.locks_maintain")
def locks_maintain_task() -> dict:
    return locks_maintain()
