"""The Chinese catalogue: complete, in step with the code, compiled at install.

A message wrapped in the code but missing from locale/zh_Hans/LC_MESSAGES/django.po, or in
it untranslated or fuzzy, shows in English on a Chinese page: each fails here, with the
command that fixes it (`make messages`, then translate).
"""

from __future__ import annotations

import gettext
import os
import re
import shutil
import subprocess
from pathlib import Path

import polib
import pytest

from devtools.messages import INSTALL_COMMAND, gettext_missing, messages_extract
from iotqueue.catalogue import LOCALE_DIR, catalogue_compile, catalogue_problems, catalogue_sources

PROJECT_DIR = LOCALE_DIR.parent
CATALOGUE = LOCALE_DIR / "zh_Hans" / "LC_MESSAGES" / "django.po"
# What extraction reads (devtools.messages ignores the rest): the product's apps and manage.py.
SOURCES = ("iotqueue", "devices", "jobs", "triggers", "webhooks", "manage.py", "locale")


def messages_of(po: polib.POFile) -> set[tuple[str, str]]:
    """(context, msgid) of every live message of a catalogue."""
    return {(entry.msgctxt or "", entry.msgid) for entry in po if not entry.obsolete}


def project_copy(target: Path) -> Path:
    """The product's sources and catalogue copied to `target`: extraction there leaves ours alone."""
    for name in SOURCES:
        source = PROJECT_DIR / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.mo"))
        else:
            shutil.copy2(source, target / name)
    return target


def test_the_catalogue_has_every_message_the_code_wraps(tmp_path):
    # given GNU gettext (makemessages runs xgettext)
    if gettext_missing():
        pytest.fail(f"GNU gettext is needed to extract the messages: as root run `{INSTALL_COMMAND}`")
    # when the messages are extracted from a copy of the code into a copy of the catalogue
    copy = project_copy(tmp_path / "project")
    messages_extract(copy)

    # then the committed catalogue already had every one of them
    extracted = messages_of(polib.pofile(str(copy / CATALOGUE.relative_to(PROJECT_DIR))))
    missing = sorted(extracted - messages_of(polib.pofile(str(CATALOGUE))))
    assert not missing, (
        f"{len(missing)} message(s) in the code are not in {CATALOGUE.relative_to(PROJECT_DIR)}: "
        f"run `make messages` and translate them: {missing[:20]}"
    )


def test_every_message_of_the_catalogue_is_translated():
    # given every catalogue of the project
    sources = catalogue_sources()
    assert CATALOGUE in sources

    # then none has an untranslated or fuzzy message, or a translation that drops a placeholder
    problems = [problem for source in sources for problem in catalogue_problems(source)]
    assert not problems, "\n".join(problems)


def test_the_catalogue_compiles_into_what_django_reads(tmp_path):
    # given a copy of the catalogues
    locale = tmp_path / "locale"
    shutil.copytree(LOCALE_DIR, locale, ignore=shutil.ignore_patterns("*.mo"))

    # when they are compiled as `make install` and the image build do
    written = catalogue_compile(locale)

    # then each .po has its .mo, which gettext reads, with every message translated
    assert written == [source.with_suffix(".mo") for source in catalogue_sources(locale)]
    with (locale / "zh_Hans" / "LC_MESSAGES" / "django.mo").open("rb") as compiled:
        translations = gettext.GNUTranslations(compiled)
    assert translations.gettext("Simplified Chinese") == "简体中文"
    assert len(polib.mofile(str(written[0]))) == len(polib.pofile(str(CATALOGUE)).translated_entries())


def test_the_catalogue_passes_the_checks_of_gnu_gettext():
    # given GNU gettext's msgfmt
    if shutil.which("msgfmt") is None:
        pytest.fail(f"GNU gettext is needed to check the catalogue: as root run `{INSTALL_COMMAND}`")

    # when it checks the catalogue (formats, header, plural forms) as Django's compilemessages would
    checked = subprocess.run(
        ["msgfmt", "--check", "--output-file", os.devnull, str(CATALOGUE)], capture_output=True, text=True
    )

    # then it finds nothing wrong
    assert checked.returncode == 0, checked.stderr


def test_an_untranslated_fuzzy_or_placeholder_losing_message_is_a_problem(tmp_path):
    # given a catalogue with one message of each kind of mistake, and one right
    source = tmp_path / "django.po"
    source.write_text(
        'msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        'msgid "Devices"\nmsgstr "设备"\n\n'
        'msgid "Run now"\nmsgstr ""\n\n'
        '#, fuzzy\nmsgid "Runs"\nmsgstr "运行"\n\n'
        '#, python-format\nmsgid "Device %(device)s is offline"\nmsgstr "设备离线"\n',
        encoding="utf-8",
    )

    # when it is checked
    problems = catalogue_problems(source)

    # then each mistake is named, and the right message is not
    assert len(problems) == 3
    assert "'Run now' is not translated" in problems[0]
    assert "'Runs' is fuzzy" in problems[1]
    assert "does not keep the placeholders" in problems[2]


def test_the_image_and_make_install_compile_the_catalogue():
    # given the Dockerfile and the Makefile
    dockerfile = (PROJECT_DIR / "Dockerfile").read_text()
    makefile = (PROJECT_DIR / "Makefile").read_text()

    # then the image copies the catalogue and compiles it, and `make install` compiles it
    assert "COPY locale ./locale" in dockerfile
    assert "RUN python -m iotqueue.catalogue compile" in dockerfile
    assert "$(BIN)/python -m iotqueue.catalogue compile" in makefile
    assert re.search(r"^install:.*\$\(CATALOGUES\)", makefile, re.MULTILINE)
