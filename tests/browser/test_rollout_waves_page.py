"""Waves and gates in a real browser: a paused rollout on its run page, resumed with its button."""

from __future__ import annotations

import os
import uuid

import pytest

from devtools.browser import WINDOW_WIDTH
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, Rollout, RunEvent, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Where a person checking the page by eye finds its screenshots (unset: none are kept).
SCREENSHOTS_ENV = "IOTQUEUE_BROWSER_SCREENSHOTS"
ACTION = "firmware/flash"


def run_finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


@pytest.mark.parametrize("language", ["en", "zh"])
def test_a_paused_rollout_shows_its_waves_and_resumes_from_its_run_page(
    language, console, console_zh, operator, stack, simulator
):
    browser = console if language == "en" else console_zh
    # given a rollout whose first wave (2 devices, none may fail) has a failing device: it pauses
    label = f"bwave-{uuid.uuid4().hex[:6]}"
    fails = DeviceBehaviour(failing_actions=frozenset({ACTION}))
    devices = [DeviceFactory(name=f"{label}-{i}", labels={"kind": label, "region": "eu"}) for i in range(6)]
    simulator({d.name: fails if i == 0 else DeviceBehaviour() for i, d in enumerate(devices)})
    waves = [{"count": 2, "max_failed_percent": 0, "gate": "approval"}, {"by_label": "region"}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves, success_percent=50)
    run, _ = run_start(template=step.template)
    wait_for(lambda: Rollout.objects.filter(run=run, state="paused").exists(), what="the auto-pause")

    # when the operator opens the run's page
    browser.login("operator", next_path=f"/admin/jobs/jobrun/{run.pk}/change/")

    # then the waves show: state, why, and each wave's size, condition and gate
    box = browser.find("#rollout-0")
    rows = box.find_elements("css selector", "tbody tr")
    assert [row.find_elements("css selector", "td")[1].text for row in rows] == ["2", "4"]
    assert "wave 1 of 2 failed: 1 of 2 succeeded, 1 failed" in box.text  # the reason, as recorded
    assert "region=eu" in rows[1].text
    if language == "en":
        assert "Waves of step 0: wave 1 of 2" in box.text and "paused" in box.text
        assert "≤ 0% failed" in rows[0].text
    else:
        assert "步骤 0 的批次" in box.text and "已暂停" in box.text
        assert "失败 ≤ 0%" in rows[0].text
    assert browser.scroll_width() <= WINDOW_WIDTH
    if os.environ.get(SCREENSHOTS_ENV):
        browser.driver.execute_script("arguments[0].scrollIntoView();", box)
        browser.driver.save_screenshot(
            os.path.join(os.environ[SCREENSHOTS_ENV], f"waves-paused-{language}.png")
        )
        box.screenshot(os.path.join(os.environ[SCREENSHOTS_ENV], f"waves-paused-box-{language}.png"))

    # when the operator gives a reason and presses Resume
    browser.find("input[name=reason_0]").send_keys("one bad unit")
    browser.find("#rollout-0 button.iq-gate-resume").click()

    # then the rest goes out, and the timeline says who resumed it and why
    assert wait_for(lambda: run_finished(run.pk), what="the run to finish").status == RunStatus.SUCCEEDED
    resumed = RunEvent.objects.get(run=run, kind="rollout.resumed")
    assert resumed.data["by"] == "operator" and "one bad unit" in resumed.message
