"""English and Simplified Chinese: the admin, a run page, the API's errors and the language
switcher, as a browser asking for Chinese gets them (docs/operations.md#languages)."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from rest_framework.test import APIClient

from jobs.models import JobRun, RunStatus
from tests.factories import JobTemplateFactory

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]

CHINESE_BROWSER = "zh-CN,zh;q=0.9,en;q=0.8"
ENGLISH_BROWSER = "en-US,en;q=0.9"


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    return user


def page_language(page: str) -> str:
    found = re.search(r'<html lang="([^"]+)"', page)
    assert found, "no <html lang> on the page"
    return found.group(1)


def test_a_chinese_browser_gets_the_admin_in_chinese(client, boss):
    # given a browser whose first language is Chinese (China)
    # when it opens the admin's first page
    page = client.get("/admin/", HTTP_ACCEPT_LANGUAGE=CHINESE_BROWSER).text

    # then the page says it is Simplified Chinese, and Django's, the project's and the
    # switcher's words are Chinese
    assert page_language(page) == "zh-hans"
    assert "注销" in page  # "Log out", Django's catalogue
    assert "任务运行" in page  # "Job runs", the project's
    assert "登录尝试" in page  # django-axes' "Access attempts", which ships no Chinese
    assert "语言" in page and "简体中文" in page  # the switcher
    assert ">Log out<" not in page


def test_an_english_browser_gets_the_admin_in_english(client, boss):
    # given a browser that asks for English
    # when it opens the admin
    page = client.get("/admin/", HTTP_ACCEPT_LANGUAGE=ENGLISH_BROWSER).text

    # then the page is English
    assert page_language(page) == "en"
    assert "Log out" in page and "Job runs" in page
    assert "任务运行" not in page


def test_a_run_page_is_chinese_for_a_chinese_browser(client, boss):
    # given a run
    run = JobRun.objects.create(template=JobTemplateFactory(), status=RunStatus.SUCCEEDED)

    # when a Chinese browser opens its page
    response = client.get(f"/admin/jobs/jobrun/{run.pk}/change/", HTTP_ACCEPT_LANGUAGE=CHINESE_BROWSER)

    # then it renders in Chinese: the breadcrumbs' model name and Django's "Home"
    assert response.status_code == 200
    page = response.text
    assert page_language(page) == "zh-hans"
    assert "首页" in page and "任务运行" in page


def test_django_celery_beat_speaks_its_own_chinese(client, boss):
    # given a Chinese browser
    # when it opens the periodic tasks django-celery-beat adds to the admin
    page = client.get("/admin/django_celery_beat/periodictask/", HTTP_ACCEPT_LANGUAGE=CHINESE_BROWSER).text

    # then the app's own zh-Hans catalogue is used
    assert "周期任务" in page


def test_the_switcher_chooses_the_language_whatever_the_browser_asks(client, boss):
    # given an English browser on an admin page, which shows the switcher
    page = client.get("/admin/", HTTP_ACCEPT_LANGUAGE=ENGLISH_BROWSER).text
    assert 'action="/i18n/setlang/"' in page and 'name="language"' in page

    # when it picks Simplified Chinese in the switcher
    switched = client.post("/i18n/setlang/", {"language": "zh-hans", "next": "/admin/"})

    # then it goes back to the page, and the admin is Chinese from then on, the browser's
    # English notwithstanding
    assert switched.status_code == 302 and switched["Location"] == "/admin/"
    assert switched.cookies[settings.LANGUAGE_COOKIE_NAME].value == "zh-hans"
    page = client.get("/admin/", HTTP_ACCEPT_LANGUAGE=ENGLISH_BROWSER).text
    assert page_language(page) == "zh-hans" and "注销" in page

    # and picking English switches back
    client.post("/i18n/setlang/", {"language": "en", "next": "/admin/"})
    page = client.get("/admin/", HTTP_ACCEPT_LANGUAGE=CHINESE_BROWSER).text
    assert page_language(page) == "en" and "Log out" in page


def test_the_api_answers_a_chinese_client_in_chinese(boss):
    # given a REST client whose requests ask for Chinese
    api = APIClient()
    api.force_authenticate(boss)

    # when it creates a device with a name outside the name alphabet and no name at all
    bad_name = api.post("/api/devices/", {"name": "a/b"}, format="json", HTTP_ACCEPT_LANGUAGE="zh-CN")
    no_name = api.post("/api/devices/", {}, format="json", HTTP_ACCEPT_LANGUAGE="zh-CN")

    # then the errors are Chinese: the project's own message and DRF's
    assert bad_name.status_code == 400 and "只能使用字母" in str(bad_name.json()["name"])
    assert no_name.status_code == 400 and no_name.json()["name"] == ["该字段是必填项。"]
    assert bad_name["Content-Language"] == "zh-hans"


def test_the_command_line_speaks_the_terminals_language(monkeypatch):
    # given a run of a template with a Chinese name, and a terminal set to Chinese
    JobRun.objects.create(template=JobTemplateFactory(name="晨间例程"), status=RunStatus.SUCCEEDED)
    for variable in ("LANGUAGE", "LC_ALL", "LC_MESSAGES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")

    # when the operator lists the runs
    out = StringIO()
    call_command("runs", stdout=out)

    # then the table's header is Chinese
    header, row = out.getvalue().splitlines()[:2]
    assert "任务模板" in header and "状态" in header and "TEMPLATE" not in header
    assert "晨间例程" in row

    # and with an English terminal it is English again
    monkeypatch.setenv("LANG", "en_US.UTF-8")
    out = StringIO()
    call_command("runs", stdout=out)
    assert "TEMPLATE" in out.getvalue().splitlines()[0]
