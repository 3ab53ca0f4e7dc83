"""The operator console in a real browser: log in, build a template through the admin form,
read the dashboard, find a stuck run and why, see a run's time view, in English and Chinese,
each page fitting a 1280-px window."""

from __future__ import annotations

import pytest
from django.db.models import QuerySet
from django.utils import translation
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from devices.models import Device
from devtools.browser import WINDOW_WIDTH
from devtools.simulator import DeviceBehaviour
from jobs.models import STEP_IN_FLIGHT, JobRun, JobTemplate, RunStatus, StepRun
from jobs.services import run_start
from tests.browser.conftest import PAGE_WAIT_SECONDS, Console
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def run_finished(run_id: int) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


def device_choose(console: Console, row: int, name: str) -> None:
    """Pick `name` in step row `row`'s Device box (the admin's autocomplete), as a person does."""
    console.find(f"#steps-{row} .field-device .select2-selection").click()
    console.find(".select2-container--open .select2-search__field").send_keys(name)
    option = f"//li[contains(@class, 'select2-results__option') and normalize-space()='{name}']"
    WebDriverWait(console.driver, PAGE_WAIT_SECONDS).until(
        lambda driver: driver.find_elements(By.XPATH, option), f"{name} among the choices"
    )[0].click()


def test_an_operator_logs_in_through_the_admin_login_form(console, operator):
    # given the admin's address, and no session
    console.open("/admin/")

    # then the admin asks for a login first
    assert "/admin/login/" in console.driver.current_url

    # when the operator fills in the login form
    console.login("operator")

    # then the console opens, signed in as the operator
    assert console.driver.current_url.endswith("/admin/")
    assert "operator" in console.find("#user-tools").text.lower()


def test_a_two_step_template_through_the_admin_form_blank_positions_first(console, operator):
    # given two devices, and the operator on the admin's "add template" page
    gate, lamp = DeviceFactory(), DeviceFactory()
    console.login("operator", next_path="/admin/jobs/jobtemplate/add/")
    console.find("#id_name").send_keys("Morning from the browser")

    # when two step rows are added and filled in, their Position left blank as new rows start
    for row, (device, action) in enumerate(((gate, "unlock"), (lamp, "on"))):
        console.find("#steps-group .add-row a").click()
        console.find(f"#id_steps-{row}-action").send_keys(action)
        device_choose(console, row, device.name)
        assert console.find(f"#id_steps-{row}-position").get_attribute("value") == ""
    console.find("input[name=_save]").click()

    # then the form comes back (no server error) with the mistake on each step's Position field
    console.find(".errornote")
    for row in (0, 1):
        box = console.find(f"#steps-{row} .fieldBox.field-position.errors")
        errors = box.find_element(By.XPATH, "..").find_element(By.CSS_SELECTOR, ".errorlist")
        assert errors.text.strip(), f"step row {row}: an error box on Position without a message"
    assert not JobTemplate.objects.filter(name="Morning from the browser").exists()

    # when the operator gives the steps their places and saves again
    for row in (0, 1):
        field = console.find(f"#id_steps-{row}-position")
        field.clear()
        field.send_keys(str(row), Keys.TAB)
    console.find("input[name=_save]").click()

    # then the template is saved with both steps in order, and the admin says so
    console.find(".messagelist .success")
    template = JobTemplate.objects.get(name="Morning from the browser")
    steps = list(template.steps.order_by("position").values_list("position", "device__name", "action"))
    assert steps == [(0, gate.name, "unlock"), (1, lamp.name, "on")]


def test_a_run_page_shows_the_time_view_with_a_bar_per_step(console, operator, stack, simulator):
    # given a two-device run that finished
    gate, lamp = DeviceFactory(), DeviceFactory()
    simulator({gate.name: DeviceBehaviour(), lamp.name: DeviceBehaviour()})
    template = template_with_steps((gate, "unlock", {}), (lamp, "on", {"level": 80}))
    run, _ = run_start(template=template)
    run = wait_for(lambda: run_finished(run.pk), what="the run to finish")
    assert run.status == RunStatus.SUCCEEDED, run.error

    # when the operator opens the run's page
    console.login("operator", next_path=f"/admin/jobs/jobrun/{run.pk}/change/")

    # then the time view is drawn, one bar per step on the device lanes
    view = console.find("svg#run-timeview")
    bars = view.find_elements(By.CSS_SELECTOR, ".tv-bar")
    assert len(bars) >= 2
    assert all(bar.size["width"] > 0 for bar in bars)
    assert gate.name in view.text and lamp.name in view.text


FLEET_STATES = ("online", "offline", "busy", "idle", "disabled", "total")


def fleet_from_database(devices: QuerySet) -> dict[str, int]:
    """The fleet board's numbers counted from the tables directly (every device here tracks
    presence): enabled devices online or not, busy ones with a command in flight."""
    in_flight = StepRun.objects.filter(status__in=STEP_IN_FLIGHT).values("device_id")
    enabled = devices.filter(enabled=True)
    return {
        "online": enabled.filter(online=True).count(),
        "offline": enabled.filter(online=False).count(),
        "busy": enabled.filter(pk__in=in_flight).count(),
        "idle": enabled.filter(online=True).exclude(pk__in=in_flight).count(),
        "disabled": devices.filter(enabled=False).count(),
        "total": devices.count(),
    }


def fleet_on_page(console: Console, rows: str) -> dict[str, int]:
    """The numbers in the fleet board's `rows`, read at once (the board refreshes itself)."""
    cells = console.driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' [data-count]'),"
        " (cell) => [cell.dataset.count, cell.textContent.trim()]);",
        rows,
    )
    return {state: int(count) for state, count in cells}


def test_the_dashboard_counts_the_fleet_as_the_database_does(console, operator, stack, manual_device):
    # given devices at two sites: online and idle, offline, disabled, and one busy with a
    # command it never answers
    for site, online in (("berlin", True), ("berlin", True), ("berlin", False), ("shanghai", False)):
        DeviceFactory(online=online, labels={"site": site})
    DeviceFactory(enabled=False, labels={"site": "shanghai"})
    busy = DeviceFactory(labels={"site": "shanghai"})
    silent = manual_device(busy.name)
    run, _ = run_start(template=template_with_steps((busy, "reboot", {})))
    silent.next_command()
    wait_for(lambda: StepRun.objects.filter(run=run, status__in=STEP_IN_FLIGHT).exists(), what="in flight")
    expected = fleet_from_database(Device.objects.all())
    assert expected == {"online": 3, "offline": 2, "busy": 1, "idle": 2, "disabled": 1, "total": 6}

    # when the operator opens the dashboard
    console.login("operator")
    console.find("#dash-fleet")

    # then its totals are the database's
    assert fleet_on_page(console, "#dash-fleet-totals") == expected

    # and per site, once the operator picks the label
    Select(console.find("#dash-label")).select_by_value("site")
    console.find("#dash-fleet-labels")
    for site in ("berlin", "shanghai"):
        on_page = fleet_on_page(console, f'#dash-fleet-labels tr[data-label-value="{site}"]')
        assert on_page == fleet_from_database(Device.objects.filter(labels__site=site)), site

    # and a number leads to the devices it counts (followed by its address: the board may be
    # swapped for a fresh one between finding the link and clicking it)
    console.find('#dash-fleet-totals a[data-count="busy"]')
    console.driver.get(
        console.driver.execute_script(
            "return document.querySelector('#dash-fleet-totals a[data-count=\"busy\"]').href"
        )
    )
    console.find("#result_list")
    assert [cell.text for cell in console.find_all("#result_list tbody .field-name")] == [busy.name]


def test_a_run_blocked_by_an_offline_device_is_listed_as_stuck_with_why(console, operator, stack, settings):
    # given runs count as stuck after a second, and a run whose device is offline
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 1
    gate = DeviceFactory(online=False)
    run, _ = run_start(template=template_with_steps((gate, "unlock", {})))
    wait_for(lambda: run.step_runs.exists(), what="the step to be queued")

    # when the operator looks at the dashboard a moment later
    console.login("operator")
    row_css = f'#dash-stuck tr[data-run="{run.pk}"]'

    def stuck_row_shown(driver) -> bool:
        console.open("/admin/")
        return bool(console.find_all(row_css))

    WebDriverWait(console.driver, PAGE_WAIT_SECONDS, poll_frequency=1).until(stuck_row_shown, "the stuck run")

    # then the run is under stuck runs, with its reason in words and a link to it
    row = console.find(row_css)
    assert row.get_attribute("data-reason") == "device_offline"
    assert f"{gate.name} is offline" in row.find_element(By.CSS_SELECTOR, ".iq-dash-reason").text
    row.find_element(By.CSS_SELECTOR, "a").click()
    WebDriverWait(console.driver, PAGE_WAIT_SECONDS).until(
        lambda driver: f"/admin/jobs/jobrun/{run.pk}/change/" in driver.current_url, "the run's page"
    )


@pytest.mark.parametrize(
    "path",
    ["/admin/", "/admin/jobs/jobrun/", "/admin/devices/device/"],
    ids=["dashboard", "run-list", "device-list"],
)
def test_the_console_fits_1280_pixels_without_sideways_scrolling(console, operator, stack, path):
    # given devices with labels and runs in every state a list shows
    online = DeviceFactory(labels={"site": "berlin", "room": "lab-2", "kind": "lamp"}, description="Lab lamp")
    offline = DeviceFactory(online=False, labels={"site": "shanghai", "kind": "gate"})
    template = template_with_steps((online, "on", {"level": 80}), (offline, "unlock", {"door": 7}))
    for _ in range(3):
        run_start(template=template, parameters={"reason": "a fairly long reason " * 3})

    # when the operator opens the page in a 1280-px-wide window
    console.login("operator", next_path=path)
    console.find("#content")

    # then nothing sticks out sideways
    assert console.driver.execute_script("return window.innerWidth") == WINDOW_WIDTH
    assert console.scroll_width() <= WINDOW_WIDTH


def zh(text: str) -> str:
    """`text` as the Chinese catalogue has it; fails the test when it has no translation."""
    with translation.override("zh-hans"):
        translated = translation.gettext(text)
    assert translated != text, f"no Chinese for {text!r}"
    return translated


def test_the_console_speaks_chinese_to_a_chinese_browser(console_zh, operator, stack):
    # given a browser whose Accept-Language is zh-Hans, and a run in flight to look at
    device = DeviceFactory()
    run, _ = run_start(template=template_with_steps((device, "on", {})))
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.RUNNING, what="the run to start")
    with translation.override("zh-hans"):
        running = str(RunStatus.RUNNING.label)
        device_name = str(Device._meta.verbose_name)
    assert running != "Running"

    # when the operator opens the login page
    console_zh.open("/admin/login/")

    # then it is already Chinese
    assert console_zh.html_lang() == "zh-hans"

    # and so are the dashboard, the run list, a run's page and the device list, each with
    # words of its own
    console_zh.login("operator")
    pages = {
        "/admin/": ("#dash-stuck h2", zh("Stuck runs")),
        "/admin/jobs/jobrun/": ("#result_list", running),
        f"/admin/jobs/jobrun/{run.pk}/change/": ("#content", running),
        "/admin/devices/device/": ("#content h1", device_name),
    }
    for path, (css, words) in pages.items():
        console_zh.open(path)
        assert words in console_zh.find(css).text, (path, words)
        assert console_zh.html_lang() == "zh-hans", path
        assert zh("iotqueue console") in console_zh.find("#site-name").text, path
        assert zh("Log out") in console_zh.find("#user-tools").text, path
