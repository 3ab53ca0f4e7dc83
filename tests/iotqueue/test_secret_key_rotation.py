"""SECRET_KEY rotation: former keys are read from SECRET_KEY_FALLBACKS, held to SECRET_KEY's
bar without DEBUG, and keep what they signed valid while a rotation lasts."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import signing
from django.test import override_settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SETTINGS_ENV = ("DEBUG", "SECRET_KEY", "SECRET_KEY_FALLBACKS", "ALLOWED_HOSTS", "DJANGO_SETTINGS_MODULE")
PRINT_FALLBACKS = "import json, iotqueue.settings as s; print(json.dumps(s.SECRET_KEY_FALLBACKS))"


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: importing settings needs no Redis or MQTT broker."""


def settings_import(**env: str) -> subprocess.CompletedProcess:
    base = {name: value for name, value in os.environ.items() if name not in SETTINGS_ENV}
    return subprocess.run(
        [sys.executable, "-c", PRINT_FALLBACKS],
        cwd=PROJECT_ROOT,
        env={**base, "ALLOWED_HOSTS": "example.com", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def a_real_key() -> str:
    return secrets.token_urlsafe(50)


def test_former_keys_are_read_from_the_environment():
    old, older = a_real_key(), a_real_key()

    result = settings_import(SECRET_KEY=a_real_key(), SECRET_KEY_FALLBACKS=f"{old},{older}")

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [old, older]


def test_without_debug_a_weak_former_key_is_refused():
    result = settings_import(SECRET_KEY=a_real_key(), SECRET_KEY_FALLBACKS=f"{a_real_key()},too-short")

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "SECRET_KEY_FALLBACKS, key 2" in result.stderr and "fewer than 50 characters" in result.stderr


def test_what_the_old_key_signed_stays_valid_while_it_is_a_fallback():
    old, new = a_real_key(), a_real_key()
    with override_settings(SECRET_KEY=old):
        signed = signing.dumps({"session": "operator"})

    with override_settings(SECRET_KEY=new, SECRET_KEY_FALLBACKS=[old]):
        assert signing.loads(signed) == {"session": "operator"}
    with override_settings(SECRET_KEY=new, SECRET_KEY_FALLBACKS=[]), pytest.raises(signing.BadSignature):
        signing.loads(signed)
