"""Extracting the translatable messages from the code into the catalogues (`make messages`).

Django's makemessages runs GNU gettext's xgettext, which a fresh machine may lack:
`python -m devtools.messages install` installs Debian's `gettext` when running as root, and
says what to run otherwise. `python -m devtools.messages` (`make messages`) installs it if
needed and updates locale/*/LC_MESSAGES/django.po from the code and templates; the new
messages are then translated in the .po and compiled (`python -m iotqueue.catalogue
compile`). Only the product's code is read: tests, benchmarks and this dev tooling speak
English. docs/operations.md#languages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
LANGUAGES = ("zh_Hans",)
APT_PACKAGES = ("gettext",)
INSTALL_COMMAND = f"apt-get update && apt-get install -y {' '.join(APT_PACKAGES)}"
# What makemessages reads and how it writes: paths relative to the project directory.
IGNORED = ("tests/*", "bench/*", "devtools/*", "docs/*", "deploy/*", "var/*", "locale/*")
MAKEMESSAGES_ARGUMENTS = (
    *(f"--locale={language}" for language in LANGUAGES),
    *(f"--ignore={pattern}" for pattern in IGNORED),
    # File names without line numbers: a moved line does not change the catalogue.
    "--add-location=file",
    "--no-obsolete",
)


class GettextMissing(RuntimeError):
    """xgettext is not installed, and this process cannot install it."""


def gettext_missing() -> bool:
    """True when GNU gettext's xgettext and msgmerge are not on PATH."""
    return not (shutil.which("xgettext") and shutil.which("msgmerge"))


def gettext_install() -> None:
    """Install Debian's gettext when xgettext is missing.

    How it fails: not running as root (or without apt-get), it raises GettextMissing naming
    the command to run; apt-get failing raises CalledProcessError (its output says why).
    """
    if not gettext_missing():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise GettextMissing(
            f"GNU gettext (xgettext) is missing: as root run `{INSTALL_COMMAND}` "
            "(or `python -m devtools.messages install`; on macOS `brew install gettext`)"
        )
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=environment)
    subprocess.run(["apt-get", "install", "-y", "-q", *APT_PACKAGES], check=True, env=environment)
    if gettext_missing():
        raise GettextMissing(f"{APT_PACKAGES} installed, yet xgettext is still missing")


def messages_extract(project_dir: Path = PROJECT_DIR) -> None:
    """Update the .po files under `project_dir`/locale from the code under `project_dir`.

    `project_dir` is the checkout, or a copy of it (the catalogue test extracts into one).
    How it fails: GettextMissing without xgettext; CalledProcessError when makemessages
    fails (its output says why, e.g. a malformed {% blocktranslate %}).
    """
    if gettext_missing():
        raise GettextMissing(f"GNU gettext (xgettext) is missing: as root run `{INSTALL_COMMAND}`")
    environment = {**os.environ, "DEBUG": "true", "DJANGO_SETTINGS_MODULE": "iotqueue.settings"}
    subprocess.run(
        [sys.executable, "manage.py", "makemessages", "--verbosity=0", *MAKEMESSAGES_ARGUMENTS],
        cwd=project_dir,
        env=environment,
        check=True,
    )


def main(argv: list[str]) -> int:
    try:
        gettext_install()
        if argv[:1] != ["install"]:
            messages_extract()
            print("catalogues updated from the code: translate the new messages, then compile")
    except GettextMissing as missing:
        print(missing, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
