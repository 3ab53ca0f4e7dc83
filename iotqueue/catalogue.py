"""The translation catalogues: compiled at install, checked by the tests.

The sources are locale/<language>/LC_MESSAGES/django.po (committed); Django reads the
compiled django.mo beside each (not committed). Compiling takes only Python (polib), so a
fresh machine and the image build need no GNU gettext: `make install` and the Dockerfile run
`python -m iotqueue.catalogue compile`. Extracting the messages from the code does need
gettext's xgettext (devtools/messages.py, `make messages`). docs/operations.md#languages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import polib

LOCALE_DIR = Path(__file__).resolve().parent.parent / "locale"
# %(name)s (with flags and precision: %(share).1f), %s, %d and {name}: what a translation must
# keep, each as often as the original.
_PLACEHOLDER = re.compile(r"%\([A-Za-z_]\w*\)[-+ #0]*\d*(?:\.\d+)?[a-zA-Z]|%[sdfir]|\{[A-Za-z_]\w*\}")


def catalogue_sources(locale_dir: Path = LOCALE_DIR) -> list[Path]:
    """Every .po file under `locale_dir`, sorted."""
    return sorted(locale_dir.glob("*/LC_MESSAGES/*.po"))


def catalogue_compile(locale_dir: Path = LOCALE_DIR, *, stale_only: bool = False) -> list[Path]:
    """Compile each .po under `locale_dir` into the .mo beside it; the .mo files written.

    stale_only: leave a .mo alone when it is newer than its .po. Fuzzy and untranslated
    messages are left out of the .mo (they show in English), as msgfmt does.
    How it fails: OSError when a .po cannot be read or parsed, or the .mo cannot be written.
    """
    written = []
    for source in catalogue_sources(locale_dir):
        target = source.with_suffix(".mo")
        if stale_only and target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
            continue
        polib.pofile(str(source)).save_as_mofile(str(target))
        written.append(target)
    return written


def _placeholders(text: str) -> list[str]:
    return sorted(_PLACEHOLDER.findall(text))


def catalogue_problems(source: Path) -> list[str]:
    """What keeps the catalogue `source` from being complete, one line per message.

    A message is a problem when it is untranslated, fuzzy (a guess makemessages made from a
    similar message, not a translation), or when its translation lacks or adds a placeholder.
    """
    problems = []
    for entry in polib.pofile(str(source)):
        if entry.obsolete:
            continue
        where = f"{source.name}: msgid {entry.msgid!r}"
        if "fuzzy" in entry.flags:
            problems.append(f"{where} is fuzzy")
            continue
        if entry.msgid_plural:
            translations = [text for _, text in sorted(entry.msgstr_plural.items())]
            original = entry.msgid_plural
        else:
            translations = [entry.msgstr]
            original = entry.msgid
        if not all(translations):
            problems.append(f"{where} is not translated")
            continue
        for translation in translations:
            if _placeholders(translation) != _placeholders(original):
                problems.append(f"{where}: translation {translation!r} does not keep the placeholders")
    return problems


def main(argv: list[str]) -> int:
    """`compile` (every catalogue), `compile --stale` (the changed ones) or `check`."""
    command = argv[0] if argv else ""
    if command == "compile":
        for target in catalogue_compile(stale_only="--stale" in argv):
            print(f"compiled {target.relative_to(LOCALE_DIR.parent)}")
        return 0
    if command == "check":
        problems = [line for source in catalogue_sources() for line in catalogue_problems(source)]
        print("\n".join(problems) or "catalogues complete")
        return 1 if problems else 0
    print("usage: python -m iotqueue.catalogue compile [--stale] | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
