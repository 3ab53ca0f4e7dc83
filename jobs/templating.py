"""Safe substitution of {{ references }} in step args: lookups only, never code.

A string that is exactly one reference takes the referenced value with its JSON type;
a reference inside a longer string is formatted into it. References are dotted paths into
the context, e.g. {{ params.level }} or {{ steps.0.result.serial }}.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.utils.translation import gettext as _

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
            raise TemplateError(_("malformed reference in %(value)s") % {"value": repr(value)})
    elif isinstance(value, dict):
        for item in value.values():
            found.extend(references(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(references(item))
    return found


def parameter_names(value: Any) -> list[str]:
    """The run parameters a JSON value reads: NAME of each {{ params.NAME… }}, first use first.

    Lenient where `references` is strict: a malformed reference is skipped (validation
    reports it where it is written), so a plan stored before a check existed still answers.
    """
    names: list[str] = []
    if isinstance(value, str):
        for path in REFERENCE_RE.findall(value):
            root, _dot, rest = path.partition(".")
            name = rest.split(".")[0]
            if root == "params" and name and name not in names:
                names.append(name)
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            names.extend(name for name in parameter_names(item) if name not in names)
    return names


def _lookup(path: str, context: dict[str, Any]) -> Any:
    node: Any = context
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise TemplateError(
                _("{{ %(path)s }} has no value (missing '%(part)s')") % {"path": path, "part": part}
            )
    return node


def render(
    value: Any,
    context: dict[str, Any],
    *,
    limit: int | None = None,
    setting: str = "IOTQUEUE_COMMAND_MAX_BYTES",
) -> Any:
    """A copy of `value` with every reference replaced from `context`.

    With `limit`, the result may take at most that many bytes as compact JSON: rendering
    stops (TemplateError) as soon as the values it produced exceed it, before a copy larger
    than the limit is built — references repeat values, so a small template can expand a
    large parameter many times over. The error names `setting`, where the limit comes from.
    """
    budget = _Budget(limit, setting)
    rendered = _render(value, context, budget)
    if limit is not None:
        size = json_size(rendered)
        if size > limit:
            raise budget.exceeded(size)
    return rendered


def json_size(value: Any) -> int:
    """The bytes `value` takes as compact JSON, as a command's body carries it: ASCII, with
    every other character escaped (`\\u00e9`, twice that for an emoji)."""
    return len(json.dumps(value, separators=(",", ":")))


class _Budget:
    """Bytes left for a render's output (a lower bound of its size: strings and values)."""

    def __init__(self, limit: int | None, setting: str) -> None:
        self.limit, self.setting = limit, setting
        self.used = 0

    def spend(self, size: int) -> None:
        if self.limit is None:
            return
        self.used += size
        if self.used > self.limit:
            raise self.exceeded(self.used)

    def exceeded(self, size: int) -> TemplateError:
        message = _(
            "rendered, it takes more than %(limit)d bytes (at least %(size)d; %(setting)s): "
            "use fewer or smaller references"
        )
        return TemplateError(message % {"limit": self.limit, "size": size, "setting": self.setting})


def _render(value: Any, context: dict[str, Any], budget: _Budget) -> Any:
    if isinstance(value, str):
        whole = REFERENCE_RE.fullmatch(value.strip())
        if whole:
            found = _lookup(whole.group(1), context)
            budget.spend(json_size(found))
            return found

        def text(match: re.Match) -> str:
            found = _lookup(match.group(1), context)
            formatted = found if isinstance(found, str) else json.dumps(found)
            budget.spend(json_size(formatted))
            return formatted

        budget.spend(json_size(REFERENCE_RE.sub("", value)))
        return REFERENCE_RE.sub(text, value)
    if isinstance(value, dict):
        return {key: _render(item, context, budget) for key, item in value.items()}
    if isinstance(value, list):
        return [_render(item, context, budget) for item in value]
    return value
