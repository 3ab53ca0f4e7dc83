"""Device commands inside Celery canvases, on the real stack: the worker parks a link while
the simulated device works and sends the canvas on with its result."""

from __future__ import annotations

import uuid

import pytest
from celery import chain, chord
from celery.result import AsyncResult

from devtools.simulator import DeviceBehaviour
from jobs.cancel import run_cancel
from jobs.canvas import CANVAS_TEMPLATE, device_command
from jobs.models import CanvasLink, JobRun, RunStatus, StepRun, Trigger
from jobs.services import run_start
from tests.conftest import WAIT_SECONDS, wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.jobs.canvas_tasks import fetch_url, on_error, recorded, report, summarize

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def key() -> str:
    return uuid.uuid4().hex[:8]


def test_a_chain_of_task_device_command_task_passes_results_through(stack, simulator):
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour()})
    k = key()

    # when a chain fetches a URL, flashes the device with it and reports the device's result
    flash = device_command(device, "flash", {"url": "{{ params.previous.url }}"}, timeout_seconds=30)
    chain(fetch_url.s("v2.1"), flash, report.s(key=k)).apply_async()

    # then the device got the URL from the first link, and the last link the device's result
    reported = wait_for(lambda: recorded(k), what="the report link")
    assert reported == [
        {"device": device.name, "action": "flash", "echo": {"url": "https://firmware.example/v2.1.bin"}}
    ]
    assert [c["args"] for c in sim.received(device.name)] == [{"url": "https://firmware.example/v2.1.bin"}]
    # and the command is a run like any other, filed under the canvas template
    run = JobRun.objects.get(trigger=Trigger.CANVAS)
    assert (run.status, run.template.name) == (RunStatus.SUCCEEDED, CANVAS_TEMPLATE)
    assert run.parameters == {"previous": {"url": "https://firmware.example/v2.1.bin"}}
    assert CanvasLink.objects.get(run=run).resumed_at is not None


def test_a_chord_over_ten_devices_calls_back_once_with_ten_results(stack, simulator):
    devices = [DeviceFactory() for _ in range(10)]
    simulator({d.name: DeviceBehaviour(latency_min_ms=20, latency_max_ms=300) for d in devices})
    k = key()

    result = chord(device_command(d, "selftest") for d in devices)(summarize.s(key=k))

    assert result.get(timeout=WAIT_SECONDS) == 10
    calls = recorded(k)
    assert len(calls) == 1
    assert sorted(r["device"] for r in calls[0]) == sorted(d.name for d in devices)
    assert JobRun.objects.filter(trigger=Trigger.CANVAS, status=RunStatus.SUCCEEDED).count() == 10


def test_async_result_of_a_link_is_the_devices_result(stack, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})

    link = device_command(device, "read_info").apply_async()

    assert link.get(timeout=WAIT_SECONDS)["serial"] == f"SN-{device.name}"
    assert AsyncResult(link.id).successful()


def test_a_failing_device_stops_the_chain_and_runs_its_errback(stack, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(failing_actions=frozenset({"flash"}))})
    k_after, k_error = key(), key()

    flash = device_command(device, "flash", max_attempts=2, backoff_seconds=0.1)
    chain(flash, report.s(key=k_after)).apply_async(link_error=on_error.s(key=k_error))

    errors = wait_for(lambda: recorded(k_error), what="the errback")
    assert len(errors) == 1 and "DeviceCommandFailed" in errors[0]["error"]
    run = JobRun.objects.get(trigger=Trigger.CANVAS)
    assert run.status == RunStatus.FAILED
    assert StepRun.objects.get(run=run).attempt == 2
    # the chain never went on: its next link is sent only on success, and the run has ended
    assert recorded(k_after) == []


def test_an_unknown_device_fails_the_link_at_once(stack):
    k_error = key()
    device_command("no-such-device", "flash").apply_async(link_error=on_error.s(key=k_error))
    errors = wait_for(lambda: recorded(k_error), what="the errback")
    assert "no device named 'no-such-device'" in errors[0]["error"]
    assert not JobRun.objects.filter(trigger=Trigger.CANVAS).exists()


def test_canvas_commands_and_template_runs_share_a_device_without_overlap(stack, simulator):
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=50, latency_max_ms=150)})
    template = template_with_steps((device, "step", {}), (device, "step", {}))

    links = [device_command(device, "canvas-step").apply_async() for _ in range(4)]
    runs = [run_start(template=template)[0] for _ in range(3)]
    for link in links:
        link.get(timeout=WAIT_SECONDS)
    ids = [r.pk for r in runs]
    wait_for(
        lambda: not JobRun.objects.filter(pk__in=ids).exclude(status=RunStatus.SUCCEEDED).exists(),
        what="the template runs",
    )
    totals = sim.stats()["totals"]
    assert totals["commands"] == 4 + 3 * 2
    assert totals["overlaps"] == 0, sim.stats()["overlaps"]


def test_canceling_a_links_run_fails_the_link_and_runs_its_errback(stack, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(silent=True)})  # takes the command, never answers
    k_after, k_error = key(), key()

    chain(device_command(device, "flash"), report.s(key=k_after)).apply_async(
        link_error=on_error.s(key=k_error)
    )
    run = wait_for(
        lambda: JobRun.objects.filter(trigger=Trigger.CANVAS, status=RunStatus.RUNNING).first(),
        what="the run",
    )
    run_cancel(run=run, by="tester")

    errors = wait_for(lambda: recorded(k_error), what="the errback")
    assert "canceled" in errors[0]["error"]
    assert recorded(k_after) == []
