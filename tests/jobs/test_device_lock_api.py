"""`GET /api/devices/<name>/lock/` names the run and step behind each holder and waiter, not a
bare `step:149` (jobs/api.py DeviceLockView)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from devices.locks import device_lock_acquire, device_lock_dequeue, device_lock_release, lock_epoch_start
from tests.factories import DeviceFactory, template_with_steps
from tests.jobs.test_admin_lists import run_at

pytestmark = pytest.mark.django_db


def test_the_lock_names_the_holders_run_and_the_waiting_runs_in_order(admin_api):
    # given a pump whose lock a run's step holds, with two more runs' steps queued behind it
    lock_epoch_start()
    pump = DeviceFactory(name="pump-9")
    holding = run_at(template_with_steps((pump, "firmware/check", {}))).step_runs.get()
    waiters = [run_at(template_with_steps((pump, "valve/open", {}))).step_runs.get() for _ in range(2)]
    grant = device_lock_acquire(pump.name, holder=f"step:{holding.pk}", priority=5, lease_seconds=60)
    for waiter in waiters:
        device_lock_acquire(pump.name, holder=f"step:{waiter.pk}", priority=5, lease_seconds=60)
    try:
        # when the lock is read over REST
        lock = admin_api.get(f"/api/devices/{pump.name}/lock/").json()
    finally:
        for waiter in waiters:
            device_lock_dequeue(pump.name, holder=f"step:{waiter.pk}")
        device_lock_release(pump.name, holder=f"step:{holding.pk}", fence=grant.fence)

    # then the raw lock state is there, and the run and step behind each entry
    assert (lock["holder"], lock["fence"]) == (f"step:{holding.pk}", grant.fence)
    assert lock["holder_step"]["run"] == str(holding.run_id)
    assert (lock["holder_step"]["index"], lock["holder_step"]["action"]) == (0, "firmware/check")
    assert [(w["run"], w["queue_position"]) for w in lock["waiting"]] == [
        (str(waiters[0].run_id), 1),
        (str(waiters[1].run_id), 2),
    ]


def test_reading_a_lock_needs_the_view_device_permission(admin_api):
    # given a device and a user with no permission at all
    DeviceFactory(name="pump-10")
    nobody = APIClient()
    nobody.force_authenticate(User.objects.create_user("nobody"))

    # then the user is refused, the admin is not, and a missing device is 404
    assert nobody.get("/api/devices/pump-10/lock/").status_code == 403
    assert admin_api.get("/api/devices/pump-10/lock/").json()["holder_step"] is None
    assert admin_api.get("/api/devices/nope/lock/").status_code == 404
