"""Label selectors on the real stack: a fan-out step's selector read when the step starts,
`?selector=` on the device list, and bulk label edits over REST."""

from __future__ import annotations

import uuid

import pytest

from devices.models import Device
from devtools.simulator import DeviceBehaviour
from jobs.choices import StepKind
from jobs.models import JobRun, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def fleet(tag: str) -> dict[str, Device]:
    labels = {
        "berlin": {"site": "berlin"},
        "paris": {"site": "paris"},
        "paris-legacy": {"site": "paris", "legacy": "yes"},
        "rome": {"site": "rome"},
        "late": {"site": "rome"},
        "dropped": {"site": "berlin"},
    }
    return {
        key: DeviceFactory(name=f"{tag}-{key}", labels={**value, "fleet": tag})
        for key, value in labels.items()
    }


def test_a_fanout_selector_is_read_when_the_step_starts(stack, simulator, admin_api):
    # given a fleet, and a template that waits, then fans out to `site in (berlin,paris),!legacy`
    tag = f"sel-{uuid.uuid4().hex[:6]}"
    devices = fleet(tag)
    sim = simulator({d.name: DeviceBehaviour() for d in devices.values()})
    template = JobTemplateFactory()
    JobStepFactory(template=template, position=0, kind=StepKind.DELAY, device=None, delay_seconds=3)
    JobStepFactory(
        template=template,
        position=1,
        device=None,
        selector=f"fleet={tag},site in (berlin,paris),!legacy",
        action="firmware/check",
    )

    # when the run starts, and during its delay one device moves to paris and one is marked legacy
    run, _ = run_start(template=template)
    for name, change in (
        (devices["late"].name, {"set": {"site": "paris"}}),
        (devices["dropped"].name, {"set": {"legacy": "1"}}),
    ):
        response = admin_api.post("/api/devices/labels/", {"devices": [name], **change}, format="json")
        assert response.status_code == 200, response.content
    assert not StepRun.objects.filter(run=run, index=1).exists()  # relabelled before the fan-out started

    # then the fan-out reached exactly the devices matching at its start
    assert wait_for(lambda: finished(run), timeout=30).status == RunStatus.SUCCEEDED
    expected = {devices[key].name for key in ("berlin", "paris", "late")}
    rows = StepRun.objects.filter(run=run, index=1)
    assert set(rows.values_list("device__name", flat=True)) == expected
    assert set(rows.values_list("status", flat=True)) == {StepStatus.SUCCEEDED}
    assert {d.name for d in devices.values() if sim.received(d.name)} == expected


def test_bulk_label_edit_by_selector_and_by_names(stack, admin_api):
    tag = f"bulk-{uuid.uuid4().hex[:6]}"
    devices = fleet(tag)

    # when paris devices get a tier and lose `legacy`
    response = admin_api.post(
        "/api/devices/labels/",
        {"selector": f"fleet={tag},site=paris", "set": {"tier": "beta"}, "remove": ["legacy"]},
        format="json",
    )

    # then exactly they changed, and the device list's selector sees it
    assert response.status_code == 200, response.content
    paris = sorted([devices["paris"].name, devices["paris-legacy"].name])
    assert response.json() == {"matched": 2, "changed": 2, "devices": paris}
    assert Device.objects.get(name=devices["paris-legacy"].name).labels == {
        "site": "paris",
        "fleet": tag,
        "tier": "beta",
    }
    listed = admin_api.get("/api/devices/", {"selector": f"fleet={tag},tier", "page_size": 100}).json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert sorted(d["name"] for d in rows) == paris

    # when names are given and one device already has the label
    response = admin_api.post(
        "/api/devices/labels/",
        {"devices": [devices["paris"].name, devices["rome"].name], "set": {"tier": "beta"}},
        format="json",
    )
    assert response.json() == {"matched": 2, "changed": 1, "devices": [devices["rome"].name]}


def test_bulk_label_edit_refuses_bad_input_and_readers(stack, admin_api, reader_api):
    tag = f"bad-{uuid.uuid4().hex[:6]}"
    devices = fleet(tag)
    name = devices["rome"].name
    bad = {
        "unknown name": {"devices": [name, f"{tag}-nope"], "set": {"a": "b"}},
        "no target": {"set": {"a": "b"}},
        "both targets": {"devices": [name], "selector": "a", "set": {"a": "b"}},
        "empty selector": {"selector": " ", "set": {"a": "b"}},
        "bad selector": {"selector": "site in (a", "set": {"a": "b"}},
        "nothing to do": {"devices": [name]},
        "number value": {"devices": [name], "set": {"a": 1}},
        "set and removed": {"devices": [name], "set": {"a": "b"}, "remove": ["a"]},
    }
    answers = {
        what: admin_api.post("/api/devices/labels/", body, format="json") for what, body in bad.items()
    }
    assert {what: r.status_code for what, r in answers.items()} == dict.fromkeys(bad, 400)
    assert f"{tag}-nope" in str(answers["unknown name"].json())
    assert admin_api.get("/api/devices/", {"selector": "site in ("}).status_code == 400

    # a reader may not
    response = reader_api.post("/api/devices/labels/", {"devices": [name], "set": {"a": "b"}}, format="json")
    assert response.status_code == 403
    assert Device.objects.get(name=name).labels == {"site": "rome", "fleet": tag}
