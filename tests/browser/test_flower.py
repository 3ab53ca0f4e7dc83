"""Flower, Celery's web monitor (`make flower`, an optional dependency: requirements-flower.txt),
lists the engine's tasks with the ids of the runs they belong to (docs/operations.md,
"Celery's own tools"): the summaries the engine sends its tasks with (Celery's argsrepr and
kwargsrepr) are what its task list shows and searches.

Flower runs as a child of the session's stack, with the worker's environment (the same broker,
queue names and key prefix) and the task list's columns `make flower` asks for; `make
test-browser` installs it. The test saves the task list and a task's page it saw as pictures
(flower-tasks.png, flower-task.png): in its temporary directory, or in the folder
IOTQUEUE_FLOWER_SCREENSHOTS names (docs/img/flower-tasks.png is cropped from one).
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from devtools.browser import WINDOW_HEIGHT, WINDOW_WIDTH, viewport_resize
from devtools.processes import BASE_DIR, celery_argv
from devtools.servers import free_port
from devtools.simulator import DeviceBehaviour
from iotqueue.redis_conn import redis_connection
from jobs import inbox
from jobs.models import RunStatus, StepKind
from jobs.services import run_start
from tests.browser.conftest import PAGE_WAIT_SECONDS, Console
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Flower's log line once it serves.
FLOWER_READY = r"Visit me at http"
# Wide enough for the task list's columns side by side, the summaries unclipped.
VIEWPORT = (1920, 900)


def make_flower_columns() -> str:
    """The task list's columns, as `make flower` starts Flower (Flower's default has no
    args and kwargs, where the engine's tasks name their runs)."""
    match = re.search(r"--tasks_columns=(\S+)", (BASE_DIR / "Makefile").read_text())
    assert match, "the Makefile's flower target names no --tasks_columns"
    return match[1]


@pytest.fixture
def flower(stack) -> Iterator[str]:
    """Flower on a free port as a child of the stack (its environment, its log folder); its URL."""
    port = free_port()
    argv = celery_argv(
        "flower", "--address=127.0.0.1", f"--port={port}", f"--tasks_columns={make_flower_columns()}"
    )
    stack.supervisor.start("flower", argv)
    try:
        stack.supervisor.wait_for_log("flower", FLOWER_READY)
        yield f"http://127.0.0.1:{port}"
    finally:
        stack.supervisor.stop("flower")


@pytest.fixture
def console(_chromium_en, flower) -> Iterator[Console]:
    """The browser on Flower (named `console` so that a failure saves its screenshot: conftest.py)."""
    _chromium_en.delete_all_cookies()
    viewport_resize(_chromium_en, width=VIEWPORT[0], height=VIEWPORT[1])
    yield Console(_chromium_en, flower)
    _chromium_en.set_window_size(WINDOW_WIDTH, WINDOW_HEIGHT)


def flower_tasks(base_url: str, search: str = "") -> list[dict]:
    """Flower's own answer to its task list's query (the JSON its page draws from), newest first."""
    query = urllib.parse.urlencode(
        {
            "draw": 1,
            "start": 0,
            "length": 100,
            "order[0][column]": 0,
            "order[0][dir]": "desc",
            "columns[0][data]": "received",
            "search[value]": search,
        }
    )
    with urllib.request.urlopen(f"{base_url}/tasks/datatable?{query}", timeout=10) as answer:
        return json.load(answer)["data"]


def tasks_listed(console: Console, needle: str) -> dict[str, dict[str, str]]:
    """The rows of Flower's task list whose text has `needle`: task name -> {column: text}."""
    columns = [th.get_attribute("data-column") for th in console.find_all("#tasks-table thead th")]
    listed = {}
    for row in console.find_all("#tasks-table tbody tr"):
        cells = dict(zip(columns, (td.text for td in row.find_elements(By.CSS_SELECTOR, "td")), strict=False))
        if needle in " ".join(cells.values()):
            listed[cells["name"]] = cells
    return listed


def test_flower_lists_a_runs_tasks_with_the_run_id(console, flower, stack, simulator, tmp_path):
    # given Flower hearing the workers' task events already (it misses what came before),
    # a simulated device, and a template of a command step on it then a task step
    wait_for(lambda: flower_tasks(flower), what="Flower to list a first task (beat's monitor tick)")
    lamp = DeviceFactory()
    simulator({lamp.name: DeviceBehaviour()})
    template = template_with_steps((lamp, "on", {"level": 80}))
    JobStepFactory(
        template=template,
        position=1,
        kind=StepKind.TASK,
        device=None,
        action="tests.firmware_url",
        args={"version": "2.1"},
    )
    # (and no drain under way, so that the run's start wakes one of its own)
    wait_for(lambda: not redis_connection().exists(inbox.INBOX.wake_key()), what="no drain under way")

    # when the run goes through the stack
    run, _ = run_start(template=template)
    wait_for(lambda: run.refresh_from_db() or run.is_terminal, what="the run to finish")
    assert run.status == RunStatus.SUCCEEDED, run.error
    needle = f"runs=[{run.pk}]"

    def heard() -> list[dict]:
        tasks = flower_tasks(flower, needle)
        return len(tasks) >= 2 and all(task["state"] == "SUCCESS" for task in tasks) and tasks

    wait_for(heard, what=f"Flower to have heard two tasks naming {needle} succeed")

    # and an operator searches Flower's task list for the run
    console.open("/tasks")
    search = console.find("#tasks-table_filter input")
    search.clear()
    search.send_keys(needle)

    # then the list shows the run's tasks with its id: the drain its start woke (in its
    # args) and its task step (in its kwargs)
    # (Flower redraws its table as tasks arrive: a row read mid-redraw is read again.)
    listed = WebDriverWait(
        console.driver, PAGE_WAIT_SECONDS, ignored_exceptions=(StaleElementReferenceException,)
    ).until(
        lambda _: len(found := tasks_listed(console, needle)) >= 2 and found, f"two tasks naming {needle}"
    )
    assert listed.keys() == {inbox.DRAIN_TASK, "jobs.task_step_run"}, listed
    assert listed[inbox.DRAIN_TASK]["args"] == f"wake: size=1, {needle}"
    assert listed["jobs.task_step_run"]["kwargs"] == f"{needle}, step=1, task=tests.firmware_url"
    assert {cells["state"] for cells in listed.values()} == {"SUCCESS"}
    pictures = Path(os.environ.get("IOTQUEUE_FLOWER_SCREENSHOTS") or tmp_path)
    console.find("#tasks-table_wrapper").screenshot(str(pictures / "flower-tasks.png"))

    # when the operator opens the drain's own page (its UUID in the list; the list cuts a
    # long args or kwargs cell at 400 px)
    drain_link = f"//tr[td[1][normalize-space()='{inbox.DRAIN_TASK}']]//a[contains(@href, '/task/')]"
    console.driver.find_element(By.XPATH, drain_link).click()

    # then it shows the drain's args whole, the run's id in them
    arguments_path = "//dt[normalize-space()='Arguments']/following-sibling::dd"
    arguments = WebDriverWait(console.driver, PAGE_WAIT_SECONDS).until(
        lambda driver: driver.find_elements(By.XPATH, arguments_path), "the task page's Arguments"
    )[0]
    assert arguments.text == f"wake: size=1, {needle}"
    console.find("#task-page").screenshot(str(pictures / "flower-task.png"))
