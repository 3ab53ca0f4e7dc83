"""OpenAPI documentation of the jobs endpoints that the serializers cannot give: what
starting a run answers (a run, a list of runs, or a replay) and examples to start from."""

from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)

from .serializers import RunPreviewSerializer, RunSerializer, RunStartSerializer

RUN_STARTED = PolymorphicProxySerializer(
    component_name="RunStarted",
    serializers=[RunSerializer, RunSerializer(many=True)],
    # Told apart by shape (an object or an array), not by a field.
    resource_type_field_name=None,
    many=False,
)

run_start_schema = extend_schema(
    request=RunStartSerializer,
    responses={
        201: OpenApiResponse(
            RUN_STARTED, description="Started: the run, or with `for_each` a list of runs, one per device."
        ),
        200: OpenApiResponse(
            RunSerializer,
            description="A replay: a run with this `idempotency_key` exists already; it is returned "
            "as it stands and nothing new starts.",
        ),
        400: OpenApiResponse(
            description="Invalid input, nothing started. Among others `parameters` lacking a name the "
            'template\'s steps read: `{"parameters": ["missing parameter: level (the template\'s '
            'steps read it as {{ params.level }})"]}`.'
        ),
    },
    examples=[
        OpenApiExample(
            "Start a run",
            value={"template": "provision-db", "parameters": {"cpu": 4}, "idempotency_key": "provision-7"},
            request_only=True,
        ),
        OpenApiExample(
            "One run per device in a group",
            value={
                "template": "firmware-update",
                "parameters": {"version": "2.1"},
                "for_each": {"group": "pumps"},
            },
            request_only=True,
        ),
    ],
)

run_preview_schema = extend_schema(
    request=RunStartSerializer,
    responses={
        200: RunPreviewSerializer,
        400: OpenApiResponse(description="Invalid input: the same answers as starting the run."),
    },
    examples=[
        OpenApiExample(
            "Preview a run",
            value={"template": "firmware-rollout", "parameters": {"version": "2.1"}},
            request_only=True,
        ),
    ],
)

template_create_schema = extend_schema(
    examples=[
        OpenApiExample(
            "Create a template",
            value={
                "name": "provision-db",
                "description": "Check the host's resources, then install MySQL.",
                "steps": [
                    {
                        "position": 0,
                        "name": "check",
                        "device": "db-host-1",
                        "action": "resource/check",
                        "args": {"cpu": "{{ params.cpu }}"},
                        "timeout_seconds": 300,
                    },
                    {
                        "position": 1,
                        "device": "db-host-1",
                        "action": "mysql/install",
                        "args": {"version": "8.4"},
                        "max_attempts": 3,
                    },
                ],
            },
            request_only=True,
        )
    ]
)
