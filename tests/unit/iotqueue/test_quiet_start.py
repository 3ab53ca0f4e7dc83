"""A management command prints what it has to say, and no library banner before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_management_command_prints_no_axes_banner():
    # when a management command runs as a user runs it
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DEBUG": "true", "DJANGO_SETTINGS_MODULE": "iotqueue.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )

    # then it says only its own result: django-axes' start-up banner is off
    assert result.returncode == 0, result.stderr
    assert "AXES" not in result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout
