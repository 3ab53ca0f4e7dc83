"""Celery tasks of the devices app: thin entry points into the lock's recovery."""

from celery import shared_task

from .lock_recovery import LEASE_RECLAIM_TASK, device_lease_reclaim


@shared_task(name=LEASE_RECLAIM_TASK)
def lease_reclaim_task(device: str, holder: str, fence: int) -> None:
    device_lease_reclaim(device=device, holder=holder, fence=fence)
