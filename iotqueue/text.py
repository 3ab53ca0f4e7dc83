"""Text that can be stored: one rule for every entrance (REST, admin, CLI, MQTT payloads).

Two kinds of character pass every JSON and Python check and then fail later, far from the
input that carried them: a NUL (`\\u0000`, refused by PostgreSQL's text and jsonb) and a
lone UTF-16 surrogate (`\\ud800`-`\\udfff`, which JSON's `\\u` escapes and Python's
surrogateescape produce but UTF-8 cannot encode). Stored, the first is a database error;
the second a `UnicodeEncodeError` in the worker writing it, or, once in a row, a 500 for
every page that renders it. So every entrance refuses both up front, naming the place:
the REST parsers and JSON fields (iotqueue/api.py), the admin's JSON fields
(iotqueue/forms.py), run parameters (jobs/services.py) and device and trigger messages
(devices/protocol.py).
"""

from __future__ import annotations

import re
from typing import Any

NUL = "\x00"
# A NUL, or a surrogate code point: in a Python str only ever a lone one (a pair decodes
# to one astral character), and never encodable as UTF-8.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def text_unstorable(text: str) -> str | None:
    """Why `text` cannot be stored (naming the character), or None when it can."""
    if text.isascii() and NUL not in text:
        return None
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    char = found.group()
    if char == NUL:
        return "a NUL character (\\u0000)"
    return f"a lone surrogate (\\u{ord(char):04x}), which is not valid Unicode text"


def text_problem(value: Any, path: str = "") -> str | None:
    """Where in a decoded JSON value a string or key cannot be stored, and why; None if
    nowhere. E.g. `labels.a: a lone surrogate (\\udfff), which is not valid Unicode text`."""
    if isinstance(value, str):
        why = text_unstorable(value)
        return f"{_printable(path) or '(the value)'}: {why}" if why else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            why = text_unstorable(str(key))
            if why:
                return f"{_printable(here)} (a key): {why}"
            found = text_problem(item, here)
            if found:
                return found
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = text_problem(item, f"{path}[{index}]")
            if found:
                return found
    return None


def _printable(path: str) -> str:
    # The path itself may hold the bad character (a key): shown escaped, never raw.
    return path.encode("utf-8", "backslashreplace").decode().replace(NUL, "\\u0000")
