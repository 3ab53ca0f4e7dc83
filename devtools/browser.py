"""Headless Chromium driven by Selenium: the one browser of the browser test tier
(tests/browser/, `make test-browser`) and of `make screenshots` (docs/screenshot.py).

The browser and its driver are Debian's `chromium` and `chromium-driver`, with a Chinese font
(`fonts-wqy-microhei`: without one, Chinese pages render as empty boxes in screenshots),
installed by `python -m devtools.browser install` when missing. Selenium is always handed their paths, so
its Selenium Manager never runs: it would try to download a browser, and the machines this
project runs on reach package registries only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path(os.environ.get("IOTQUEUE_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("IOTQUEUE_CHROMEDRIVER", "/usr/bin/chromedriver"))
# Chinese pages need a CJK font to be seen (screenshots); this one is the smallest Debian has.
CJK_FONT = Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc")
APT_PACKAGES = ("chromium", "chromium-driver", "fonts-wqy-microhei")
INSTALL_COMMAND = f"apt-get update && apt-get install -y {' '.join(APT_PACKAGES)}"
# The width the console must fit without sideways scrolling (issue 32), and a window tall
# enough that most pages are seen without scrolling in a failure screenshot.
WINDOW_WIDTH = 1280
WINDOW_HEIGHT = 900
# Accept-Language values as a browser set to that language sends them.
ACCEPT_LANGUAGES = {"en": "en-US,en", "zh-hans": "zh-Hans,zh-CN,zh"}


class BrowserMissing(RuntimeError):
    """Chromium or chromedriver is not installed, and this process cannot install them."""


def browser_missing() -> list[Path]:
    """The browser binaries that are not there (empty when both are)."""
    return [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]


def browser_install_missing() -> list[Path]:
    """What `browser_install` would install: the binaries, and the CJK font."""
    return [*browser_missing(), *([] if CJK_FONT.exists() else [CJK_FONT])]


def browser_install() -> None:
    """Install Debian's chromium, chromium-driver and the CJK font when one is missing.

    How it fails: not running as root, it raises BrowserMissing naming the command to run;
    apt-get failing raises CalledProcessError (its own output says why).
    """
    if not browser_install_missing():
        return
    if os.geteuid() != 0:
        missing = ", ".join(str(path) for path in browser_install_missing())
        raise BrowserMissing(f"{missing} missing; as root run: {INSTALL_COMMAND}")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=environment)
    subprocess.run(["apt-get", "install", "-y", "-q", *APT_PACKAGES], check=True, env=environment)
    if browser_install_missing():
        raise BrowserMissing(f"{APT_PACKAGES} installed, yet {browser_install_missing()} still missing")


def browser_start(
    *, language: str = "en", width: int = WINDOW_WIDTH, height: int = WINDOW_HEIGHT
) -> webdriver.Chrome:
    """A new headless Chromium whose pages ask for `language` (a key of ACCEPT_LANGUAGES).

    How it fails: BrowserMissing when the binaries are absent (`python -m devtools.browser
    install`); selenium's SessionNotCreatedException when Chromium cannot start.
    """
    if browser_missing():
        raise BrowserMissing(f"{browser_missing()} missing: python -m devtools.browser install")
    accept = ACCEPT_LANGUAGES[language]
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        # Root in a container has no user namespace for Chromium's sandbox.
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--lang={accept.split(',')[0]}",
        # Nothing on the pages comes from outside (issue 32): no background traffic either.
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {"intl.accept_languages": accept})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    return driver


def viewport_resize(driver: webdriver.Chrome, *, width: int, height: int) -> None:
    """Make the page's viewport `width` x `height` CSS pixels (a window's size counts the
    browser's own frame too, which headless Chromium keeps: 143 px of height here)."""
    driver.set_window_size(width, height)
    inner_width, inner_height = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    if (inner_width, inner_height) != (width, height):
        driver.set_window_size(2 * width - inner_width, 2 * height - inner_height)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print("usage: python -m devtools.browser install", file=sys.stderr)
        return 2
    try:
        browser_install()
    except BrowserMissing as exc:
        print(f"devtools.browser: {exc}", file=sys.stderr)
        return 1
    print(f"browser: {CHROMIUM}, {CHROMEDRIVER} and {CJK_FONT.name} present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
