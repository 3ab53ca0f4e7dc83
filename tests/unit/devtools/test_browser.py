"""devtools/browser.py without a browser: what `python -m devtools.browser install` does when
Chromium is missing and it may not install it."""

from __future__ import annotations

import re

import pytest

from devtools import browser


@pytest.fixture
def nothing_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(browser, "CHROMIUM", tmp_path / "chromium")
    monkeypatch.setattr(browser, "CHROMEDRIVER", tmp_path / "chromedriver")
    monkeypatch.setattr(browser, "CJK_FONT", tmp_path / "font.ttc")


def test_without_root_the_install_names_the_command_instead_of_running_it(nothing_installed, monkeypatch):
    # given no browser, and a user who is not root
    monkeypatch.setattr(browser.os, "geteuid", lambda: 1000)
    ran = []
    monkeypatch.setattr(browser.subprocess, "run", lambda *args, **kwargs: ran.append(args))

    # when the install is asked for
    with pytest.raises(browser.BrowserMissing) as refused:
        browser.browser_install()

    # then nothing ran, and the error says what is missing and which command installs it
    assert ran == []
    assert "chromium" in str(refused.value)
    assert "apt-get install -y chromium chromium-driver fonts-wqy-microhei" in str(refused.value)
    assert browser.main(["install"]) == 1


def test_starting_a_browser_that_is_not_there_says_how_to_install_it(nothing_installed):
    with pytest.raises(browser.BrowserMissing, match=re.escape("python -m devtools.browser install")):
        browser.browser_start()
