"""Issuing a device's client certificate from the admin, in a real browser: the key is shown
once, on a page of its own, in English and Chinese, fitting a 1280-px window."""

from __future__ import annotations

import os

import pytest
from selenium.webdriver.support.ui import Select

from devices.credentials import managed
from devices.models import Device
from devtools.browser import WINDOW_WIDTH
from tests.factories import DeviceFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Where a person checking the page by eye finds its screenshots (unset: none are kept).
SCREENSHOTS_ENV = "IOTQUEUE_BROWSER_SCREENSHOTS"


def certificate_issue(console, device: Device) -> None:
    """Select `device` on the devices page and run the admin action that issues a certificate."""
    console.open(f"/admin/devices/device/?q={device.name}")
    console.find(f"input.action-select[value='{device.pk}']").click()
    Select(console.find("select[name=action]")).select_by_value("certificate_issue")
    console.find("button[name=index]").click()


@pytest.mark.parametrize("language", ["en", "zh"])
def test_an_operator_issues_a_certificate_and_sees_its_key_once(language, console, console_zh, operator):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")
    browser = console if language == "en" else console_zh
    # given a device, and the operator on the devices page
    device = DeviceFactory()
    browser.login("operator")

    # when the operator runs "issue a client certificate" on it
    certificate_issue(browser, device)

    # then a page of its own shows the certificate and its private key, and the device
    # keeps only the serial
    assert browser.find(".device-certificate").text.startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY-----" in browser.find(".device-key").text
    device.refresh_from_db()
    assert device.certificate_serial and device.certificate_serial in browser.find("#content-main").text
    assert browser.html_lang() == ("en" if language == "en" else "zh-hans")
    assert browser.scroll_width() <= WINDOW_WIDTH
    if os.environ.get(SCREENSHOTS_ENV):
        path = os.path.join(os.environ[SCREENSHOTS_ENV], f"certificate-{language}.png")
        browser.driver.save_screenshot(path)

    # and reading the page again shows no key: it was shown once
    browser.open(f"/admin/devices/device/{device.pk}/change/")
    assert "PRIVATE KEY" not in browser.find("#content-main").text
