"""Waves with gates on the real stack: a rollout that pauses for approval, auto-pauses when a
wave fails its condition, soaks, asks a webhook, and is steered from REST and the CLI."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, Rollout, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

ACTION = "firmware/flash"


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def rollout_of(run: JobRun) -> Rollout:
    return Rollout.objects.get(run=run)


def in_state(run: JobRun, state: str, wave: int) -> Rollout | None:
    """The rollout once it is in `state` at `wave` (from 1)."""
    rollout = Rollout.objects.filter(run=run).first()
    return rollout if rollout and rollout.state == state and rollout.wave == wave - 1 else None


def event(run: JobRun, kind: str, count: int = 1) -> list[RunEvent] | None:
    events = list(RunEvent.objects.filter(run=run, kind=kind).order_by("id"))
    return events if len(events) >= count else None


def fleet(label: str, size: int, failing: set[int] = frozenset()) -> dict[str, DeviceBehaviour]:
    """`size` devices labelled kind=label, named in wave order; those in `failing` fail the flash."""
    fails = DeviceBehaviour(failing_actions=frozenset({ACTION}))
    return {
        DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}).name: fails
        if i in failing
        else DeviceBehaviour()
        for i in range(size)
    }


def rows_of_wave(run: JobRun, wave: int):
    return StepRun.objects.filter(run=run, wave=wave - 1)


def timeline(run: JobRun) -> str:
    """The run's rollout events as the timeline shows them, for the docs and the summary."""
    kinds = ("step.fanout", "wave.", "rollout.", "step.aborted", "step.fanout_done", "run.")
    lines = []
    for e in RunEvent.objects.filter(run=run).order_by("id"):
        if e.kind.startswith(kinds):
            by = f" [by {e.data['by']}]" if "by" in e.data else ""
            lines.append(f"{e.created_at:%H:%M:%S.%f}"[:12] + f"  {e.kind:<26} {e.message}{by}")
    return "\n".join(lines)


def test_a_canary_waits_for_approval_a_failing_wave_pauses_and_resume_finishes(stack, simulator, admin_api):
    # given 20 devices in three waves: a canary of 2 behind an approval gate, 4 that may not
    # fail at all (one of them fails), then the rest
    label = f"waves-{uuid.uuid4().hex[:6]}"
    sim = simulator(fleet(label, 20, failing={3}))
    waves = [
        {"count": 2, "gate": "approval"},
        {"count": 4, "max_failed_percent": 0, "gate": "auto"},
        {"rest": True},
    ]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves, success_percent=90)

    run, _ = run_start(template=step.template)

    # then the canary runs and the rollout waits for approval of wave 2, no later device started
    rollout = wait_for(lambda: in_state(run, "awaiting_approval", 1), what="the approval gate")
    assert [w["size"] for w in rollout.waves] == [2, 4, 14]
    assert set(rows_of_wave(run, 1).values_list("status", flat=True)) == {StepStatus.SUCCEEDED}
    assert set(StepRun.objects.filter(run=run, wave__gt=0).values_list("status", flat=True)) == {
        StepStatus.PENDING
    }
    body = admin_api.get(f"/api/runs/{run.pk}/").json()
    assert body["rollouts"][0]["state"] == "awaiting_approval"
    assert [w["where"] for w in body["rollouts"][0]["waves"]] == ["open", "next", "next"]
    # and the run says why it waits
    assert body["waiting"]["reason"] == "rollout_gate"
    assert "awaiting approval of wave 2" in body["waiting"]["message"]

    # when the release manager approves through REST (resume does not apply: 409)
    assert admin_api.post(f"/api/runs/{run.pk}/rollout/resume/", {}, format="json").status_code == 409
    approved = admin_api.post(
        f"/api/runs/{run.pk}/rollout/approve/", {"reason": "canary healthy"}, format="json"
    )
    assert approved.status_code == 200, approved.content
    assert approved.json()["wave"] == 2

    # then wave 2 runs, one device fails, the rollout pauses on its own, and wave 3 stays pending
    paused = wait_for(lambda: event(run, "rollout.paused"), what="the auto-pause")[0]
    assert paused.data["by"] == "auto" and "wave 2 of 3 failed" in paused.message
    assert set(rows_of_wave(run, 3).values_list("status", flat=True)) == {StepStatus.PENDING}
    assert not any(sim.received(f"{label}-{i:02d}") for i in range(6, 20))
    assert rollout_of(run).state == "paused"
    waiting = admin_api.get(f"/api/runs/{run.pk}/").json()["waiting"]
    assert (
        waiting["reason"] == "rollout_paused" and "paused by auto: wave 2 of 3 failed" in waiting["message"]
    )

    # when an operator resumes it, the rest goes out and the step succeeds (19 of 20 >= 90 %)
    resumed = admin_api.post(
        f"/api/runs/{run.pk}/rollout/resume/", {"reason": "known bad unit"}, format="json"
    )
    assert resumed.status_code == 200, resumed.content
    assert wait_for(lambda: finished(run), timeout=60).status == RunStatus.SUCCEEDED
    assert rollout_of(run).state == "ended"
    decided = {e.kind: e.data["by"] for e in RunEvent.objects.filter(run=run, kind__startswith="rollout.")}
    assert decided == {
        "rollout.awaiting_approval": "auto",
        "rollout.approved": "admin",
        "rollout.paused": "auto",
        "rollout.resumed": "admin",
    }
    assert sim.stats()["totals"]["overlaps"] == 0
    print("\nTIMELINE (paused, approved, auto-paused, resumed):\n" + timeline(run))


def test_the_cli_pauses_resumes_and_aborts_a_rollout(stack, simulator, admin_api):
    # given a rollout waiting for approval after its canary
    label = f"wcli-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 6))
    waves = [{"count": 1, "gate": "approval"}, {"count": 1, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)
    run, _ = run_start(template=step.template)
    wait_for(lambda: in_state(run, "awaiting_approval", 1), what="the approval gate")

    # when an operator pauses it from the CLI, then resumes it: the next wave opens
    out = io.StringIO()
    call_command("rollout", str(run.pk)[:8], "pause", "--by", "ops", "--reason", "change freeze", stdout=out)
    assert "paused" in out.getvalue().lower()
    assert rollout_of(run).reason == "change freeze"
    shown = io.StringIO()
    call_command("run_show", str(run.pk), stdout=shown)
    assert "step 0: wave 1 of 3, Paused (change freeze) decided by ops" in shown.getvalue()
    with pytest.raises(CommandError, match="Cannot approve"):
        call_command("rollout", str(run.pk), "approve", "--by", "ops", stdout=io.StringIO())
    call_command("rollout", str(run.pk), "resume", "--by", "ops", stdout=io.StringIO())
    wait_for(lambda: in_state(run, "awaiting_approval", 2), what="wave 2's gate")

    # when it aborts from the CLI, the devices not started are skipped and the run fails
    call_command(
        "rollout", str(run.pk), "abort", "--by", "ops", "--reason", "bad image", stdout=io.StringIO()
    )
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert "rollout aborted by ops: bad image" in run.error
    assert rows_of_wave(run, 3).filter(status=StepStatus.SKIPPED).count() == 4
    aborted = RunEvent.objects.get(run=run, kind="step.aborted")
    assert aborted.data["by"] == "ops"
    assert admin_api.post(f"/api/runs/{run.pk}/rollout/resume/", {}, format="json").status_code == 409


class Gate:
    """A local HTTP server standing in for a monitoring system's gate: answers `answer`."""

    def __init__(self, answer: tuple[int, dict]) -> None:
        self.answer = answer
        self.asked: list[dict] = []
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                gate.asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = gate.answer
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/gate"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gate() -> Iterator[Gate]:
    server = Gate((200, {"approve": True}))
    yield server
    server.close()


def test_a_webhook_gate_approves_after_a_soak_and_refuses_with_a_pause(stack, simulator, gate):
    # given a canary that soaks a second, then asks the gate; then a wave the gate refuses
    label = f"whook-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 5))
    waves = [
        {"count": 1, "soak_seconds": 1, "gate": "webhook", "webhook_url": gate.url},
        {"count": 1, "gate": "webhook", "webhook_url": gate.url},
        {"rest": True},
    ]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)

    run, _ = run_start(template=step.template)

    # then it soaks, the gate is asked and approves: wave 2 opens, decided by the webhook
    wait_for(lambda: event(run, "rollout.soaking"), what="the soak")
    approved = wait_for(lambda: event(run, "rollout.approved"), what="the webhook's approval")[0]
    assert approved.data["by"] == "webhook"
    assert gate.asked[0]["wave"] == 1 and gate.asked[0]["run"] == str(run.pk)
    assert gate.asked[0]["counts"] == {"succeeded": 1}

    # when the gate then answers 503, the rollout pauses saying so, and wave 3 stays pending
    gate.answer = (503, {"approve": True})
    paused = wait_for(lambda: event(run, "rollout.paused"), what="the webhook's refusal")[0]
    assert paused.data["by"] == "webhook" and "HTTP 503" in paused.message
    assert set(rows_of_wave(run, 3).values_list("status", flat=True)) == {StepStatus.PENDING}
    assert len(gate.asked) == 2
    print("\nTIMELINE (soak, webhook approves, webhook refuses):\n" + timeline(run))


def test_a_webhook_gate_that_answers_no_pauses(stack, simulator, gate):
    label = f"wno-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 3))
    gate.answer = (200, {"approve": False})
    waves = [{"count": 1, "gate": "webhook", "webhook_url": gate.url}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)

    run, _ = run_start(template=step.template)

    paused = wait_for(lambda: event(run, "rollout.paused"), what="the webhook's refusal")[0]
    assert "not approved" in paused.message and paused.data["by"] == "webhook"
    assert set(rows_of_wave(run, 2).values_list("status", flat=True)) == {StepStatus.PENDING}


def test_a_wave_that_fails_its_condition_aborts_when_it_says_so(stack, simulator):
    label = f"wabort-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 4, failing={0}))
    waves = [{"count": 1, "min_succeeded_percent": 100, "on_fail": "abort"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)

    run, _ = run_start(template=step.template)

    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert "wave 1 of 2 failed" in run.error
    assert rows_of_wave(run, 2).filter(status=StepStatus.SKIPPED).count() == 3


def test_waves_are_validated_with_the_field_named(admin_api):
    body = {
        "name": f"bad-waves-{uuid.uuid4().hex[:6]}",
        "steps": [
            {
                "position": 0,
                "labels": {"kind": "x"},
                "action": ACTION,
                "waves": [{"count": 1, "gate": "webhook", "webhook_url": "file:///etc/passwd"}],
            }
        ],
    }
    response = admin_api.post("/api/templates/", body, format="json")
    assert response.status_code == 400
    assert "http" in json.dumps(response.json()["steps"])
    assert "waves" in json.dumps(response.json())


def test_a_rollout_action_on_a_run_without_waves_names_the_step_field(admin_api, reader_api):
    step = JobStepFactory(device=None, labels={"kind": "none"}, action=ACTION)
    run = JobRun.objects.create(template=step.template, plan=[], status=RunStatus.RUNNING)

    response = admin_api.post(f"/api/runs/{run.pk}/rollout/approve/", {"step": 0}, format="json")
    assert response.status_code == 400 and "step" in response.json()
    bad = admin_api.post(f"/api/runs/{run.pk}/rollout/approve/", {"step": "x"}, format="json")
    assert bad.status_code == 400 and "step" in bad.json()
    # and who may only read runs may not steer them
    assert reader_api.post(f"/api/runs/{run.pk}/rollout/pause/", {}, format="json").status_code == 403


def test_the_run_page_and_the_dashboard_show_the_waves_and_their_gate_buttons_work(stack, simulator, client):
    # given a rollout waiting for approval after its canary, and a signed-in operator
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("boss", "b@example.com", "pw"))
    label = f"wadm-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 4))
    waves = [{"count": 1, "gate": "approval", "max_failed_percent": 0}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)
    run, _ = run_start(template=step.template)
    wait_for(lambda: in_state(run, "awaiting_approval", 1), what="the approval gate")

    # then the run page shows each wave with its size, condition and gate, and the buttons
    page = client.get(f"/admin/jobs/jobrun/{run.pk}/change/").text
    assert "Waves of step 0: wave 1 of 2" in page
    assert "≤ 0% failed" in page and "approval" in page
    assert f"/admin/jobs/jobrun/{run.pk}/rollout/approve/?step=0" in page
    # and the dashboard lists it among the rollouts waiting for a decision
    dashboard = client.get("/admin/").text
    assert f'data-run="{run.pk}"' in dashboard and "Approve the next wave" in dashboard

    # when the operator approves from the run page, the rest goes out and the run succeeds
    response = client.post(f"/admin/jobs/jobrun/{run.pk}/rollout/approve/?step=0", {"reason_0": "looks fine"})
    assert response.status_code == 302 and response["Location"] == f"/admin/jobs/jobrun/{run.pk}/change/"
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    approved = RunEvent.objects.get(run=run, kind="rollout.approved")
    assert approved.data["by"] == "boss" and "looks fine" in approved.message
    # and a button that no longer applies says so instead of acting
    again = client.post(f"/admin/jobs/jobrun/{run.pk}/rollout/approve/?step=0", follow=True)
    assert "no longer at this fan-out" in again.text


def test_the_preview_of_a_rollout_in_waves_adds_the_soaks_and_names_the_approval_gates(stack, admin_api):
    label = f"wprev-{uuid.uuid4().hex[:6]}"
    for i in range(10):
        DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label, "region": "eu" if i % 2 else "us"})
    waves = [
        {"count": 1, "gate": "approval", "soak_seconds": 600},
        {"percent": 10, "max_failed_percent": 2, "soak_seconds": 300},
        {"by_label": "region", "gate": "approval"},
    ]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)

    response = admin_api.post("/api/runs/preview/", {"template": step.template.name}, format="json")

    assert response.status_code == 200, response.content
    estimate = response.json()["steps"][0]["estimate"]
    # canary, 10 %, then one wave per region (eu, us): 4 waves; the last gate opens nothing
    assert (estimate["method"], estimate["waves"], estimate["soak_seconds"]) == ("waves_replay", 4, 900)
    assert estimate["approval_gates"] == 2
    assert estimate["seconds"] >= 900
    assert response.json()["estimate"]["approval_gates"] == 2


def test_a_retry_of_an_aborted_rollout_splits_the_devices_left_into_its_waves_again(stack, simulator):
    from jobs.engine.fanout import CARRIED_WAVE
    from jobs.retry import run_retry
    from jobs.rollouts import rollout_act

    # given a rollout aborted at its canary's gate: 2 devices succeeded, 4 never started
    label = f"wretry-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 6))
    waves = [{"count": 2, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)
    run, _ = run_start(template=step.template)
    wait_for(lambda: in_state(run, "awaiting_approval", 1), what="the approval gate")
    rollout_act(run=run, action="abort", by="ops", reason="wrong window")
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED

    # when it is retried
    retry = run_retry(run=run, by="ops", trigger="rest")

    # then the 4 devices left run in the step's waves again (a canary of 2 first, behind its
    # gate); the 2 carried successes count in no wave
    rollout = wait_for(lambda: in_state(retry, "awaiting_approval", 1), what="the retry's approval gate")
    assert [w["size"] for w in rollout.waves] == [2, 2]
    assert StepRun.objects.filter(run=retry, wave=CARRIED_WAVE, status=StepStatus.SUCCEEDED).count() == 2
    assert rows_of_wave(retry, 2).filter(status=StepStatus.PENDING).count() == 2
    rollout_act(run=retry, action="approve", by="ops")
    assert wait_for(lambda: finished(retry)).status == RunStatus.SUCCEEDED


def test_a_rollout_paused_mid_wave_lets_its_rows_at_work_finish_and_starts_no_other(
    stack, simulator, admin_api
):
    # given a first wave of 4 slow devices started one at a time
    label = f"wmid-{uuid.uuid4().hex[:6]}"
    slow = DeviceBehaviour(latency_min_ms=400, latency_max_ms=400)
    simulator({DeviceFactory(name=f"{label}-{i}", labels={"kind": label}).name: slow for i in range(6)})
    waves = [{"count": 4}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves, max_in_flight=1)
    run, _ = run_start(template=step.template)
    wait_for(lambda: StepRun.objects.filter(run=run, status__in=["dispatched", "in_progress"]).exists())

    # when an operator pauses it while its first device works
    paused = admin_api.post(f"/api/runs/{run.pk}/rollout/pause/", {"reason": "look first"}, format="json")
    assert paused.status_code == 200 and paused.json()["state"] == "paused"

    # then the device at work finishes, and no other starts (a row's end pumps in the same
    # transaction, so once nothing is at work, whatever the pump started would show)
    wait_for(
        lambda: (
            not StepRun.objects.filter(run=run).exclude(status__in=["pending", "succeeded"]).exists()
            and StepRun.objects.filter(run=run, status="succeeded").exists()
        ),
        what="the device at work to finish",
    )
    assert rows_of_wave(run, 1).filter(status=StepStatus.PENDING).exists()
    assert rows_of_wave(run, 2).filter(status=StepStatus.PENDING).count() == 2

    # when it is resumed, the wave's other devices start, then the next wave's
    assert admin_api.post(f"/api/runs/{run.pk}/rollout/resume/", {}, format="json").status_code == 200
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    assert [e.data["wave"] for e in RunEvent.objects.filter(run=run, kind="wave.ended")] == [1, 2]
