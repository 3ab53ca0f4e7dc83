"""The schema says what the server does: error answers, run start's alternatives, nullable
and object types, and the rules OpenAPI can state (iotqueue/openapi.py)."""

import pytest
from drf_spectacular.generators import SchemaGenerator


@pytest.fixture(scope="module")
def schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


def responses(schema: dict, path: str, method: str) -> dict:
    return schema["paths"][path][method]["responses"]


def test_every_operation_documents_its_error_answers_with_a_body(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert {"400", "401", "403"} <= codes, (method, path)
            for code, response in operation["responses"].items():
                if code >= "400":
                    assert "application/json" in response["content"], (method, path, code)


def test_error_answers_follow_the_operation(schema):
    assert "404" in responses(schema, "/api/devices/{name}/", "get")
    assert "409" in responses(schema, "/api/devices/{name}/", "delete")  # steps and runs refer to it
    assert "409" not in responses(schema, "/api/schedules/{name}/", "delete")  # nothing refers to one
    assert {"409", "413", "429"} <= set(responses(schema, "/api/templates/", "post"))  # unique name, body
    assert "429" not in responses(schema, "/api/runs/", "get")  # reads are not throttled
    assert {"409", "429"} <= set(responses(schema, "/api/runs/{id}/cancel/", "post"))
    assert "429" in responses(schema, "/api/token/", "post")
    assert {} in schema["paths"]["/api/token/"]["post"]["security"]  # no credentials needed


def test_starting_a_run_answers_a_run_a_list_of_runs_or_a_replay(schema):
    answers = responses(schema, "/api/runs/", "post")
    started = answers["201"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert schema["components"]["schemas"][started]["oneOf"] == [
        {"$ref": "#/components/schemas/Run"},
        {"type": "array", "items": {"$ref": "#/components/schemas/Run"}},
    ]
    assert answers["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Run"}


def test_types_and_rules(schema):
    components = schema["components"]["schemas"]
    assert components["Run"]["properties"]["retry_of"]["nullable"] is True
    assert "retry_of" in components["Run"]["required"]  # always there, null when none
    assert components["RunStartRequest"]["properties"]["parameters"]["type"] == "object"
    assert components["StepRun"]["properties"]["args"]["type"] == "object"
    assert components["JobTemplateRequest"]["properties"]["steps"]["minItems"] == 1
    timings = [ref["$ref"].rsplit("/", 1)[-1] for ref in components["ScheduleRequest"]["oneOf"]]
    assert timings == ["ScheduleByInterval", "ScheduleByCrontab"]
    assert "interval_seconds" in components["ScheduleByInterval"]["required"]
    assert "crontab" in components["ScheduleByCrontab"]["required"]


def test_the_main_operations_have_examples(schema):
    for path in ("/api/runs/", "/api/templates/", "/api/devices/"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body.get("examples"), path
