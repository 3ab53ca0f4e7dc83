"""NUL characters: valid in JSON and Python strings, refused by PostgreSQL (text and jsonb).

Input that carries one would pass every check and then fail as a database error (an HTTP
500, a task that dies, a bridge handler that drops the message unrecorded). So every
entrance refuses it up front, with the place it was found: the REST parser and the
middleware (iotqueue/api.py), and device and trigger messages (devices/protocol.py).
"""

from __future__ import annotations

from typing import Any

NUL = "\x00"


def nul_path(value: Any, path: str = "") -> str | None:
    """Where in a decoded JSON value a string (or key) holds a NUL, e.g. `args.name`; None if nowhere."""
    if isinstance(value, str):
        return path or "(the value)" if NUL in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if NUL in str(key):
                return here
            found = nul_path(item, here)
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = nul_path(item, f"{path}[{index}]")
            if found:
                return found
    return None
