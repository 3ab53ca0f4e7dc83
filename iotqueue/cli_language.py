"""The language of the management commands: the operator's locale (LANG and friends).

A terminal says its language in the environment (`LANG=zh_CN.UTF-8`), not in an
Accept-Language header: a command that subclasses LocalizedCommand prints its tables,
headers and messages in that language when the project speaks it, in English otherwise.
docs/operations.md#languages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from django.conf import settings
from django.core.management.base import BaseCommand
from django.utils import translation

# Where gettext looks, in its order: LANGUAGE (a colon-separated list, GNU) wins, then
# LC_ALL, LC_MESSAGES and LANG (POSIX). The first one set decides.
LOCALE_VARIABLES = ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG")
# The locales that mean "no language chosen": English, the project's default.
NEUTRAL_LOCALES = ("C", "POSIX", "C.UTF-8")


def language_from_environment(environ: Mapping[str, str] | None = None) -> str:
    """The Django language code for the locale in `environ` (os.environ by default).

    `zh_CN.UTF-8`, `zh_SG` and `zh_Hans` give "zh-hans"; a language the project does not
    speak, an unset or a C locale give settings.LANGUAGE_CODE.
    """
    environ = os.environ if environ is None else environ
    for variable in LOCALE_VARIABLES:
        value = environ.get(variable, "")
        if not value:
            continue
        locale = value.split(":")[0].split(".")[0].split("@")[0]
        if not locale or value in NEUTRAL_LOCALES or locale in NEUTRAL_LOCALES:
            return settings.LANGUAGE_CODE
        try:
            return translation.get_supported_language_variant(translation.to_language(locale))
        except LookupError:
            return settings.LANGUAGE_CODE
    return settings.LANGUAGE_CODE


class LocalizedCommand(BaseCommand):
    """A management command that speaks the language of the operator's locale.

    The language is active for the command's run only (a test calling several commands
    in one process sees no leftover).
    """

    def execute(self, *args, **options):
        with translation.override(language_from_environment()):
            return super().execute(*args, **options)
