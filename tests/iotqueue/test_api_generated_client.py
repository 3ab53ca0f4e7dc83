"""A client generated from /api/schema/ (openapi-python-client, no hand edits) starts a run
on a live server and reads its status: the schema is good enough to program against."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from devtools.simulator import DeviceBehaviour
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

GENERATOR = Path(sys.executable).with_name("openapi-python-client")
PACKAGE = "iotqueue_client"
# No formatting hooks: the generated code is used as generated, not tidied. Form and
# multipart bodies are left out of the client: openapi-python-client 0.29.1 writes
# `body: X | X | X | Unset` without importing Unset for a required body offered in several
# content types (its issue #1451), so a client of this API speaks JSON, which the schema
# offers first for every body.
GENERATOR_CONFIG = """\
post_hooks: []
content_type_overrides:
  application/x-www-form-urlencoded: text/x-not-generated
  multipart/form-data: text/x-not-generated
"""


def client_generate(schema_url: str, into: Path):
    """Generate the client package from the served schema into `into` and import it."""
    config = into / "generator.yaml"
    config.write_text(GENERATOR_CONFIG)
    argv = [str(GENERATOR), "generate", "--url", schema_url, "--meta", "none", "--config", str(config)]
    generated = subprocess.run(
        [*argv, "--output-path", str(into / PACKAGE)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Any warning but the form bodies set aside above is a flaw of the schema.
    lines = [line for line in generated.stdout.splitlines() if line.strip()]
    problems = [
        lines[i + 1] if line.startswith(("WARNING parsing", "ERROR parsing")) else line
        for i, line in enumerate(lines)
        if line.startswith(("WARNING parsing", "ERROR parsing", "Unable to process"))
    ]
    assert set(problems) <= {"Unsupported content type text/x-not-generated"}, generated.stdout
    sys.path.insert(0, str(into))
    try:
        return importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(into))


@pytest.fixture
def generated(live_server, tmp_path):
    package = client_generate(f"{live_server.url}/api/schema/?format=json", tmp_path)
    yield package
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def test_a_generated_client_starts_a_run_and_reads_its_status(live_server, stack, simulator, generated):
    # given a device that completes its step, and a token for the generated client
    lamp = DeviceFactory()
    simulator({lamp.name: DeviceBehaviour()})
    template = template_with_steps((lamp, "on", {"level": "{{ params.level }}"}))
    user = User.objects.create_superuser("client", "client@example.com", "pw")
    client = generated.AuthenticatedClient(
        base_url=live_server.url,
        token=Token.objects.create(user=user).key,
        prefix="Token",
        raise_on_unexpected_status=True,
    )
    runs_create = importlib.import_module(f"{PACKAGE}.api.runs.runs_create")
    runs_retrieve = importlib.import_module(f"{PACKAGE}.api.runs.runs_retrieve")
    models = importlib.import_module(f"{PACKAGE}.models")

    # when it starts a run through the generated API
    body = models.RunStartRequest(
        template=template.name, parameters=models.RunStartRequestParameters.from_dict({"level": 80})
    )
    started = runs_create.sync(client=client, body=body)

    # then it gets a typed Run back, and reads the run's status until the run succeeded
    assert isinstance(started, models.Run), started
    assert started.template == template.name and started.retry_of is None

    def finished():
        run = runs_retrieve.sync(id=started.id, client=client)
        assert isinstance(run, models.RunDetail), run
        return run if run.status in {models.RunStatusEnum.SUCCEEDED, models.RunStatusEnum.FAILED} else None

    run = wait_for(finished, what="the run to finish, read through the generated client")
    assert run.status == models.RunStatusEnum.SUCCEEDED, run.error
    assert run.parameters.to_dict() == {"level": 80}
    assert [step.status for step in run.steps] == [models.StepStatusEnum.SUCCEEDED]
