"""The admin as orchestration console: pages, inline steps, Run now, cancel / retry, the live
run timeline, device lock columns, permissions, and a query count that does not grow with rows."""

from __future__ import annotations

import json

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django.utils.html import escape

from devices.locks import device_lock_acquire, device_lock_dequeue, device_lock_state, lock_epoch_start
from devices.models import DeviceGroup
from devtools.simulator import DeviceBehaviour
from jobs.admin.display import json_block
from jobs.admin.runs import JobRunAdmin
from jobs.models import JobRun, JobStep, RunEvent, RunStatus, StepRun, StepStatus, Trigger
from jobs.services import template_plan
from jobs.timeline import EVENTS_SHOWN
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    return user


def staff_with(client, *codenames: str) -> User:
    """A logged-in staff user holding only the named permissions."""
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client.force_login(user)
    return user


def run_make(template, *, status=RunStatus.SUCCEEDED, events: int = 3, **fields) -> JobRun:
    """A run of `template` as the engine leaves it: one step row per step, a few events."""
    now = timezone.now()
    terminal = status not in (RunStatus.PENDING, RunStatus.RUNNING)
    run = JobRun.objects.create(
        template=template,
        plan=template_plan(template),
        status=status,
        started_at=now,
        finished_at=now if terminal else None,
        **fields,
    )
    for step in template.steps.all():
        StepRun.objects.create(
            run=run,
            index=step.position,
            device=step.device,
            action=step.action,
            status=StepStatus.SUCCEEDED if terminal else StepStatus.DISPATCHED,
            attempt=1,
            result={"echo": step.args} if terminal else None,
            queued_at=now,
            dispatched_at=now,
            finished_at=now if terminal else None,
        )
    kinds = ["run.created", "step.dispatched", "reply.stale"]
    RunEvent.objects.bulk_create(
        RunEvent(run=run, kind=kinds[i % len(kinds)], device="x", message=f"event {i}") for i in range(events)
    )
    return run


@pytest.fixture
def template():
    gate, lamp = DeviceFactory(), DeviceFactory()
    return template_with_steps((gate, "unlock", {}), (lamp, "on", {"level": 80}))


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# --- pages ------------------------------------------------------------------------------


def test_every_changelist_and_change_form_renders(client, boss, template):
    run = run_make(template)
    group = DeviceGroup.objects.create(name="berlin-pumps")
    device = template.steps.first().device
    for url in (
        "/admin/jobs/jobtemplate/",
        f"/admin/jobs/jobtemplate/{template.pk}/change/",
        "/admin/jobs/jobtemplate/add/",
        "/admin/jobs/jobrun/",
        f"/admin/jobs/jobrun/?q={str(run.pk)[:8]}",
        f"/admin/jobs/jobrun/{run.pk}/change/",
        "/admin/jobs/steprun/",
        f"/admin/jobs/steprun/?q={device.name}",
        f"/admin/jobs/steprun/?run__id__exact={run.pk}",
        f"/admin/jobs/steprun/{run.step_runs.first().pk}/change/",
        "/admin/jobs/runevent/",
        "/admin/jobs/runevent/?tone=attention",
        "/admin/jobs/runevent/?tone=failure",
        "/admin/jobs/runevent/?tone=step.",
        "/admin/jobs/runevent/?q=reply.stale",
        f"/admin/jobs/runevent/?run__id__exact={run.pk}",
        f"/admin/jobs/runevent/{run.events.first().pk}/change/",
        "/admin/devices/device/",
        f"/admin/devices/device/{device.pk}/change/",
        "/admin/devices/devicegroup/",
        f"/admin/devices/devicegroup/{group.pk}/change/",
    ):
        assert client.get(url).status_code == 200, url


def test_template_page_lists_steps_inline_and_offers_run_now(client, boss, template):
    page = client.get(f"/admin/jobs/jobtemplate/{template.pk}/change/").text
    assert 'name="steps-0-action"' in page and 'value="unlock"' in page
    assert f"/admin/jobs/jobtemplate/{template.pk}/run/" in page
    assert "Run now" in client.get("/admin/jobs/jobtemplate/").text


STEP_DEFAULTS = {
    "name": "",
    "kind": "command",
    "args": "{}",
    "device": "",
    "device_param": "",
    "group": "",
    "labels": "{}",
    "timeout_seconds": 60,
    "max_extend_seconds": 3600,
    "ack_timeout_seconds": 0,
    "queue_timeout_seconds": 600,
    "delay_seconds": 0,
    "max_attempts": 1,
    "backoff_seconds": 1.0,
    "on_failure": "abort",
    "compensation_action": "",
    "compensation_args": "{}",
    "rollout_per_minute": 0,
    "max_in_flight": 0,
    "abort_failure_percent": "",
    "abort_min_devices": 0,
    "abort_criteria": "[]",
    "rollout_increment_factor": 1.0,
    "rollout_increment_every": 0,
    "rollout_increment_on": "succeeded",
    "rollout_max_per_minute": 0,
    "compensation_per_minute": 0,
    "success_percent": 100,
}


def template_form(name: str, steps: list[dict]) -> dict:
    """POST data of the template add form with these inline steps."""
    data = {
        "name": name,
        "description": "",
        "default_priority": 5,
        "steps-TOTAL_FORMS": len(steps),
        "steps-INITIAL_FORMS": 0,
        "steps-MIN_NUM_FORMS": 0,
        "steps-MAX_NUM_FORMS": 1000,
    }
    for i, step in enumerate(steps):
        data.update({f"steps-{i}-{field}": value for field, value in {**STEP_DEFAULTS, **step}.items()})
    return data


def test_template_saves_with_ordered_inline_steps(client, boss):
    gate, cam = DeviceFactory(), DeviceFactory()
    steps = [
        {"position": 0, "name": "open", "device": gate.pk, "action": "unlock"},
        {
            "position": 1,
            "device": cam.pk,
            "action": "snapshot",
            "args": '{"after": "{{ steps.open.result }}"}',
        },
    ]
    response = client.post("/admin/jobs/jobtemplate/add/", template_form("Morning-admin", steps))
    assert response.status_code == 302, response.context["errors"] if response.context else response
    saved = JobStep.objects.filter(template__name="Morning-admin").order_by("position")
    assert [(s.device, s.action) for s in saved] == [(gate, "unlock"), (cam, "snapshot")]


def test_template_with_bad_steps_shows_the_errors(client, boss):
    gate = DeviceFactory()
    no_target = [{"position": 0, "action": "unlock"}]
    response = client.post("/admin/jobs/jobtemplate/add/", template_form("Broken-1", no_target))
    assert response.status_code == 200
    assert "Choose exactly one target" in response.text

    later = [
        {"position": 0, "device": gate.pk, "action": "unlock", "args": '{"x": "{{ steps.close.result }}"}'},
        {"position": 1, "name": "close", "device": gate.pk, "action": "lock"},
    ]
    response = client.post("/admin/jobs/jobtemplate/add/", template_form("Broken-2", later))
    assert response.status_code == 200
    assert "step 0, args" in response.text
    assert not JobStep.objects.filter(template__name__startswith="Broken").exists()


def test_bad_step_errors_show_on_the_step_fields(client, boss):
    steps = [
        {"position": 0, "action": "unlock"},
        {"position": 1, "kind": "delay", "delay_seconds": 0, "action": ""},
        {"position": 2, "device": DeviceFactory().pk, "action": "bad action!"},
    ]
    response = client.post("/admin/jobs/jobtemplate/add/", template_form("Broken-3", steps))
    assert response.status_code == 200
    forms = response.context["inline_admin_formsets"][0].formset.forms
    assert forms[0].errors["device"] == [
        "Choose exactly one target: device, device_param, group, labels, selector or devices_from."
    ]
    assert forms[1].errors["delay_seconds"] == ["A delay step needs delay_seconds > 0."]
    assert forms[2].errors["action"] == ["Use letters, digits and . _ / - only."]


# --- Run now ----------------------------------------------------------------------------


def test_run_now_form_validates_and_starts_a_run(client, boss, template):
    url = f"/admin/jobs/jobtemplate/{template.pk}/run/"
    form = client.get(url)
    assert form.status_code == 200
    assert 'name="parameters"' in form.text and "unlock" in form.text  # the steps are listed

    for parameters, error in (("{level: 80", "Not valid JSON"), ("[1, 2]", "Must be a JSON object")):
        response = client.post(url, {"parameters": parameters})
        assert response.status_code == 200 and error in response.text
    response = client.post(url, {"parameters": "{}", "priority": 12})
    assert "less than or equal to 9" in response.text
    assert not JobRun.objects.exists()

    response = client.post(url, {"parameters": '{"level": 60}', "priority": 8})
    run = JobRun.objects.get()
    assert response.status_code == 302 and response.url == f"/admin/jobs/jobrun/{run.pk}/change/"
    assert (run.parameters, run.priority, run.trigger, run.triggered_by) == (
        {"level": 60},
        8,
        Trigger.ADMIN,
        "boss",
    )


def test_run_now_reports_what_the_service_refuses_on_its_field(client, boss):
    empty = JobTemplateFactory()
    response = client.post(f"/admin/jobs/jobtemplate/{empty.pk}/run/", {"parameters": "{}"})
    assert response.status_code == 200 and "has no steps" in response.text

    lamp = DeviceFactory()
    template = template_with_steps((lamp, "on", {}))
    url = f"/admin/jobs/jobtemplate/{template.pk}/run/"
    response = client.post(url, {"parameters": "{}", "labels": '{"site": "nowhere"}'})
    assert response.status_code == 200 and "no enabled device matches" in response.text
    assert "Labels must be a JSON object of strings" in client.post(url, {"labels": '{"n": 1}'}).text
    assert not JobRun.objects.exists()


def test_run_now_for_each_device_starts_one_run_per_device(client, boss):
    pumps = [DeviceFactory(labels={"kind": "pump-admin"}) for _ in range(3)]
    template = JobTemplateFactory()
    JobStep.objects.create(template=template, position=0, device_param="device", action="firmware/check")
    response = client.post(
        f"/admin/jobs/jobtemplate/{template.pk}/run/",
        {"parameters": "{}", "labels": '{"kind": "pump-admin"}'},
    )
    assert response.status_code == 302 and "trigger__exact=admin" in response.url
    started = sorted(run.parameters["device"] for run in JobRun.objects.filter(template=template))
    assert started == sorted(p.name for p in pumps)


def test_read_only_staff_sees_no_run_now_and_gets_403(client, template):
    run = run_make(template, status=RunStatus.FAILED)
    staff_with(client, "view_jobtemplate", "view_jobrun")
    page = client.get(f"/admin/jobs/jobtemplate/{template.pk}/change/")
    assert page.status_code == 200 and "/run/" not in page.text
    assert "Run now" not in client.get("/admin/jobs/jobtemplate/").text
    assert client.get(f"/admin/jobs/jobtemplate/{template.pk}/run/").status_code == 403
    assert client.post(f"/admin/jobs/jobtemplate/{template.pk}/run/", {"parameters": "{}"}).status_code == 403
    run_page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/")
    assert run_page.status_code == 200
    assert "Cancel run" not in run_page.text and "Retry from failed step" not in run_page.text
    assert client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").status_code == 200
    assert JobRun.objects.count() == 1


# --- cancel and retry -------------------------------------------------------------------


def test_cancel_action_ends_a_pending_run(client, boss, template):
    run = JobRun.objects.create(template=template, plan=template_plan(template))
    assert "Cancel run" in client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    response = client.post("/admin/jobs/jobrun/", {"action": "cancel_runs", "_selected_action": [run.pk]})
    assert response.status_code == 302 and response.url == f"/admin/jobs/jobrun/{run.pk}/change/"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED and "boss" in run.error
    assert "Cancel run" not in client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text


def test_retry_action_reports_why_a_run_cannot_be_retried(client, boss, template):
    run = run_make(template, status=RunStatus.RUNNING)
    response = client.post("/admin/jobs/jobrun/", {"action": "retry_runs", "_selected_action": [run.pk]})
    assert response.status_code == 302
    [message] = messages_of(response)
    assert "not retried" in message and "running" in message
    assert JobRun.objects.count() == 1


def test_retry_action_starts_a_retry_and_opens_it(client, boss, template):
    run = run_make(template, status=RunStatus.FAILED)
    assert "Retry from failed step" in client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    response = client.post("/admin/jobs/jobrun/", {"action": "retry_runs", "_selected_action": [run.pk]})
    retry = JobRun.objects.get(retry_of=run)
    assert response.status_code == 302 and response.url == f"/admin/jobs/jobrun/{retry.pk}/change/"
    assert (retry.trigger, retry.triggered_by) == (Trigger.ADMIN, "boss")


def test_retry_needs_the_permission_to_start_runs(client, template):
    run = run_make(template, status=RunStatus.FAILED)
    staff_with(client, "view_jobrun", "change_jobrun")
    page = client.get("/admin/jobs/jobrun/")
    assert "cancel_runs" in page.text and "retry_runs" not in page.text
    client.post("/admin/jobs/jobrun/", {"action": "retry_runs", "_selected_action": [run.pk]})
    assert not JobRun.objects.filter(retry_of=run).exists()


# --- the run page and its live timeline --------------------------------------------------


def test_run_page_shows_the_step_timeline_with_stale_messages_highlighted(client, boss, template):
    run = run_make(template, status=RunStatus.FAILED, error="step 1 failed: lamp jammed")
    lamp_step = run.step_runs.get(index=1)
    StepRun.objects.filter(pk=lamp_step.pk).update(status=StepStatus.FAILED, error="lamp jammed", attempt=2)
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    lamp = lamp_step.device
    assert f'href="/admin/devices/device/{lamp.pk}/change/"' in page
    assert "lamp jammed" in page and "2/1" in page  # error and attempt
    assert escape('{"echo":{"level":80}}') in page  # compact JSON result
    assert 'class="iq-tone-attention"' in page and "reply.stale" in page
    assert 'data-active="false"' in page  # finished: no live refresh
    assert 'name="_save"' not in page  # a run is never edited by hand


def test_timeline_fragment_is_live_while_the_run_is_active(client, boss, template):
    run = run_make(template, status=RunStatus.RUNNING)
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    assert f'data-url="/admin/jobs/jobrun/{run.pk}/timeline/"' in page and "run_live.js" in page

    fragment = client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/")
    assert fragment.status_code == 200
    assert 'data-active="true"' in fragment.text and "<html" not in fragment.text
    assert "dispatched" in fragment.text

    JobRun.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, finished_at=timezone.now())
    assert 'data-active="false"' in client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").text
    missing = "/admin/jobs/jobrun/00000000-0000-0000-0000-000000000000/timeline/"
    assert client.get(missing).status_code == 404


def test_timeline_needs_view_permission(client, template):
    run = run_make(template)
    staff_with(client, "view_jobtemplate")
    assert client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").status_code == 403


def test_run_page_shows_the_latest_events_of_a_long_run(client, boss, template):
    run = run_make(template, events=EVENTS_SHOWN + 20)
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    assert f"Showing the latest {EVENTS_SHOWN} of {EVENTS_SHOWN + 20} events" in page
    assert f"event {EVENTS_SHOWN + 19}<" in page and "event 19<" not in page


def test_run_page_shows_messages_its_devices_sent_that_matched_no_run(client, boss, template):
    run = run_make(template, status=RunStatus.RUNNING)
    lamp = run.step_runs.get(index=1).device
    RunEvent.objects.create(kind="message.dropped", device=lamp.name, message="done: payload is not JSON")
    RunEvent.objects.create(kind="message.dropped", device="someone-else", message="not ours")
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").text
    assert "payload is not JSON" in page and "not ours" not in page


# --- devices ----------------------------------------------------------------------------


def test_device_list_shows_lock_holder_linked_to_its_run_and_queue_length(client, boss, template):
    lock_epoch_start()
    run = run_make(template, status=RunStatus.RUNNING)
    step = run.step_runs.get(index=0)
    device = step.device
    device_lock_acquire(device.name, holder=f"step:{step.pk}", priority=5, lease_seconds=60)
    for waiter in ("probe:1", "probe:2"):
        device_lock_acquire(device.name, holder=waiter, priority=5, lease_seconds=60)
    try:
        page = client.get("/admin/devices/device/").text
        run_link = f'<a href="/admin/jobs/jobrun/{run.pk}/change/" title="step:{step.pk}">'
        assert f"{run_link}run {str(run.pk)[:8]}</a>" in page
        assert '<td class="field-queue_length">2</td>' in page
        detail = client.get(f"/admin/devices/device/{device.pk}/change/").text
        assert "2 waiting, in order:" in detail and "<li>probe:1</li><li>probe:2</li>" in detail
    finally:
        for waiter in ("probe:1", "probe:2"):
            device_lock_dequeue(device.name, holder=waiter)

    # force-release (the stack-backed version is in test_operator_actions): audited, lock free
    StepRun.objects.filter(pk=step.pk).update(status=StepStatus.SUCCEEDED)
    response = client.post(
        "/admin/devices/device/", {"action": "force_release_lock", "_selected_action": [device.pk]}
    )
    assert f"lock taken from step:{step.pk}" in messages_of(response)[0]
    assert RunEvent.objects.filter(kind="lock.force_released", device=device.name).exists()
    assert device_lock_state(device.name).holder is None


# --- lists stay fast: no query per row ---------------------------------------------------


def query_count(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200, url
    return len(queries)


LISTS = [
    "/admin/jobs/jobrun/",
    "/admin/jobs/steprun/",
    "/admin/jobs/runevent/",
    "/admin/jobs/jobtemplate/",
    "/admin/devices/device/",
    "/admin/devices/devicegroup/",
]


@pytest.mark.parametrize("url", LISTS)
def test_list_queries_do_not_grow_with_rows(client, boss, template, url, django_assert_max_num_queries):
    lock_epoch_start()
    held = template.steps.first().device
    first = run_make(template, status=RunStatus.RUNNING)
    device_lock_acquire(held.name, holder=f"step:{first.step_runs.first().pk}", priority=5, lease_seconds=60)
    few = query_count(client, url)

    for _ in range(30):
        more = template_with_steps((DeviceFactory(), "on", {}), (DeviceFactory(), "off", {}))
        run_make(more, events=6)
        DeviceGroup.objects.create(name=f"group-{more.pk}").devices.add(*[s.device for s in more.steps.all()])
    with django_assert_max_num_queries(few):
        assert client.get(url).status_code == 200


def test_run_page_queries_do_not_grow_with_steps_and_events(client, boss, django_assert_max_num_queries):
    small = run_make(template_with_steps((DeviceFactory(), "on", {})), events=2)
    few = query_count(client, f"/admin/jobs/jobrun/{small.pk}/change/")
    assert query_count(client, f"/admin/jobs/jobrun/{small.pk}/timeline/") < few

    devices = [(DeviceFactory(), f"step{i}", {"i": i}) for i in range(40)]
    large = run_make(template_with_steps(*devices), events=300)
    with django_assert_max_num_queries(few):
        page = client.get(f"/admin/jobs/jobrun/{large.pk}/change/")
    assert page.text.count('class="iq-phase-forward"') == 40


# --- end to end: Run now on real devices --------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_run_now_runs_on_simulated_devices_and_the_timeline_follows(stack, simulator, client, boss):
    gate, lamp = DeviceFactory(), DeviceFactory()
    simulator({gate.name: DeviceBehaviour(), lamp.name: DeviceBehaviour()})
    template = template_with_steps((gate, "unlock", {}), (lamp, "on", {"level": "{{ params.level }}"}))

    response = client.post(f"/admin/jobs/jobtemplate/{template.pk}/run/", {"parameters": '{"level": 80}'})
    assert response.status_code == 302
    run = JobRun.objects.get(template=template)
    timeline = f"/admin/jobs/jobrun/{run.pk}/timeline/"
    assert 'data-active="true"' in client.get(timeline).text

    wait_for(lambda: 'data-active="false"' in client.get(timeline).text, what="the timeline to show the end")
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    assert page.count('<span class="iq-status iq-status-succeeded">succeeded</span>') >= 3  # run + 2 steps
    assert escape('{"level":80}') in page  # the args the lamp got


def nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_run_page_shows_parameters_nested_beyond_the_limit_on_one_line(client, boss, template):
    # given parameters stored before the depth limit, deeper than it
    run = run_make(template, parameters={"deep": nested_list(40)})

    response = client.get(f"/admin/jobs/jobrun/{run.pk}/change/")

    assert response.status_code == 200
    assert escape(json.dumps({"deep": nested_list(40)})) in response.text


def test_run_page_parameters_too_deep_for_python_are_named_not_a_500():
    # a depth no JSON encoder of Python's recurses through (the API took ~900 before the limit)
    run = JobRun(parameters={"deep": nested_list(5000)}, plan=[nested_list(5000)])
    run_admin = JobRunAdmin(JobRun, admin.site)

    assert run_admin.parameters_json(run) == "<pre>(nested too deeply to show)</pre>"
    assert run_admin.plan_json(run) == "<pre>(nested too deeply to show)</pre>"


def test_json_block_indents_what_it_can():
    assert json_block({"a": [1]}) == "<pre>{\n  &quot;a&quot;: [\n    1\n  ]\n}</pre>"


def test_admin_forms_refuse_json_nested_too_deep_instead_of_a_500(client, boss, template):
    deep = "[" * 5000 + "]" * 5000  # Python's decoder recurses out on this
    # the Run now form
    response = client.post(f"/admin/jobs/jobtemplate/{template.pk}/run/", {"parameters": deep})
    assert response.status_code == 200 and "levels deep" in response.text
    # and a device's config
    device = DeviceFactory()
    response = client.post(
        f"/admin/devices/device/{device.pk}/change/",
        {"name": device.name, "labels": "{}", "config": deep, "min_interval_seconds": 0, "max_per_minute": 0},
    )
    assert response.status_code == 200 and "levels deep" in response.text
    device.refresh_from_db()
    assert device.config == {}
    assert not JobRun.objects.exists()


def test_blank_or_duplicate_step_positions_are_field_errors_not_a_500(client, boss):
    # given two new step rows left with a blank Position (new rows start blank), or the same one
    gate = DeviceFactory()
    blank = [
        {"position": "", "device": gate.pk, "action": "a"},
        {"position": "", "device": gate.pk, "action": "b"},
    ]
    twice = [
        {"position": 3, "device": gate.pk, "action": "a"},
        {"position": 3, "device": gate.pk, "action": "b"},
    ]

    for name, steps in (("Blank-positions", blank), ("Same-position", twice)):
        # when the template is saved
        response = client.post("/admin/jobs/jobtemplate/add/", template_form(name, steps))

        # then the form comes back with the error on the step's position, and nothing is saved
        assert response.status_code == 200
        forms = response.context["inline_admin_formsets"][0].formset.forms
        assert all(form.errors.get("position") for form in forms[-1:]), [f.errors for f in forms]
        assert not JobStep.objects.filter(template__name=name).exists()
