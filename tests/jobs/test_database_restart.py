"""The database restarting under a running wave: every run still succeeds, no device runs two
commands at once, and no device's presence is lost (its status, sent while the database was
away, is applied once it is back: devices/presence.py tries its group again).

PostgreSQL only: SQLite has no server to restart. The machine's PostgreSQL serves more than
this suite, so it is not stopped: what its clients see of a restart is played on the test
database alone. Every connection to it is ended with the FATAL "terminating connection due to
administrator command" a shutdown sends, and new connections are refused (ALLOW_CONNECTIONS
false) until the restart is over.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from django.db import connection

from devices.models import Device
from devtools import pg_restart
from devtools.simulator import DeviceBehaviour, Simulator
from jobs.models import RUN_TERMINAL, JobRun, RunStatus
from jobs.services import run_start
from tests.conftest import database_url, wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite has no database server to restart"),
]

RUNS = 20
# Long enough for every retry a restart causes (the engine's tasks retry, timeouts rescue).
RUN_END_SECONDS = 120.0
# The bridge meeting the outage: a handler's message held, or its presence group's write failing
# (devices/presence.py; the batcher tries the group again).
HELD_LINE = re.compile(r"a handler met an outage; holding messages|batcher presence: flushing \d+ items")


@contextlib.contextmanager
def database_restarting() -> Iterator[None]:
    """The test database down for the body of the `with` (devtools/pg_restart.py); then this
    process's own connection, ended too, is closed so that the next query opens one."""
    try:
        with pg_restart.database_restarting(database_url(), connection.settings_dict["NAME"]):
            yield
    finally:
        connection.close()


def online(name: str) -> bool:
    return Device.objects.get(name=name).online


def test_a_database_restart_mid_wave_loses_no_run_and_no_presence(stack, simulator):
    workers = [DeviceFactory() for _ in range(3)]
    leaving, joining = DeviceFactory(), DeviceFactory(online=False)
    behaviour = DeviceBehaviour(latency_min_ms=50, latency_max_ms=150)
    sim = simulator({device.name: behaviour for device in [*workers, leaving]})
    wait_for(lambda: online(leaving.name), what=f"{leaving.name} online")
    # Built now: a simulator reads nothing once built, so it can connect while the database is away.
    joiner = Simulator({joining.name: behaviour}, url=stack.services.mqtt_url)
    template = template_with_steps(*[(device, "step", {}) for device in workers])
    template.steps.update(timeout_seconds=2, max_attempts=6, backoff_seconds=0.2, queue_timeout_seconds=120)
    runs = [run_start(template=template)[0] for _ in range(RUNS)]
    wait_for(lambda: sim.stats()["totals"]["commands"] >= 4, what="the wave under way")

    bridge = stack.supervisor.children["bridge"]
    since = stack.supervisor.log_size("bridge")
    try:
        with database_restarting():
            # Presence changes while the database is away: a retained "offline" and "online".
            sim.device_remove(leaving.name)
            joiner.start()
            wait_for(
                lambda: HELD_LINE.search(bridge.log_text()[since:]),
                what="the bridge holding the status messages it could not apply",
            )

        ids = [run.pk for run in runs]
        wait_for(
            lambda: not JobRun.objects.filter(pk__in=ids).exclude(status__in=RUN_TERMINAL).exists(),
            timeout=RUN_END_SECONDS,
            what=f"every run to end (logs in {stack.supervisor.log_dir})",
        )
        statuses = set(JobRun.objects.filter(pk__in=ids).values_list("status", flat=True))
        assert statuses == {RunStatus.SUCCEEDED}, statuses
        totals = sim.stats()["totals"]
        assert totals["overlaps"] == 0, sim.stats()["overlaps"]
        wait_for(lambda: not online(leaving.name), what=f"{leaving.name}'s offline, sent during the restart")
        wait_for(lambda: online(joining.name), what=f"{joining.name}'s online, sent during the restart")
        assert bridge.alive(), "the bridge exited during the restart"
        assert "message dropped" not in bridge.log_text()[since:]
    finally:
        joiner.stop()
