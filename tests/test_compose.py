"""docker-compose.yml and the Dockerfile: every service exists, shares one app definition, and
runs a command that exists in this project (Docker itself is not needed to check that)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from celery import Celery
from celery.app.utils import find_app
from django.conf import settings
from django.core.management import get_commands

BASE_DIR = Path(__file__).resolve().parent.parent
COMPOSE_FILE = BASE_DIR / "docker-compose.yml"
DOCKERFILE = BASE_DIR / "Dockerfile"
INFRA_SERVICES = ("postgres", "redis", "mosquitto")
APP_SERVICES = ("migrate", "web", "worker", "beat", "bridge", "simulator")
CELERY_SUBCOMMANDS = ("worker", "beat")
# The shared app environment's URL variables and the compose service each must name.
URL_HOSTS = {"DATABASE_URL": "postgres", "REDIS_URL": "redis", "MQTT_URL": "mosquitto"}


def compose_load() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def command_argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: reading files needs no Redis or MQTT broker."""


def test_every_expected_service_is_defined():
    # given the compose file
    services = compose_load()["services"]

    # then the infrastructure and every iotqueue process are services
    missing = set(INFRA_SERVICES + APP_SERVICES) - set(services)
    assert not missing, f"services missing from docker-compose.yml: {sorted(missing)}"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_service_uses_the_shared_anchor(name):
    # given the shared definition x-app and an app service
    data = compose_load()
    app, service = data["x-app"], data["services"][name]

    # then the service was merged from that very node (`<<: *app`): PyYAML constructs an
    # anchored node once, so a copy-pasted block would be equal but not the same object
    assert service["build"] == app["build"] and service["image"] == app["image"]
    assert service["environment"] is app["environment"], f"{name} does not use <<: *app"


def test_app_environment_points_at_the_compose_services():
    # given the shared app environment and the infrastructure services
    data = compose_load()
    env, services = data["x-app"]["environment"], data["services"]

    # then each URL names a compose service, and the database URL matches postgres' own settings
    for variable, service in URL_HOSTS.items():
        assert urlparse(env[variable]).hostname == service, variable
    database = urlparse(env["DATABASE_URL"])
    postgres = services["postgres"]["environment"]
    assert database.scheme in ("postgres", "postgresql")
    assert (database.username, database.password, database.path.lstrip("/")) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    assert urlparse(env["MQTT_URL"]).scheme == "mqtt"
    assert env["MQTT_SHARED_GROUP"], "bridges can only be scaled with a shared subscription group"
    assert str(env["DEBUG"]).lower() == "false"
    assert env["SECRET_KEY"] and env["ALLOWED_HOSTS"]


def test_app_services_start_after_migrations():
    # given the services
    services = compose_load()["services"]

    # then migrate waits for a healthy database and every other app service waits for migrate
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert command_argv(services["migrate"])[:3] == ["python", "manage.py", "migrate"]
    for name in APP_SERVICES:
        if name != "migrate":
            condition = services[name]["depends_on"]["migrate"]["condition"]
            assert condition == "service_completed_successfully", name


def test_postgres_and_redis_have_healthchecks():
    services = compose_load()["services"]
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"], name


def test_only_the_simulator_is_opt_in():
    services = compose_load()["services"]
    assert services["simulator"]["profiles"] == ["sim"]
    assert [name for name, service in services.items() if "profiles" in service] == ["simulator"]


def test_mosquitto_config_exists_and_allows_the_app_to_connect():
    # given the volume that mounts the broker's configuration
    mosquitto = compose_load()["services"]["mosquitto"]
    mounts = [volume.split(":") for volume in mosquitto["volumes"]]
    source = next(src for src, target, *_ in mounts if target == "/mosquitto/config/mosquitto.conf")

    # then the file exists and opens the listener the app's MQTT_URL uses
    config = (BASE_DIR / source).read_text()
    assert re.search(r"^listener 1883\s*$", config, re.MULTILINE)
    assert re.search(r"^allow_anonymous true\s*$", config, re.MULTILINE)


def _manage_command_check(argv: list[str]) -> None:
    assert argv[1] == "manage.py" and len(argv) > 2, argv
    assert argv[2] in get_commands(), f"no management command {argv[2]!r}"


def _celery_check(argv: list[str]) -> None:
    assert argv[1:3] in (["-A", "iotqueue"], ["--app", "iotqueue"]), argv
    # find_app is how the celery CLI resolves -A.
    assert isinstance(find_app(argv[2]), Celery)
    assert argv[3] in CELERY_SUBCOMMANDS, f"unexpected celery subcommand {argv[3]!r}"


def _gunicorn_check(argv: list[str]) -> None:
    target = next(arg for arg in argv[1:] if ":" in arg and not arg.startswith("-"))
    module_name, _, attribute = target.partition(":")
    application = getattr(importlib.import_module(module_name), attribute)
    assert callable(application), target
    assert module_name + "." + attribute == settings.WSGI_APPLICATION


CHECKS = {"python": _manage_command_check, "celery": _celery_check, "gunicorn": _gunicorn_check}


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_command_exists_in_the_project(name):
    # given an app service's command
    argv = command_argv(compose_load()["services"][name])

    # then its program is one we know, and what it names (command, Celery app, WSGI module) exists
    assert argv[0] in CHECKS, f"{name}: unexpected program {argv[0]!r}"
    CHECKS[argv[0]](argv)


def test_worker_and_beat_each_run_once_as_a_service():
    commands = [
        command_argv(service) for service in compose_load()["services"].values() if "command" in service
    ]
    subcommands = [argv[3] for argv in commands if argv[0] == "celery"]
    assert sorted(subcommands) == ["beat", "worker"]
    assert settings.CELERY_BEAT_SCHEDULER == "django_celery_beat.schedulers:DatabaseScheduler"


def test_dockerfile_installs_requirements_and_runs_as_non_root():
    # given the Dockerfile's instructions
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]

    # then it builds on python:3.11-slim, installs requirements.txt and drops root
    assert instructions[0] == "FROM python:3.11-slim"
    copy_at = next(i for i, line in enumerate(instructions) if re.match(r"COPY .*requirements\.txt", line))
    install_at = next(
        i for i, line in enumerate(instructions) if re.match(r"RUN pip install .*-r requirements\.txt", line)
    )
    assert copy_at < install_at
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_dockerfile_copies_every_project_app():
    # given the project's own packages (apps with a directory here) and manage.py
    local = [app for app in settings.INSTALLED_APPS if (BASE_DIR / app.split(".")[0]).is_dir()]
    copied = {
        line.split()[1].rstrip("/")
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("COPY ")
    }

    # then the image contains each of them
    assert {"iotqueue", "devices", "jobs"} <= set(local)
    missing = {app.split(".")[0] for app in local} - copied - {"."}
    assert not missing, f"Dockerfile does not COPY {sorted(missing)}"
    assert "manage.py" in copied or "." in copied


def test_the_image_collects_static_files_for_whitenoise():
    # given the Dockerfile and the middleware list
    dockerfile = DOCKERFILE.read_text()

    # then static files are collected at build time and served by WhiteNoise
    assert re.search(r"^RUN python manage.py collectstatic --noinput", dockerfile, re.MULTILINE)
    assert "whitenoise.middleware.WhiteNoiseMiddleware" in settings.MIDDLEWARE
