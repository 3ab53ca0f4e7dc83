"""The browser tier: the admin console in a real headless Chromium (devtools/browser.py),
served by pytest-django's live server next to the real worker and bridge (`stack`).

Marked `browser`, which `make test` deselects (pyproject.toml); `make test-browser` runs it.
A failed test leaves a screenshot of each browser's page in a folder of the temporary
directory (iotqueue-browser-failures-*); the failure report prints its path.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from devtools.browser import WINDOW_WIDTH, browser_start

# Upper bound for a page or an element to appear; not a performance target (the machine is
# shared and two cores): it only turns a missing element into a failure instead of a hang.
PAGE_WAIT_SECONDS = 30.0
PASSWORD = "browser-tier-pw"


@dataclass
class Console:
    """One browser on the admin: a language, the live server's URL, where failures go."""

    driver: WebDriver
    base_url: str
    visited: list[str] = field(default_factory=list)

    def open(self, path: str) -> None:
        self.visited.append(path)
        self.driver.get(self.base_url + path)

    def find(self, css: str, *, timeout: float = PAGE_WAIT_SECONDS) -> WebElement:
        """The element `css` once it is on the page (fails the test after `timeout`)."""
        condition = expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
        return WebDriverWait(self.driver, timeout).until(condition, f"no {css} on {self.driver.current_url}")

    def find_all(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def login(self, username: str, password: str = PASSWORD, *, next_path: str = "/admin/") -> None:
        """Sign in through the admin's own login form, as a person would."""
        self.driver.delete_all_cookies()
        self.open(f"/admin/login/?next={next_path}")
        self.find("#id_username").send_keys(username)
        self.find("#id_password").send_keys(password)
        self.find("#login-form [type=submit]").click()
        WebDriverWait(self.driver, PAGE_WAIT_SECONDS).until(
            lambda driver: "/admin/login/" not in driver.current_url, "the login form to let us in"
        )

    def html_lang(self) -> str:
        return self.find("html").get_attribute("lang") or ""

    def scroll_width(self) -> int:
        return self.driver.execute_script("return document.documentElement.scrollWidth")


@pytest.fixture(scope="session", autouse=True)
def _services_before_live_server(services) -> None:
    """The session's servers are set up before the first test starts the live server.

    pytest-django's live server overrides settings for each test that uses it (its own host
    in ALLOWED_HOSTS); `services` setting REDIS_URL & co. inside such an override would
    see them undone when that test ends. A session fixture runs before every test's.
    """


@pytest.fixture(scope="session")
def _chromium_en() -> Iterator[WebDriver]:
    driver = browser_start(language="en", width=WINDOW_WIDTH)
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def _chromium_zh() -> Iterator[WebDriver]:
    driver = browser_start(language="zh-hans", width=WINDOW_WIDTH)
    yield driver
    driver.quit()


@pytest.fixture
def console(_chromium_en, live_server) -> Console:
    """The admin in a browser that asks for English, cookies cleared."""
    _chromium_en.delete_all_cookies()
    return Console(_chromium_en, live_server.url)


@pytest.fixture
def console_zh(_chromium_zh, live_server) -> Console:
    """The admin in a browser that asks for Chinese (Accept-Language: zh-Hans), cookies cleared."""
    _chromium_zh.delete_all_cookies()
    return Console(_chromium_zh, live_server.url)


@pytest.fixture
def operator() -> User:
    """A superuser the browser signs in as (with PASSWORD)."""
    return User.objects.create_superuser("operator", "operator@example.com", PASSWORD)


_FAILURES_DIR = pytest.StashKey[Path]()


def failures_dir(config: pytest.Config) -> Path:
    """This run's folder of failure screenshots, made at the first failure. Outside pytest's
    own temporary folders, which keep only the last three runs (of anyone on the machine)."""
    if _FAILURES_DIR not in config.stash:
        config.stash[_FAILURES_DIR] = Path(tempfile.mkdtemp(prefix="iotqueue-browser-failures-"))
    return config.stash[_FAILURES_DIR]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed browser test saves a screenshot of each browser's page; the report names it."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for name in ("console", "console_zh"):
        browser = getattr(item, "funcargs", {}).get(name)
        if not isinstance(browser, Console):
            continue
        path = failures_dir(item.config) / f"{item.name}-{name}.png"
        try:
            browser.driver.save_screenshot(str(path))
            line = f"{name}: screenshot of {browser.driver.current_url} saved to {path}"
        except Exception as exc:  # the browser itself may be what failed
            line = f"{name}: no screenshot ({exc})"
        report.sections.append(("browser", line))
