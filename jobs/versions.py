"""Template versions for people: a version's snapshot as text, and the diff of two versions.

Versions are recorded by jobs/services.py (template_version_record); these functions only
read them, so the admin and the REST API show the same thing.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from .models import TemplateVersion


def version_snapshot(version: TemplateVersion) -> dict[str, Any]:
    """Everything a version fixes about a run: default priority, max duration and the steps."""
    return {
        "default_priority": version.default_priority,
        "max_duration": version.max_duration,
        "steps": version.steps,
    }


def snapshot_text(snapshot: dict[str, Any]) -> str:
    """A snapshot as stable, pretty-printed JSON (keys sorted), one value per line."""
    return json.dumps(snapshot, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def snapshot_diff(old: dict[str, Any], new: dict[str, Any], *, old_label: str, new_label: str) -> str:
    """The unified diff of two snapshots' JSON text; empty when they are the same."""
    lines = difflib.unified_diff(
        snapshot_text(old).splitlines(),
        snapshot_text(new).splitlines(),
        fromfile=old_label,
        tofile=new_label,
        lineterm="",
    )
    return "\n".join(lines)


def versions_diff(old: TemplateVersion, new: TemplateVersion) -> str:
    """What changed from version `old` to version `new` of a template, as a unified diff."""
    return snapshot_diff(
        version_snapshot(old),
        version_snapshot(new),
        old_label=f"{old.template.name} v{old.number}",
        new_label=f"{new.template.name} v{new.number}",
    )
