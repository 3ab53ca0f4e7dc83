"""The management commands' language, from the operator's locale variables."""

from __future__ import annotations

import pytest
from django.utils import translation

from iotqueue.cli_language import LocalizedCommand, language_from_environment


@pytest.mark.parametrize(
    ("environ", "language"),
    [
        ({"LANG": "zh_CN.UTF-8"}, "zh-hans"),
        ({"LANG": "zh_SG"}, "zh-hans"),
        ({"LC_MESSAGES": "zh_Hans"}, "zh-hans"),
        ({"LANGUAGE": "zh_CN:en", "LANG": "en_US.UTF-8"}, "zh-hans"),
        ({"LC_ALL": "zh_CN.UTF-8", "LANG": "en_US.UTF-8"}, "zh-hans"),
        ({"LANG": "en_US.UTF-8"}, "en"),
        ({"LC_ALL": "C", "LANG": "zh_CN.UTF-8"}, "en"),
        ({"LANG": "C.UTF-8"}, "en"),
        ({"LANG": "fr_FR.UTF-8"}, "en"),
        ({}, "en"),
    ],
)
def test_the_locale_variables_choose_the_language(environ, language):
    # given the locale variables of a terminal
    # when the commands' language is read from them
    # then it is the project's language for that locale, English when it speaks none of it
    assert language_from_environment(environ) == language


class Greeting(LocalizedCommand):
    def handle(self, *args, **options) -> str:
        return translation.get_language()


def test_a_localized_command_speaks_the_locale_language_for_its_run_only(monkeypatch):
    # given a terminal in Chinese and this process in English
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    for variable in ("LANGUAGE", "LC_ALL", "LC_MESSAGES"):
        monkeypatch.delenv(variable, raising=False)
    translation.activate("en")

    # when a localized command runs
    spoken = Greeting().execute(no_color=True, force_color=False, skip_checks=True, stdout=None, stderr=None)

    # then it ran in Chinese, and the process is back to English after it
    assert spoken == "zh-hans"
    assert translation.get_language() == "en"
