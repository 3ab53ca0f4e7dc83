"""The device's state file: the command it executes and the ids it finished, across reboots.

Written whole to a temporary file and renamed over the old one, so a power cut leaves either
the old state or the new one, never half of each.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_FILE = "iotqueue-device.json"


class StateFile:
    """One device's state file in `directory` (created if missing)."""

    def __init__(self, directory: str | os.PathLike[str], device: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"{device}.{STATE_FILE}"

    def load(self) -> dict[str, Any] | None:
        """The saved snapshot; None when there is none. An unreadable file is logged and
        treated as none (the device then starts as new and asks jobs/get)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("iotqueue-device: state file %s unreadable, starting afresh: %s", self.path, exc)
            return None

    def save(self, snapshot: dict[str, Any]) -> None:
        """Write the snapshot durably (fsync before the rename). Raises OSError."""
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(snapshot, handle, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
