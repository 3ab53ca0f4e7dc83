"""Template versions: every change recorded (REST, admin), immutable, read over REST and in
the admin; a run executes the version it started with, even when the template is edited while
it runs, and an older version can be run again — real worker, bridge, Redis and broker."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from jobs.models import JobRun, JobStep, JobTemplate, RunStatus, TemplateVersion
from tests.conftest import wait_for
from tests.factories import DeviceFactory
from tests.jobs.test_admin import template_form

pytestmark = pytest.mark.timeout(120)


def template_body(name: str, device: str, second_args: dict) -> dict:
    return {
        "name": name,
        "steps": [
            {"position": 0, "device": device, "action": "prepare", "timeout_seconds": 60},
            {"position": 1, "device": device, "action": "apply", "args": second_args},
        ],
    }


def admin_form(name: str, steps: list[dict]) -> dict:
    """The admin's template form with these steps, every other step field at its default."""
    data = template_form(name, steps)
    for i in range(len(steps)):
        for field in JobStep._meta.concrete_fields:
            key = f"steps-{i}-{field.name}"
            if field.editable and field.has_default() and key not in data and not callable(field.default):
                data[key] = field.default
    return data


def numbers(template: JobTemplate) -> list[int]:
    return list(template.versions.order_by("number").values_list("number", flat=True))


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


# --- recorded on every change -----------------------------------------------------------


@pytest.mark.django_db
def test_rest_saves_record_a_version_each_change_with_its_author(admin_api):
    # given a template created over REST
    device = DeviceFactory()
    body = template_body("Versioned", device.name, {"level": 1})
    assert admin_api.post("/api/templates/", body, format="json").status_code == 201
    template = JobTemplate.objects.get(name="Versioned")
    first = template.versions.get()
    assert (first.number, first.author.username, first.default_priority) == (1, "admin", 5)
    assert [s["action"] for s in first.steps] == ["prepare", "apply"]
    assert first.steps[1]["device"] == device.name

    # when it is saved unchanged, and its description alone is patched
    assert admin_api.put("/api/templates/Versioned/", body, format="json").status_code == 200
    assert (
        admin_api.patch("/api/templates/Versioned/", {"description": "x"}, format="json").status_code == 200
    )
    # then no version is recorded
    assert numbers(template) == [1]

    # when the default priority, then a step changes
    assert (
        admin_api.patch("/api/templates/Versioned/", {"default_priority": 7}, format="json").status_code
        == 200
    )
    changed = template_body("Versioned", device.name, {"level": 2})
    assert admin_api.put("/api/templates/Versioned/", changed, format="json").status_code == 200

    # then each is the next version, holding what changed
    assert numbers(template) == [1, 2, 3]
    latest = template.versions.get(number=3)
    assert (latest.default_priority, latest.steps[1]["args"]) == (7, {"level": 2})


@pytest.mark.django_db
def test_a_version_never_changes():
    # given a recorded version
    device = DeviceFactory()
    template = JobTemplate.objects.create(name="Fixed")
    JobStep.objects.create(template=template, position=0, device=device, action="on")
    from jobs.services import template_version_record

    version = template_version_record(template=template)

    # when it is saved again, then it is refused
    version.default_priority = 9
    with pytest.raises(ValueError, match="immutable"):
        version.save()
    assert TemplateVersion.objects.get(pk=version.pk).default_priority == 5


@pytest.mark.django_db
def test_admin_saves_record_versions_and_show_history_and_diff(client):
    # given an operator who adds a template in the admin
    boss = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(boss)
    gate = DeviceFactory()
    steps = [{"position": 0, "device": gate.pk, "action": "unlock"}]
    assert client.post("/admin/jobs/jobtemplate/add/", admin_form("Gate", steps)).status_code == 302
    template = JobTemplate.objects.get(name="Gate")
    step = template.steps.get()

    # when the step's action is changed in the admin
    data = admin_form("Gate", [{**steps[0], "action": "lock", "id": step.pk, "template": template.pk}])
    data["steps-INITIAL_FORMS"] = 1
    response = client.post(f"/admin/jobs/jobtemplate/{template.pk}/change/", data)
    assert response.status_code == 302, response.context["errors"] if response.context else response

    # then two versions by the operator, listed from the template's page, with their diff
    assert [(v.number, v.author) for v in template.versions.order_by("number")] == [(1, boss), (2, boss)]
    base = f"/admin/jobs/jobtemplate/{template.pk}"
    assert f"{base}/versions/" in client.get(f"{base}/change/").text
    history = client.get(f"{base}/versions/").text
    assert "v1" in history and "v2" in history and "boss" in history
    diff = client.get(f"{base}/versions/diff/?a=1&b=2").text
    assert "-      &quot;action&quot;: &quot;unlock&quot;," in diff
    assert "+      &quot;action&quot;: &quot;lock&quot;," in diff
    page = client.get(f"{base}/versions/1/").text
    assert "Run this version" in page and "unlock" in page
    assert client.get(f"{base}/versions/9/").status_code == 404

    # and "Run this version" starts a run of version 1
    response = client.post(f"{base}/run/?version=1", {"parameters": "{}"})
    run = JobRun.objects.get()
    assert response.status_code == 302
    assert (run.template_version.number, run.plan[0]["action"]) == (1, "unlock")


@pytest.mark.django_db
def test_the_history_of_a_template_without_versions_says_so(client):
    # given a template written with the ORM (a shell), which has no version until it runs
    template = JobTemplate.objects.create(name="Shell")
    client.force_login(User.objects.create_superuser("boss", "boss@example.com", "pw"))

    # when its history is opened
    response = client.get(f"/admin/jobs/jobtemplate/{template.pk}/versions/")

    # then the page says there is none yet (it answered 500 before)
    assert response.status_code == 200
    assert "No versions yet" in response.text


@pytest.mark.django_db
def test_admin_version_pages_need_the_view_permission(client):
    template = JobTemplate.objects.create(name="Hidden")
    viewer = User.objects.create_user("nobody", is_staff=True)
    client.force_login(viewer)
    assert client.get(f"/admin/jobs/jobtemplate/{template.pk}/versions/").status_code == 403


# --- REST -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_versions_are_read_over_rest_by_template_name(admin_api, reader_api):
    # given a template with two versions
    device = DeviceFactory()
    admin_api.post("/api/templates/", template_body("Read me", device.name, {"v": 1}), format="json")
    admin_api.put("/api/templates/Read me/", template_body("Read me", device.name, {"v": 2}), format="json")

    # when a reader lists them and reads one
    listed = reader_api.get("/api/templates/Read me/versions/")
    one = reader_api.get("/api/templates/Read me/versions/1/")

    # then newest first, with author, time and steps
    assert listed.status_code == 200
    assert [v["number"] for v in listed.json()["results"]] == [2, 1]
    assert one.status_code == 200
    body = one.json()
    assert (body["number"], body["author"], body["default_priority"]) == (1, "admin", 5)
    assert body["steps"][1]["args"] == {"v": 1} and body["created_at"]
    assert reader_api.get("/api/templates/Read me/versions/3/").status_code == 404
    assert reader_api.get("/api/templates/nope/versions/").status_code == 404
    # read-only
    assert admin_api.post("/api/templates/Read me/versions/", {}, format="json").status_code == 405
    assert admin_api.delete("/api/templates/Read me/versions/1/").status_code == 405


@pytest.mark.django_db
def test_versions_need_the_view_template_permission():
    JobTemplate.objects.create(name="Secret")
    user = User.objects.create_user("runner")
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_jobrun", "add_jobrun"]))
    client = APIClient()
    client.force_authenticate(user)
    assert client.get("/api/templates/Secret/versions/").status_code == 403
    assert client.get("/api/templates/Secret/versions/1/").status_code == 403
    assert APIClient().get("/api/templates/Secret/versions/").status_code == 401


# --- runs execute their version ---------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_edited_template_does_not_change_a_running_run(stack, manual_device, admin_api):
    # given a run over REST whose first step waits on a device that answers when told
    device = DeviceFactory()
    hand = manual_device(device.name)
    admin_api.post("/api/templates/", template_body("Live", device.name, {"level": 1}), format="json")
    started = admin_api.post("/api/runs/", {"template": "Live"}, format="json")
    assert started.status_code == 201 and started.json()["template_version"] == 1
    run = JobRun.objects.get(pk=started.json()["id"])
    first = hand.next_command()
    assert first["action"] == "prepare"

    # when the template's second step is edited over REST while the run waits
    edited = template_body("Live", device.name, {"level": 99})
    assert admin_api.put("/api/templates/Live/", edited, format="json").status_code == 200

    # and the run goes on
    hand.done(first["id"])
    second = hand.next_command()
    hand.done(second["id"])
    wait_for(lambda: finished(run), what="run to end")

    # then it executed the old second step and records version 1; the template is at 2
    assert (second["action"], second["args"]) == ("apply", {"level": 1})
    assert run.status == RunStatus.SUCCEEDED and run.template_version.number == 1
    assert numbers(JobTemplate.objects.get(name="Live")) == [1, 2]
    assert admin_api.get(f"/api/runs/{run.pk}/").json()["template_version"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_of_an_older_version_executes_that_versions_steps(stack, manual_device, admin_api):
    # given a template at version 2
    device = DeviceFactory()
    hand = manual_device(device.name)
    admin_api.post("/api/templates/", template_body("Old", device.name, {"level": 1}), format="json")
    admin_api.put("/api/templates/Old/", template_body("Old", device.name, {"level": 2}), format="json")

    # when version 1 is started over REST (and a version that does not exist)
    missing = admin_api.post("/api/runs/", {"template": "Old", "template_version": 5}, format="json")
    started = admin_api.post("/api/runs/", {"template": "Old", "template_version": 1}, format="json")

    # then the missing one is refused on its field, and the run executes version 1's steps
    assert missing.status_code == 400 and "template_version" in missing.json()
    assert started.status_code == 201 and started.json()["template_version"] == 1
    run = JobRun.objects.get(pk=started.json()["id"])
    first = hand.next_command()
    hand.done(first["id"])
    second = hand.next_command()
    hand.done(second["id"])
    wait_for(lambda: finished(run), what="run to end")
    assert second["args"] == {"level": 1} and run.status == RunStatus.SUCCEEDED


@pytest.mark.django_db
def test_a_template_changed_outside_admin_and_rest_is_recorded_when_it_runs():
    # given a template whose steps were written with the ORM (a shell), no version yet
    from jobs.services import run_start

    device = DeviceFactory()
    template = JobTemplate.objects.create(name="Shell")
    JobStep.objects.create(template=template, position=0, device=device, action="on")

    # when it runs twice, and once more after an ORM edit
    first, _ = run_start(template=template)
    again, _ = run_start(template=template)
    template.steps.update(action="off")
    edited, _ = run_start(template=template)

    # then the runs record version 1, 1 and 2 (recorded with no author)
    assert [r.template_version.number for r in (first, again, edited)] == [1, 1, 2]
    assert edited.plan[0]["action"] == "off" and edited.template_version.author is None


@pytest.mark.django_db
def test_the_demo_shows_a_template_at_version_2(settings):
    # given the demo's data (development only)
    from devtools.demo import demo_seed, demo_versions_line, run_progress_line
    from jobs.services import run_start

    settings.DEBUG = True
    demo_seed()
    demo_seed()  # seeding again changes nothing

    # then its morning routine was edited once, and a run of it says so
    morning = JobTemplate.objects.get(name="Morning")
    assert numbers(morning) == [1, 2]
    assert "Morning v2" in demo_versions_line()
    run, _ = run_start(template=morning, trigger="cli")
    assert run.plan[1]["args"] == {"level": 60}
    assert run_progress_line(run).split()[:2] == ["Morning", "v2"]
