"""The OpenAPI schema as the server behaves: every operation's error answers with their
bodies (an AutoSchema), and the rules and JSON types the serializers cannot state
themselves (a postprocessing hook), so that clients generated from it need no hand edits.

The AutoSchema overrides drf-spectacular's private `_get_response_bodies`: the import checks
that the installed drf-spectacular is the version this was written for (iotqueue/private_api.py).
"""

from __future__ import annotations

import copy
from typing import Any

from django.conf import settings
from django.db import models
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import serializers
from rest_framework.permissions import SAFE_METHODS

from .private_api import private_api_check

WRITTEN_FOR = ("drf-spectacular", "0.30.0")

private_api_check(
    WRITTEN_FOR, owner=AutoSchema, attributes=("_get_response_bodies",), where="iotqueue/openapi.py"
)

ERROR_COMPONENT = "Error"
VALIDATION_ERROR_COMPONENT = "ValidationError"
CONFLICT_COMPONENT = "Conflict"

ERROR_SCHEMA = {
    "type": "object",
    "description": "Why the request was refused.",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
# A delete refused because other rows still refer to the object also says which
# (iotqueue/api_errors.py); other conflicts carry `detail` alone.
CONFLICT_SCHEMA = {
    "type": "object",
    "description": "Why the request conflicts with the current state; for a delete refused "
    "because other objects refer to this one, the first of them and how many there are.",
    "properties": {
        "detail": {"type": "string"},
        "referenced_by": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "type": {"type": "string"},
                    "id": {"type": "string"},
                    "name": {"type": "string"},
                },
                "required": ["type", "id", "name"],
            },
        },
        "referenced_by_count": {"type": "integer"},
    },
    "required": ["detail"],
}
# DRF's validation errors: messages per field (nested for nested fields, e.g. a template's
# steps by index), `non_field_errors` for the body as a whole, or `detail` for a body, URL
# or query string that could not be read at all.
VALIDATION_ERROR_SCHEMA = {
    "type": "object",
    "description": 'Per field: a list of messages, e.g. {"name": ["This field is required."]}; '
    'nested fields nest. {"detail": "..."} when the body, URL or query string is unreadable.',
    "properties": {
        "detail": {"type": "string"},
        "non_field_errors": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": {},
}

DESCRIPTIONS = {
    "400": "Invalid input: a field's value, a malformed body, or a NUL character in the URL.",
    "401": "No credentials, or an unknown or inactive token.",
    "403": "Signed in, but without the permission this operation needs (or a session without "
    "its CSRF token).",
    "404": "No such object, or no such page of a list.",
    "409": "Conflicts with the current state: the object is still referenced, its name was just "
    "taken, or it is in no state for this action.",
    "413": "The request body is larger than the server accepts.",
    "429": "Too many requests; wait before trying again (see the Retry-After header).",
}


def _unique_model_fields(serializer: Any) -> set[str]:
    """Writable fields of a model serializer that the database keeps unique."""
    if not isinstance(serializer, serializers.ModelSerializer):
        return set()
    unique = {f.name for f in serializer.Meta.model._meta.fields if f.unique and not f.primary_key}
    writable = {name for name, field in serializer.fields.items() if not field.read_only}
    return unique & writable


def _protected(model: type[models.Model] | None) -> bool:
    """Whether deleting a row may be refused because other rows still point at it."""
    if model is None:
        return False
    return any(
        getattr(rel, "on_delete", None) in (models.PROTECT, models.RESTRICT)
        for rel in model._meta.related_objects
    )


class ErrorDocumentingAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema, documenting the error answers each operation can give.

    Which codes apply is read off the view (detail route, throttles, permissions, the
    model's unique fields and protected references); a view may add its own with
    `write_error_responses = {"503": "why"}` for its unsafe methods. A status the view
    already declares keeps its description and gains the error body.
    """

    def get_auth(self) -> list[dict]:
        auths = super().get_auth()
        if not self.view.get_permissions() and {} not in auths:
            auths.append({})  # e.g. the token endpoint: anyone may call it
        return auths

    def _get_response_bodies(self, direction: str = "response") -> dict:
        responses = super()._get_response_bodies(direction)
        for status, description in self._error_statuses().items():
            responses.setdefault(status, {"description": description})
        for status, response in responses.items():
            if status >= "400" and "content" not in response:  # declared by the view: add the body
                response["content"] = self._error_body(status)
        return dict(sorted(responses.items()))

    def _error_statuses(self) -> dict[str, str]:
        writes = self.method not in SAFE_METHODS
        takes_body = self.method in ("POST", "PUT", "PATCH") and self.get_request_serializer() is not None
        statuses = {code: DESCRIPTIONS[code] for code in ("400", "401", "403")}
        if "{" in self.path or self._is_list_view():
            statuses["404"] = DESCRIPTIONS["404"]
        model = getattr(getattr(self.view, "queryset", None), "model", None)
        if (self.method == "DELETE" and _protected(model)) or (
            takes_body and _unique_model_fields(self.get_request_serializer())
        ):
            statuses["409"] = DESCRIPTIONS["409"]
        if takes_body:
            statuses["413"] = DESCRIPTIONS["413"]
        if writes and self.view.get_throttles():
            statuses["429"] = DESCRIPTIONS["429"]
        if writes:
            statuses.update(getattr(self.view, "write_error_responses", {}))
        return statuses

    def _error_body(self, status: str) -> dict:
        name, schema = {
            "400": (VALIDATION_ERROR_COMPONENT, VALIDATION_ERROR_SCHEMA),
            "409": (CONFLICT_COMPONENT, CONFLICT_SCHEMA),
        }.get(status, (ERROR_COMPONENT, ERROR_SCHEMA))
        component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name, schema=schema)
        self.registry.register_on_missing(component)
        return {media_type: {"schema": component.ref} for media_type in self.map_renderers("media_type")}


# JSON fields that hold an object, which the serializers declare as "any JSON": per
# component, property -> schema. Named here rather than by a field class so that the
# serializers' own JSON fields (and their depth limits) stay theirs. A name that no longer
# exists fails schema generation, so this table cannot drift silently.
JSON_OBJECT = {"type": "object", "additionalProperties": {}}
STRING_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# `for_each` on POST /api/runs/: a group's name or a label selector, never empty.
FOR_EACH_SCHEMA = {
    "type": "object",
    "description": 'One run per device: {"group": "pumps"}, {"labels": {"site": "berlin"}} or '
    '{"selector": "site in (berlin,paris),!legacy"}.',
    "properties": {"group": {"type": "string"}, "labels": STRING_LABELS, "selector": {"type": "string"}},
    "additionalProperties": False,
    "minProperties": 1,
}
# A fan-out step's abort criteria (jobs/validation.py abort_criteria_problem checks the same).
ABORT_CRITERIA_SCHEMA = {
    "type": "array",
    "maxItems": 8,
    "description": "Abort the rollout when more than threshold_percent of the devices that ended "
    "(at least min_executed of them) ended with this cause; tested in order as each device ends.",
    "items": {
        "type": "object",
        "required": ["cause", "threshold_percent"],
        "additionalProperties": False,
        "properties": {
            "cause": {"type": "string", "enum": ["failed", "rejected", "timed_out", "any"]},
            "threshold_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "min_executed": {"type": "integer", "minimum": 0, "default": 0},
        },
    },
}
# A step fanning out to the devices of an earlier fan-out step by outcome (jobs/validation.py
# devices_from_problem checks the same; the step's name must be an earlier fan-out's): {} = none.
DEVICES_FROM_SCHEMA = {
    "type": "object",
    "description": "The devices that succeeded or failed in an earlier fan-out step of the run, e.g. "
    '{"step": "flash", "outcome": "succeeded"}; {} for none. "failed" counts failed, rejected, '
    "timed out and canceled devices.",
    "properties": {
        "step": {"type": "string", "minLength": 1, "description": "The name of an earlier fan-out step."},
        "outcome": {"type": "string", "enum": ["succeeded", "failed"]},
    },
    "additionalProperties": False,
    "anyOf": [{"maxProperties": 0}, {"required": ["step", "outcome"]}],
}
# A fan-out step's waves (jobs/validation.py waves_problem checks the same; jobs/engine/waves.py).
WAVES_SCHEMA = {
    "type": "array",
    "description": "The fan-out in ordered waves (at most 20 entries). Each wave is sized by exactly "
    "one of percent, count, rest or by_label (one wave per value of that label; rest and by_label "
    "only last); devices no wave takes form a last wave. When a wave's devices all ended its "
    "condition is checked "
    "(min_succeeded_percent, max_failed_percent); failing, the rollout pauses (on_fail: abort aborts "
    "it); passing, it soaks soak_seconds, then its gate opens the next wave: auto, approval (an "
    "operator approves: POST /api/runs/{id}/rollout/approve/) or webhook (webhook_url is POSTed; "
    'a 2xx answer of {"approve": true} goes on, anything else pauses).',
    "items": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "percent": {"type": "integer", "minimum": 1, "maximum": 100},
            "count": {"type": "integer", "minimum": 1},
            "rest": {"type": "boolean", "enum": [True]},
            "by_label": {"type": "string"},
            "min_succeeded_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "max_failed_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "on_fail": {"type": "string", "enum": ["pause", "abort"], "default": "pause"},
            "soak_seconds": {"type": "integer", "minimum": 0, "maximum": 604800},
            "gate": {"type": "string", "enum": ["auto", "approval", "webhook"], "default": "auto"},
            "webhook_url": {"type": "string", "format": "uri", "maxLength": 2000},
        },
    },
}
STEP_JSON = {
    "args": JSON_OBJECT,
    "labels": STRING_LABELS,
    "compensation_args": JSON_OBJECT,
    "abort_criteria": ABORT_CRITERIA_SCHEMA,
    "devices_from": DEVICES_FROM_SCHEMA,
    "waves": WAVES_SCHEMA,
}

# A time of day as Django's TimeField reads and writes it ("08:00", "21:00:00"), with no
# offset: JSON Schema's "time" format requires one, which the field neither sends nor takes.
LOCAL_TIME = {
    "type": "string",
    "pattern": r"^([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?$",
    "nullable": True,
}
DEVICE_JSON = {
    "labels": STRING_LABELS,
    "config": JSON_OBJECT,
    "quiet_hours_start": LOCAL_TIME,
    "quiet_hours_end": LOCAL_TIME,
}

JSON_OBJECT_PROPERTIES = {
    "RunStartRequest": {"parameters": JSON_OBJECT, "for_each": FOR_EACH_SCHEMA},
    "Run": {"parameters": JSON_OBJECT},
    "RunDetail": {"parameters": JSON_OBJECT},
    "StepRun": {"args": JSON_OBJECT},
    "RunEvent": {"data": JSON_OBJECT},
    "JobStep": STEP_JSON,
    "JobStepRequest": STEP_JSON,
    "Device": DEVICE_JSON,
    "DeviceRequest": DEVICE_JSON,
    "PatchedDeviceRequest": DEVICE_JSON,
    "Schedule": {"parameters": JSON_OBJECT},
    "ScheduleRequest": {"parameters": JSON_OBJECT},
    "PatchedScheduleRequest": {"parameters": JSON_OBJECT},
    "TriggerRule": {"parameters": JSON_OBJECT},
    "TriggerRuleRequest": {"parameters": JSON_OBJECT},
    "PatchedTriggerRuleRequest": {"parameters": JSON_OBJECT},
}

# A schedule fires on an interval or on a crontab, never both (triggers/validation.py): the
# request body is one of two shapes, each the schedule's fields plus its timing rule.
SCHEDULE_TIMINGS = {
    "ScheduleByInterval": {
        "required": ["interval_seconds"],
        "properties": {
            "interval_seconds": {"type": "integer", "minimum": 1},
            "crontab": {"type": "string", "pattern": r"^\s*$", "nullable": True},
        },
    },
    "ScheduleByCrontab": {
        "required": ["crontab"],
        "properties": {
            "crontab": {"type": "string", "pattern": r"\S", "maxLength": 200},
            "interval_seconds": {"type": "integer", "nullable": True, "enum": [None]},
        },
    },
}


def _component(schema: dict, name: str) -> dict:
    try:
        return schema["components"]["schemas"][name]
    except KeyError:
        raise KeyError(f"iotqueue.openapi: no schema component {name!r} to refine") from None


def _property(component: dict, component_name: str, name: str) -> dict:
    if name not in component.get("properties", {}):
        raise KeyError(f"iotqueue.openapi: component {component_name!r} has no property {name!r}")
    return component["properties"][name]


def schema_refine(result: dict, generator: SchemaGenerator, request: Any, public: bool) -> dict:
    """Postprocessing hook: JSON object types and the rules OpenAPI can state."""
    for component_name, properties in JSON_OBJECT_PROPERTIES.items():
        component = _component(result, component_name)
        for name, typed in properties.items():
            prop = _property(component, component_name, name)
            kept = {k: v for k, v in prop.items() if k in ("description", "readOnly", "writeOnly")}
            component["properties"][name] = {**typed, **kept}
    max_steps = getattr(settings, "IOTQUEUE_TEMPLATE_MAX_STEPS", None)
    for name in ("JobTemplateRequest", "PatchedJobTemplateRequest"):
        steps = _property(_component(result, name), name, "steps")
        steps["minItems"] = 1
        if max_steps:
            steps["maxItems"] = max_steps
    _schedule_timing_split(result)
    _response_fields_required(result)
    return result


def _refs(node: Any) -> set[str]:
    """Names of the components a schema fragment refers to, directly."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


def _response_fields_required(result: dict) -> None:
    """Every field of an answer is always there (a serializer writes all its fields, null
    when empty), so response components require them all; generated clients then read
    `run.status` as a status, not as "maybe unset". Error bodies keep their optional keys."""
    schemas = result["components"]["schemas"]
    pending = set()
    for operations in result["paths"].values():
        for operation in operations.values():
            if isinstance(operation, dict):
                pending |= _refs(operation.get("responses", {}))
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending |= _refs(schemas[name]) - seen
    for name in seen - {ERROR_COMPONENT, VALIDATION_ERROR_COMPONENT, CONFLICT_COMPONENT}:
        properties = schemas[name].get("properties", {})
        if properties:
            schemas[name]["required"] = sorted(p for p, s in properties.items() if not s.get("writeOnly"))


def _schedule_timing_split(result: dict) -> None:
    """ScheduleRequest becomes oneOf its two timings, each the schedule's fields with the
    timing's rule written in (not allOf: generators cannot merge a nullable field with its
    non-null restriction)."""
    schemas = result["components"]["schemas"]
    fields = _component(result, "ScheduleRequest")
    for name, rule in SCHEDULE_TIMINGS.items():
        timing = copy.deepcopy(fields)
        for prop, restriction in rule["properties"].items():
            kept = {k: v for k, v in timing["properties"][prop].items() if k == "description"}
            timing["properties"][prop] = {**restriction, **kept}
        timing["required"] = sorted({*timing.get("required", []), *rule["required"]})
        schemas[name] = timing
    schemas["ScheduleRequest"] = {
        "oneOf": [{"$ref": f"#/components/schemas/{name}"} for name in SCHEDULE_TIMINGS]
    }
