"""Safe substitution of {{ references }} in step args: lookups only, never code.

A string that is exactly one reference takes the referenced value with its JSON type;
a reference inside a longer string is formatted into it. References are dotted paths into
the context, e.g. {{ params.level }} or {{ steps.0.result.serial }}.
"""

from __future__ import annotations

import json
import re
from typing import Any

REFERENCE_RE = re.compile(r"\{\{\s*([A-Za-z_][\w-]*(?:\.[\w-]+)*)\s*\}\}")
ROOTS = ("params", "steps", "device", "run")


class TemplateError(ValueError):
    """A reference that is malformed or cannot be resolved; the message names it."""


def references(value: Any) -> list[str]:
    """Every reference path used anywhere in a JSON value."""
    found: list[str] = []
    if isinstance(value, str):
        found.extend(REFERENCE_RE.findall(value))
        if "{{" in REFERENCE_RE.sub("", value):
            raise TemplateError(f"malformed reference in {value!r}")
    elif isinstance(value, dict):
        for item in value.values():
            found.extend(references(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(references(item))
    return found


def _lookup(path: str, context: dict[str, Any]) -> Any:
    node: Any = context
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise TemplateError(f"{{{{ {path} }}}} has no value (missing {part!r})")
    return node


def render(value: Any, context: dict[str, Any]) -> Any:
    """A copy of `value` with every reference replaced from `context`."""
    if isinstance(value, str):
        whole = REFERENCE_RE.fullmatch(value.strip())
        if whole:
            return _lookup(whole.group(1), context)

        def text(match: re.Match) -> str:
            found = _lookup(match.group(1), context)
            return found if isinstance(found, str) else json.dumps(found)

        return REFERENCE_RE.sub(text, value)
    if isinstance(value, dict):
        return {key: render(item, context) for key, item in value.items()}
    if isinstance(value, list):
        return [render(item, context) for item in value]
    return value
