"""`POST /api/runs/preview/` on the real stack: a fan-out's targets, presence and queues as
the engine would find them, validated as a start is, and nothing started or written."""

import uuid

import pytest

from devices.locks import device_lock_states
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, StepRun, TemplateVersion
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def test_a_fanout_preview_counts_presence_and_queues_and_writes_nothing(stack, simulator, admin_api):
    # Given a labelled fleet: 2 offline, 1 disabled, 1 busy with a step queued behind its holder
    label = f"preview-{uuid.uuid4().hex[:6]}"
    fleet = [DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}) for i in range(10)]
    busy, offline, disabled = fleet[0], fleet[1:3], fleet[3]
    for device in offline:
        device.online = False
        device.save(update_fields=["online"])
    disabled.enabled = False
    disabled.save(update_fields=["enabled"])
    slow = DeviceBehaviour(latency_min_ms=4000, latency_max_ms=4000)
    simulator({busy.name: slow})
    holding, _ = run_start(template=template_with_steps((busy, "hold", {})))
    behind, _ = run_start(template=template_with_steps((busy, "hold", {})))
    wait_for(
        lambda: len(device_lock_states([busy.name])[busy.name].queue) == 1,
        what="a second step queued behind the busy device's holder",
    )
    step = JobStepFactory(
        device=None, labels={"kind": label}, action=f"{label}/flash", rollout_per_minute=120, max_in_flight=4
    )
    runs, rows, versions = JobRun.objects.count(), StepRun.objects.count(), TemplateVersion.objects.count()

    # When the start is previewed
    answer = admin_api.post("/api/runs/preview/", {"template": step.template.name}, format="json")

    # Then: the counts, the busy device's queue, the method of the estimate
    assert answer.status_code == 200, answer.content
    body = answer.json()
    (preview,) = body["steps"]
    devices = preview["devices"]
    assert (devices["matched"], devices["enabled"], devices["disabled"]) == (10, 9, 1)
    assert (devices["online"], devices["offline_waiting"], devices["busy"]) == (7, 2, 1)
    assert devices["queued_ahead"] == 2  # the holder and the step behind it
    items = {item["name"]: item for item in devices["items"]}
    assert items[busy.name]["holder"] is not None and items[busy.name]["queue_depth"] == 1
    assert items[fleet[5].name]["holder"] is None and items[fleet[5].name]["queue_depth"] == 0
    assert preview["kind"] == "fanout" and preview["problems"] == []
    assert preview["rollout"]["rollout_per_minute"] == 120
    estimate = preview["estimate"]
    assert estimate["method"] == "rollout_replay" and estimate["typical_source"] == "default"
    assert estimate["rows_timing_out"] == 2  # the offline devices wait out their queue timeout
    assert body["estimate"]["seconds"] == estimate["seconds"] > 0
    # ... and nothing was written or queued
    assert (JobRun.objects.count(), StepRun.objects.count()) == (runs, rows)
    assert TemplateVersion.objects.count() == versions
    states = device_lock_states([device.name for device in fleet])
    assert len(states[busy.name].queue) == 1
    assert all(states[d.name].holder is None and not states[d.name].queue for d in fleet[1:])

    # A start's 400s: the same answer for the same mistake
    bad = {"template": step.template.name, "priority": 12}
    assert admin_api.post("/api/runs/preview/", bad, format="json").json() == (
        admin_api.post("/api/runs/", bad, format="json").json()
    )
    assert wait_for(lambda: finished(behind), timeout=60)
    assert finished(holding)


def test_the_admin_previews_a_start_on_the_run_now_page_before_the_operator_confirms(client):
    # Given a template of two single-device steps, one device busy-free and online
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("previewer", "p@example.com", "pw"))
    lamp = DeviceFactory()
    template = template_with_steps((lamp, "on", {"level": "{{ params.level }}"}), (lamp, "off", {}))
    url = f"/admin/jobs/jobtemplate/{template.pk}/run/"

    # When the operator presses Preview
    page = client.post(url, {"param_level": "60", "_preview": "Preview"})

    # Then the page shows the preview, the form kept, and nothing started
    assert page.status_code == 200, page.text
    assert 'id="run-preview"' in page.text and "Estimated finish" in page.text
    assert page.context["preview"]["steps"][0]["devices"]["online"] == 1
    assert page.context["preview"]["estimate"]["seconds"] > 0
    assert 'value="60"' in page.text
    assert not JobRun.objects.filter(template=template).exists()
    # ... the same mistakes are refused as a start refuses them
    bad = client.post(url, {"_preview": "Preview"})
    assert "params.level" in bad.text and bad.context["preview"] is None

    # And confirming starts the run
    started = client.post(url, {"param_level": "60", "_run": "Start run"})
    assert started.status_code == 302
    assert JobRun.objects.filter(template=template).count() == 1


def test_a_preview_reads_a_fixed_number_of_queries_however_many_devices_match(admin_api):
    # Given two fan-outs over 3 and 40 devices
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries_for(devices: int) -> int:
        label = f"count-{uuid.uuid4().hex[:6]}"
        for i in range(devices):
            DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}, online=i % 2 == 0)
        step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/check")
        with CaptureQueriesContext(connection) as queries:
            answer = admin_api.post("/api/runs/preview/", {"template": step.template.name}, format="json")
        assert answer.status_code == 200
        assert answer.json()["steps"][0]["devices"]["online"] == (devices + 1) // 2
        return len(queries)

    # Then both take as many queries (once the process has read the shared concurrency
    # limits, which it keeps for a few seconds: jobs/limits.py)
    queries_for(1)
    assert queries_for(3) == queries_for(40)


def test_a_for_each_preview_names_the_runs_and_is_refused_as_a_start_is(admin_api, reader_api):
    label = f"each-{uuid.uuid4().hex[:6]}"
    for i in range(3):
        DeviceFactory(name=f"{label}-{i}", labels={"site": label})
    template = JobStepFactory(device=None, device_param="device", action="check").template
    body = {"template": template.name, "for_each": {"labels": {"site": label}}}

    answer = admin_api.post("/api/runs/preview/", body, format="json").json()

    assert answer["runs"] == 3 and answer["for_each"]["devices"] == [f"{label}-{i}" for i in range(3)]
    assert answer["steps"][0]["target"] == "{{ params.device }}"
    assert answer["steps"][0]["devices"]["items"][0]["name"] == f"{label}-0"
    assert answer["template_version"] == 1  # the version a start would record
    assert not JobRun.objects.filter(template=template).exists()
    nowhere = {"template": template.name, "for_each": {"labels": {"site": "nowhere"}}}
    refused = admin_api.post("/api/runs/preview/", nowhere, format="json")
    assert refused.status_code == 400 and refused.json() == {"for_each": ["no enabled device matches"]}
    # Who may not start runs may not preview one
    assert reader_api.post("/api/runs/preview/", body, format="json").status_code == 403


def test_a_continuous_fanout_previews_as_open_and_is_not_refused_without_devices(admin_api):
    # Given a continuous fan-out whose selector matches no device yet, open for an hour
    step = JobStepFactory(
        device=None,
        selector=f"site=later-{uuid.uuid4().hex[:6]}",
        action="firmware/flash",
        continuous=True,
        open_seconds=3600,
    )

    # When previewed
    answer = admin_api.post("/api/runs/preview/", {"template": step.template.name}, format="json").json()

    # Then it says the fan-out is continuous, with nothing that would fail it, lasting its end-by
    previewed = answer["steps"][0]
    assert previewed["continuous"]["open_seconds"] == 3600
    assert "continuous" in previewed["continuous"]["note"]
    assert previewed["problems"] == [] and answer["problems"] == []
    assert previewed["estimate"]["method"] == "continuous_end_by"
    assert previewed["estimate"]["seconds"] == 3600
