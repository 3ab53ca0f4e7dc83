"""The command line: start a run and follow it live, list runs, show a run, cancel one."""

import io
import signal
import subprocess
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, OutputWrapper
from django.utils import timezone

from devtools.processes import manage_argv
from devtools.simulator import DeviceBehaviour
from jobs.cli import TerminalView, progress_bar, run_load, step_lines
from jobs.models import JobRun, JobStep, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start, template_plan
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

# A device slow enough that following, which polls four times a second, sees it working:
# it acks at once, reports 50 % after about a second and is done after about two.
SLOW = DeviceBehaviour(latency_min_ms=2000, latency_max_ms=2400)


def lines_with(output: str, *words: str) -> list[str]:
    return [line for line in output.splitlines() if all(word in line for word in words)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_run_start_wait_shows_each_step_progress_and_succeeds(stack, simulator):
    # given a two-step template whose first device reports progress slowly
    slow, fast = DeviceFactory(), DeviceFactory()
    simulator({slow.name: SLOW, fast.name: DeviceBehaviour()})
    template = template_with_steps(
        (slow, "firmware/check", {}), (fast, "on", {"level": "{{ params.level }}"})
    )

    # when the run is started from the command line and followed
    out = io.StringIO()
    call_command("run_start", template.name, "--param", "level=80", "--wait", "--by", "ops", stdout=out)

    # then the output shows step 0 working at 50 %, then done, and the run succeeding
    output = out.getvalue()
    run = JobRun.objects.get(pk=output.splitlines()[0])
    assert run.status == RunStatus.SUCCEEDED
    assert (run.trigger, run.triggered_by, run.parameters) == ("cli", "ops", {"level": 80})
    working = lines_with(output, "#0", slow.name, "firmware/check", "in_progress", "try 1/1", " 50%")
    done = lines_with(output, "#0", slow.name, "succeeded", "100%")
    assert working and done, output
    assert output.index(working[0]) < output.index(done[0])
    assert lines_with(output, "#1", fast.name, "succeeded", "100%"), output
    assert lines_with(output, template.name, str(run.pk)[:8], "succeeded", "step 2/2"), output
    assert output.splitlines()[-1].startswith(f"run {str(run.pk)[:8]} succeeded in ")


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_run_start_wait_on_a_failing_run_exits_1_with_the_reason(stack, simulator):
    # given a device whose "b" action always fails
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(failing_actions=frozenset({"b"}))})
    template = template_with_steps((device, "a", {}), (device, "b", {}), (device, "c", {}))

    out = io.StringIO()
    with pytest.raises(CommandError) as failed:
        call_command("run_start", template.name, "--wait", stdout=out)

    assert failed.value.returncode == 1
    assert "failed" in str(failed.value) and "step 1" in str(failed.value)
    output = out.getvalue()
    assert lines_with(output, "#1", device.name, "failed", "try 1/1"), output
    assert lines_with(output, "#2", "not run"), output


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_exit_status_of_a_real_process_follows_the_run(stack, simulator):
    # given a device that fails one action, and the stack's environment for a new process
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(failing_actions=frozenset({"bad"}))})
    good = template_with_steps((device, "ok", {}))
    bad = template_with_steps((device, "bad", {}))

    def run_start(template) -> subprocess.Popen:
        argv = manage_argv("run_start", template.name, "--wait", "--timeout", "60")
        return subprocess.Popen(
            argv, env=stack.supervisor.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def ended(process: subprocess.Popen) -> subprocess.CompletedProcess:
        stdout, stderr = process.communicate(timeout=90)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    # when each is started and followed by `manage.py run_start --wait` (both processes at
    # once: each starts Django and follows its own run, and the device takes them in turn)
    processes = [run_start(good), run_start(bad)]
    try:
        succeeded, failed = (ended(process) for process in processes)
    finally:
        for process in processes:
            process.kill()

    # then the exit status says how the run ended, and the output shows its steps
    assert succeeded.returncode == 0, succeeded.stderr
    assert lines_with(succeeded.stdout, "#0", device.name, "succeeded", "100%"), succeeded.stdout
    assert failed.returncode == 1, failed.stderr
    assert "failed" in failed.stderr, failed.stderr


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_timeout_and_ctrl_c_stop_following_but_not_the_run(stack, simulator):
    # given a run whose device never answers
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(silent=True)})
    template = template_with_steps((device, "snapshot", {}))

    # when following gives up after a second
    out = io.StringIO()
    with pytest.raises(CommandError) as timed_out:
        call_command("run_start", template.name, "--wait", "--timeout", "1", stdout=out)

    # then it exits 2 and the run goes on
    assert timed_out.value.returncode == 2
    run = JobRun.objects.get(pk=out.getvalue().splitlines()[0])
    assert "goes on" in str(timed_out.value)
    assert not run.is_terminal

    # and when a real process following it gets Ctrl-C
    follower = subprocess.Popen(
        manage_argv("run_show", str(run.pk)[:8], "--follow"),
        env=stack.supervisor.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a suite started in the background (`make test &`) inherits
        # SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
        preexec_fn=_sigint_default,
    )
    try:
        assert "dispatched" in follower.stdout.readline() + follower.stdout.readline()
        follower.send_signal(signal.SIGINT)
        _, stderr = follower.communicate(timeout=30)
    finally:
        follower.kill()
    # then it exits 130, says the run was not canceled, and the run still runs
    assert follower.returncode == 130, stderr
    assert "NOT canceled" in stderr
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.RUNNING

    # and run_cancel cancels it
    cancel_out = io.StringIO()
    call_command("run_cancel", str(run.pk)[:8], "--by", "ops", stdout=cancel_out)
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.CANCELED
    assert "canceled" in cancel_out.getvalue()
    assert RunEvent.objects.filter(run=run, kind="run.canceled", message__contains="ops").exists()
    with pytest.raises(CommandError, match="already canceled"):
        call_command("run_cancel", str(run.pk), stdout=io.StringIO())


# --- commands over rows made directly (no stack) -----------------------------------------


def finished_run(template, status: str, *, device, step_status: str, error: str = "") -> JobRun:
    now = timezone.now()
    run = JobRun.objects.create(
        template=template,
        plan=template_plan(template),
        status=status,
        error=error,
        cursor=0 if status != RunStatus.SUCCEEDED else 1,
        trigger="cli",
        triggered_by="ops",
        started_at=now - timedelta(seconds=3),
        finished_at=now,
    )
    StepRun.objects.create(run=run, index=0, device=device, action="on", status=step_status, attempt=1)
    return run


@pytest.mark.django_db
def test_runs_lists_and_filters_runs():
    lamp, cam = DeviceFactory(), DeviceFactory()
    morning, other = template_with_steps((lamp, "on", {})), template_with_steps((cam, "on", {}))
    done = finished_run(morning, RunStatus.SUCCEEDED, device=lamp, step_status=StepStatus.SUCCEEDED)
    failed = finished_run(
        other, RunStatus.FAILED, device=cam, step_status=StepStatus.FAILED, error="step 0: no reply"
    )

    def runs(*args) -> str:
        out = io.StringIO()
        call_command("runs", *args, stdout=out)
        return out.getvalue()

    everything = runs()
    assert everything.splitlines()[0].split()[:4] == ["ID", "TEMPLATE", "STATUS", "STEP"]
    assert lines_with(everything, str(done.pk)[:8], morning.name, "succeeded", "1/1", "cli ops", "3.0s")
    assert lines_with(everything, str(failed.pk)[:8], other.name, "failed", "step 0: no reply")
    assert str(done.pk)[:8] not in runs("--status", "failed")
    assert str(failed.pk)[:8] not in runs("--template", morning.name)
    assert str(failed.pk)[:8] not in runs("--device", lamp.name)
    assert runs("--template", "nope") == "no runs match\n"
    with pytest.raises(CommandError, match="--since"):
        runs("--since", "yesterday")
    with pytest.raises(CommandError, match="--limit"):
        runs("--limit", "0")


@pytest.mark.django_db
def test_run_show_prints_header_steps_and_timeline_by_id_prefix():
    lamp, cam = DeviceFactory(), DeviceFactory()
    template = template_with_steps((lamp, "on", {"level": 80}), (cam, "snapshot", {}))
    run = finished_run(
        template, RunStatus.FAILED, device=lamp, step_status=StepStatus.FAILED, error="step 0: lamp broke"
    )
    StepRun.objects.filter(run=run).update(error="lamp broke")
    RunEvent.objects.create(run=run, kind="run.created", message="cli by ops")
    RunEvent.objects.create(run=run, kind="step.failed", device=lamp.name, message="lamp broke")

    out = io.StringIO()
    call_command("run_show", str(run.pk)[:8], stdout=out)

    output = out.getvalue()
    assert f"run         {run.pk}  ({template.name})" in output
    assert "status      failed: step 0: lamp broke" in output
    assert "trigger     cli by ops, priority 5" in output
    assert lines_with(output, "#0", lamp.name, "on", "failed", "try 1/1", "lamp broke")
    assert lines_with(output, "#1", cam.name, "snapshot", "not run")
    timeline = output.split("\ntimeline\n")[1].splitlines()
    assert [line.split()[1:3] for line in timeline] == [["run.created", "-"], ["step.failed", lamp.name]]
    # --follow on a run that already ended shows it and exits as --wait would
    with pytest.raises(CommandError) as followed:
        call_command("run_show", str(run.pk), "--follow", stdout=io.StringIO())
    assert followed.value.returncode == 1
    # a succeeded run cannot be retried, and the command says why
    done = finished_run(template, RunStatus.SUCCEEDED, device=lamp, step_status=StepStatus.SUCCEEDED)
    with pytest.raises(CommandError, match="cannot retry: only failed"):
        call_command("run_retry", str(done.pk)[:8], stdout=io.StringIO())
    with pytest.raises(CommandError, match="no run with id"):
        call_command("run_show", "00000000", stdout=io.StringIO())
    with pytest.raises(CommandError, match="not a run id"):
        call_command("run_show", "xyz", stdout=io.StringIO())


@pytest.mark.django_db
def test_run_start_rejects_bad_input_naming_it():
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))

    def start(*args) -> str:
        with pytest.raises(CommandError) as refused:
            call_command("run_start", *args, stdout=io.StringIO())
        return str(refused.value)

    assert f"no template named 'nope'; templates: {template.name}" in start("nope")
    assert "use KEY=VALUE" in start(template.name, "--param", "level")
    assert "must be a JSON object" in start(template.name, "--params-json", "[1]")
    assert "not valid JSON" in start(template.name, "--params-json", "{")
    assert "priority" in start(template.name, "--priority", "12")
    assert "--timeout needs --wait" in start(template.name, "--timeout", "5")
    assert not JobRun.objects.exists()


@pytest.mark.django_db
def test_a_fanout_step_is_one_summary_line_and_compensations_follow():
    # given a run rolling back while its fan-out step (a nightly fleet update) is half done
    database, pumps = DeviceFactory(), [DeviceFactory(labels={"kind": "pump"}) for _ in range(4)]
    template = template_with_steps((database, "mysql/init_instance", {}))
    JobStep.objects.create(template=template, position=1, labels={"kind": "pump"}, action="firmware/check")
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.COMPENSATING, cursor=1
    )
    StepRun.objects.create(
        run=run, index=0, device=database, action="mysql/init_instance", status="succeeded"
    )
    for pump, status in zip(pumps, ["succeeded", "failed", "in_progress", "pending"], strict=True):
        StepRun.objects.create(run=run, index=1, device=pump, action="firmware/check", status=status)
    StepRun.objects.create(
        run=run, index=0, phase="compensation", device=database, action="mysql/clean_instance", attempt=1
    )

    lines = list(step_lines(run_load(run.pk)).values())

    assert len(lines) == 3
    assert "[#####-----]  50%  running     2/4      labels kind=pump firmware/check: " in lines[1]
    assert lines[1].endswith("failed 1, in_progress 1, pending 1, succeeded 1")
    assert lines[2].split() == [
        "undo",
        "#0",
        "[",
        "]",
        "pending",
        "try",
        "1/1",
        database.name,
        "mysql/clean_instance",
    ]


@pytest.mark.django_db
def test_terminal_view_redraws_in_place():
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.RUNNING)
    step = StepRun.objects.create(
        run=run, index=0, device=device, action="on", status="in_progress", attempt=1
    )
    screen = io.StringIO()
    view = TerminalView(OutputWrapper(screen))

    view.show(run_load(run.pk))
    StepRun.objects.filter(pk=step.pk).update(progress=40)
    view.show(run_load(run.pk))

    first, second = screen.getvalue().split("\x1b[3F")  # up over header, step, last-event lines
    assert "  0%" in first and progress_bar(40) in second
    assert second.count("\x1b[2K") == 3


def test_progress_bar():
    assert progress_bar(50) == "[#####-----]  50%"
    assert progress_bar(None).strip() == "[          ]"


# --- why runs wait ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_runs_run_show_and_locks_say_why_runs_wait(stack, manual_device, settings):
    # given a device working on run A (it never answers), run B queued behind it, and run C
    # waiting for a device that went offline
    busy = DeviceFactory()
    hand = manual_device(busy.name)
    first, _ = run_start(template=template_with_steps((busy, "long", {})))
    hand.next_command()
    second, _ = run_start(template=template_with_steps((busy, "after", {})))
    offline = DeviceFactory(online=False, last_seen=timezone.now() - timedelta(minutes=3))
    third, _ = run_start(template=template_with_steps((offline, "on", {})))
    for run in (second, third):
        wait_for(lambda run=run: RunEvent.objects.filter(run=run, kind="step.waiting").exists(), what="waits")

    def output(*args) -> str:
        out = io.StringIO()
        call_command(*args, stdout=out)
        return out.getvalue()

    # when the runs are listed: a WAITING column says why each waits
    table = output("runs", "--status", "running")
    assert "WAITING" in table.splitlines()[0]
    assert lines_with(table, str(first.pk)[:8], "device_working")
    assert lines_with(table, str(second.pk)[:8], "device_busy", f"run {str(first.pk)[:8]} step #0")
    assert lines_with(table, str(third.pk)[:8], "device_offline", f"Device {offline.name} is offline since")

    # when run C is shown: its header and its step say the device is offline
    shown = output("run_show", str(third.pk)[:8])
    assert "waiting     device_offline: " in shown
    assert lines_with(shown, "#0", offline.name, "queued", f"Device {offline.name} is offline since")

    # when the locks are listed: the holder is run A's step, B waits first in the queue, and
    # C counts as waiting for its offline device although it is outside the lock queue
    locks = output("locks", busy.name, offline.name)
    holder, queued = f"run {str(first.pk)[:8]} step #0 long", f"1. run {str(second.pk)[:8]}"
    assert lines_with(locks, busy.name, holder, queued)
    (offline_line,) = lines_with(locks, offline.name)
    assert f"(offline) run {str(third.pk)[:8]} step #0 on" in offline_line
    assert offline_line.split()[1:2] == ["-"]  # nobody holds it

    # when the stuck runs are listed: none before the threshold, all three past it
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 3600
    assert output("runs", "--stuck") == "no run is stuck\n"
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 0
    stuck = output("runs", "--stuck")
    assert lines_with(stuck, str(third.pk)[:8], "device_offline")
    assert lines_with(stuck, str(second.pk)[:8], "device_busy")
    with pytest.raises(CommandError, match="--stuck"):
        output("runs", "--stuck", "--status", "running")
