"""Settings fail closed: without DEBUG, no process starts on a missing or published secret key,
or without ALLOWED_HOSTS; the HTTPS settings default to secure. Each case imports the settings
in a fresh interpreter, as a starting web, worker, beat or bridge process does."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Names the test settings or a developer's shell may have set; each case sets its own.
SETTINGS_ENV = ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "DJANGO_SETTINGS_MODULE")
PRINT_SECURITY = (
    "import json, iotqueue.settings as s; print(json.dumps({name: getattr(s, name) for name in "
    "('DEBUG', 'SECURE_SSL_REDIRECT', 'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', "
    "'SECURE_HSTS_SECONDS', 'SECURE_PROXY_SSL_HEADER')}))"
)


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: importing settings needs no Redis or MQTT broker."""


def settings_import(**env: str) -> subprocess.CompletedProcess:
    base = {name: value for name, value in os.environ.items() if name not in SETTINGS_ENV}
    return subprocess.run(
        [sys.executable, "-c", PRINT_SECURITY],
        cwd=PROJECT_ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def a_real_key() -> str:
    return secrets.token_urlsafe(50)


@pytest.mark.parametrize(
    ("env", "refusal"),
    [
        ({"ALLOWED_HOSTS": "example.com"}, "SECRET_KEY is not set"),
        (
            {"SECRET_KEY": "dev-only-insecure-key-change-me", "ALLOWED_HOSTS": "example.com"},
            "published development key",
        ),
        ({"SECRET_KEY": "django-insecure-" + a_real_key(), "ALLOWED_HOSTS": "example.com"}, "published"),
        ({"SECRET_KEY": "too-short", "ALLOWED_HOSTS": "example.com"}, "fewer than 50 characters"),
        ({"SECRET_KEY": "ab" * 40, "ALLOWED_HOSTS": "example.com"}, "distinct characters"),
        ({"SECRET_KEY": a_real_key()}, "ALLOWED_HOSTS is not set"),
        ({"DEBUG": "true", "IOTQUEUE_PREEMPT_PRIORITY": "high"}, "IOTQUEUE_PREEMPT_PRIORITY must be"),
        ({"DEBUG": "true", "IOTQUEUE_PREEMPT_PRIORITY": "10"}, "IOTQUEUE_PREEMPT_PRIORITY must be"),
    ],
)
def test_without_debug_settings_refuse_to_load(env, refusal):
    # given no DEBUG and a missing or weak secret, or no hosts
    # when a process loads the settings
    result = settings_import(**env)

    # then it stops with ImproperlyConfigured, saying what is wrong
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and refusal in result.stderr, result.stderr


def test_without_debug_a_real_key_and_hosts_load_with_secure_defaults():
    # given a real key and hosts, DEBUG unset
    result = settings_import(SECRET_KEY=a_real_key(), ALLOWED_HOSTS="example.com")

    # then the settings load, in production mode, with HTTPS-only defaults
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert loaded["DEBUG"] is False
    assert loaded["SECURE_SSL_REDIRECT"] and loaded["SESSION_COOKIE_SECURE"] and loaded["CSRF_COOKIE_SECURE"]
    assert loaded["SECURE_HSTS_SECONDS"] >= 365 * 24 * 3600
    assert loaded["SECURE_PROXY_SSL_HEADER"] is None


def test_the_proxy_header_comes_from_the_environment():
    result = settings_import(
        SECRET_KEY=a_real_key(),
        ALLOWED_HOSTS="example.com",
        SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


def test_debug_runs_on_development_defaults():
    # given DEBUG=true and nothing else, as the dev stack and the test suite run
    result = settings_import(DEBUG="true")

    # then the settings load without a secret key or hosts, and without HTTPS-only cookies
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert (
        loaded["DEBUG"] is True and not loaded["SESSION_COOKIE_SECURE"] and not loaded["SECURE_SSL_REDIRECT"]
    )


# Any attempt to create a directory or open a file for writing fails, as on a read-only root.
READ_ONLY_IMPORT = (
    "import builtins, os, pathlib\n"
    "def refuse(*args, **kwargs):\n"
    "    raise OSError(30, 'Read-only file system')\n"
    "real_open = builtins.open\n"
    "def open_read_only(file, mode='r', *args, **kwargs):\n"
    "    if any(flag in mode for flag in 'wax+'):\n"
    "        refuse()\n"
    "    return real_open(file, mode, *args, **kwargs)\n"
    "os.mkdir = os.makedirs = pathlib.Path.mkdir = pathlib.Path.touch = refuse\n"
    "builtins.open = open_read_only\n"
    "import iotqueue.settings as s\n"
    "print(s.ADMINS)\n"
)


def test_settings_import_on_a_read_only_file_system():
    # given a file system on which nothing may be created, and admins in both accepted forms
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS_ENV}
    env.update(DEBUG="true", ADMINS="Ops:ops@example.com, oncall@example.com")

    # when a process imports the settings
    result = subprocess.run(
        [sys.executable, "-c", READ_ONLY_IMPORT],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    # then they load, and ADMINS holds plain addresses (Django 6 drops the tuple form)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['ops@example.com', 'oncall@example.com']"


def test_a_command_without_a_secret_key_fails_in_one_line():
    # given DEBUG off and no SECRET_KEY, as a misconfigured production process starts
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS_ENV}
    env["ALLOWED_HOSTS"] = "example.com"

    # when a management command starts
    result = subprocess.run(
        [sys.executable, "manage.py", "bridge"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    # then it exits 1 with one line naming what to set, and no traceback
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("manage.py: SECRET_KEY is not set")
