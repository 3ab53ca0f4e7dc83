"""REST endpoints for runs: start one (the trigger) and read where it stands."""

from dataclasses import asdict
from datetime import UTC, datetime

from django.db.models import Prefetch
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.translation import gettext as _
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.serializers import CharField, IntegerField
from rest_framework.views import APIView

from devices.models import Device
from iotqueue.names import URL_NAME_LOOKUP_REGEX
from iotqueue.pagination import Pagination

from .api_docs import run_preview_schema, run_start_schema, template_create_schema
from .cancel import canvas_cancel, lock_force_release, run_cancel
from .engine.continuous import fanout_close, plan_step_index
from .models import ConcurrencyLimit, JobRun, JobTemplate, MaintenanceWindow, RunStatus, StepRun
from .preview import run_preview
from .retry import RetryError, run_retry
from .rollouts import RolloutConflict, RolloutNotFound, rollout_act
from .serializers import (
    ConcurrencyLimitSerializer,
    DeviceLockSerializer,
    FanoutCloseSerializer,
    MaintenanceWindowSerializer,
    RolloutActionSerializer,
    RolloutSerializer,
    RunDetailSerializer,
    RunEventSerializer,
    RunPreviewSerializer,
    RunSerializer,
    RunStartSerializer,
)
from .services import RunStartError, run_start, run_start_each
from .template_serializers import STEPS_PREFETCH, JobTemplateSerializer, TemplateVersionSerializer
from .waiting import devices_work


def runs_filter(queryset, params):
    """?status=running&status=queued  ?template=NAME  ?device=NAME  ?since=ISO  ?until=ISO"""
    statuses = params.getlist("status")
    unknown = set(statuses) - set(RunStatus.values)
    if unknown:
        raise ValidationError(
            {
                "status": [
                    _("unknown status %(unknown)s; one of %(statuses)s")
                    % {"unknown": sorted(unknown), "statuses": RunStatus.values}
                ]
            }
        )
    if statuses:
        queryset = queryset.filter(status__in=statuses)
    if params.get("template"):
        queryset = queryset.filter(template__name=params["template"])
    if params.get("device"):
        queryset = queryset.filter(step_runs__device__name=params["device"]).distinct()
    for name, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
        if params.get(name):
            queryset = queryset.filter(**{lookup: _datetime_param(name, params[name])})
    return queryset


RUN_LIST_PARAMETERS = [
    OpenApiParameter("status", str, many=True, enum=RunStatus.values, description="Repeat for several."),
    OpenApiParameter("template", str, description="Template name."),
    OpenApiParameter("device", str, description="Runs with a step on this device (by name)."),
    OpenApiParameter("since", OpenApiTypes.DATETIME, description="Created at or after (ISO 8601)."),
    OpenApiParameter("until", OpenApiTypes.DATETIME, description="Created before (ISO 8601)."),
]


def _datetime_param(name: str, value: str) -> datetime:
    """An ISO 8601 date-time as UTC; 400 for a malformed one or an offset no database takes."""
    problem = [_("use an ISO 8601 date-time, e.g. 2026-11-22T02:00:00Z")]
    try:
        when = parse_datetime(value)
        if when is not None:
            # Naive means UTC; an offset is converted away (PostgreSQL refuses beyond ±15:59).
            when = when.astimezone(UTC) if timezone.is_aware(when) else when.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ValidationError({name: problem}) from None
    if when is None:
        raise ValidationError({name: problem})
    return when


# Actions on one run (POST /api/runs/<id>/<action>/); they check their own permission.
RUN_ACTIONS = ("cancel", "retry", "fanout_close", "rollout")
RUN_VIEW_PERMISSION = "jobs.view_jobrun"
ROLLOUT_ACTIONS = ("pause", "resume", "approve", "abort")


@extend_schema_view(list=extend_schema(parameters=RUN_LIST_PARAMETERS))
class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """`POST /api/runs/` starts a run; `GET /api/runs/<id>/` shows its steps and timeline."""

    queryset = JobRun.objects.select_related("template", "template_version").prefetch_related(
        Prefetch(
            "step_runs", queryset=StepRun.objects.select_related("device").order_by("index", "device__name")
        )
    )

    def get_serializer_class(self):
        if self.action in ("create", "preview"):
            return RunStartSerializer
        if self.action == "retrieve":
            return RunDetailSerializer
        return RunSerializer

    def get_queryset(self):
        queryset = super().get_queryset()
        if self.action == "list":
            queryset = runs_filter(queryset, self.request.query_params)
        if self.action in RUN_ACTIONS and not self.request.user.has_perm(RUN_VIEW_PERMISSION):
            # No existence oracle: to a user who may not see runs, every run is unknown (the
            # same 404 as for an id that never existed). Who may see runs gets a 403 when
            # they may not act.
            queryset = queryset.none()
        return queryset

    @run_start_schema
    def create(self, request, *args, **kwargs):
        serializer = RunStartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        options = dict(serializer.validated_data, trigger="rest", triggered_by=request.user.username)
        options["version"] = options.pop("template_version", None)
        for_each = options.pop("for_each", None)
        try:
            if for_each:
                runs = run_start_each(
                    **options,
                    group=for_each.get("group", ""),
                    labels=for_each.get("labels"),
                    selector=for_each.get("selector", ""),
                )
                body = RunSerializer(runs, many=True, context={"request": request}).data
                return Response(body, status=status.HTTP_201_CREATED)
            run, created = run_start(**options)
        except RunStartError as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        body = RunSerializer(run, context={"request": request}).data
        return Response(body, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @run_preview_schema
    @action(detail=False, methods=["post"])
    def preview(self, request):
        """What `POST /api/runs/` with this body would do, without starting or writing anything:
        per step the devices it targets, how many are online, their queues, the limits and
        an estimated finish. Validated as a start is (the same 400s); needs add_jobrun."""
        serializer = RunStartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        options = dict(serializer.validated_data)
        options["version"] = options.pop("template_version", None)
        try:
            preview = run_preview(**options)
        except RunStartError as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        return Response(RunPreviewSerializer(preview).data)

    @extend_schema(
        request=None,
        responses={200: RunSerializer, 409: OpenApiResponse(description="The run has already ended.")},
    )
    @action(detail=True, methods=["post"], permission_classes=[IsAuthenticated])
    def cancel(self, request, pk=None):
        """Cancel a pending or running run (409 when it has already ended)."""
        run = self.get_object()
        if not request.user.has_perm("jobs.change_jobrun"):
            self.permission_denied(request, message=_("You may not cancel runs."))
        if not run_cancel(run=run, by=request.user.username):
            return Response(
                {"detail": _("run is already %(status)s") % {"status": run.status}},
                status=status.HTTP_409_CONFLICT,
            )
        run.refresh_from_db()
        return Response(RunSerializer(run, context={"request": request}).data)

    @extend_schema(
        request=FanoutCloseSerializer,
        responses={
            200: RunDetailSerializer,
            400: OpenApiResponse(description="`step` names no fan-out step of the run."),
            409: OpenApiResponse(description="The run has no open continuous fan-out (at that step)."),
        },
    )
    @action(detail=True, methods=["post"], url_path="fanout/close", permission_classes=[IsAuthenticated])
    def fanout_close(self, request, pk=None):
        """Close the run's open continuous fan-out (or the one at `step`): no device joins it
        any more, and once its rows have ended its success criterion decides the step. The
        timeline records who closed it. 409 when none is open; needs change_jobrun."""
        run = self.get_object()
        if not request.user.has_perm("jobs.change_jobrun"):
            self.permission_denied(request, message=_("You may not close fan-outs."))
        serializer = FanoutCloseSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        index = None
        if serializer.validated_data.get("step"):
            index = plan_step_index(run.plan, serializer.validated_data["step"])
            if index is None:
                raise ValidationError({"step": [_("The run has no such step.")]})
        if fanout_close(run=run, index=index, by=request.user.username) is None:
            return Response(
                {"detail": _("The run has no open continuous fan-out.")}, status=status.HTTP_409_CONFLICT
            )
        run = self.get_queryset().get(pk=run.pk)
        return Response(RunDetailSerializer(run, context={"request": request}).data)

    @extend_schema(
        request=RolloutActionSerializer,
        parameters=[
            OpenApiParameter(
                "verb",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                enum=list(ROLLOUT_ACTIONS),
                description="pause (no more devices start), resume (a paused rollout goes on), "
                "approve (open the next wave at an approval or webhook gate, or after a soak), "
                "abort (skip the devices not started, fail the step).",
            )
        ],
        responses={
            200: RolloutSerializer,
            400: OpenApiResponse(description="No fan-out in waves at that step (field: step)."),
            409: OpenApiResponse(description="The action does not apply to the rollout's state."),
        },
    )
    @action(
        detail=True,
        methods=["post"],
        permission_classes=[IsAuthenticated],
        url_path=r"rollout/(?P<verb>pause|resume|approve|abort)",
        url_name="rollout",
    )
    def rollout(self, request, pk=None, verb=None):
        """Steer the run's fan-out in waves: pause, resume, approve the next wave or abort.

        Body (optional): `step`, the fan-out's index (default: the run's latest fan-out in
        waves), and `reason`, kept in the timeline with who decided. Needs change_jobrun.
        """
        run = self.get_object()
        if not request.user.has_perm("jobs.change_jobrun"):
            self.permission_denied(request, message=_("You may not steer rollouts."))
        body = RolloutActionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            rollout = rollout_act(
                run=run,
                action=verb,
                by=request.user.username,
                reason=body.validated_data.get("reason", ""),
                step=body.validated_data.get("step"),
            )
        except RolloutNotFound as exc:
            raise ValidationError({"step": [str(exc)]}) from None
        except RolloutConflict as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(RolloutSerializer(rollout).data)

    @extend_schema(responses=RunEventSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=Pagination)
    def events(self, request, pk=None):
        """The run's whole timeline, oldest first, paged (`?page=`, `?page_size=`)."""
        run = self.get_object()
        page = self.paginate_queryset(run.events.order_by("id"))
        return self.get_paginated_response(RunEventSerializer(page, many=True).data)

    @extend_schema(
        request=None,
        responses={201: RunSerializer, 409: OpenApiResponse(description="The run is not retryable.")},
    )
    @action(detail=True, methods=["post"], permission_classes=[IsAuthenticated])
    def retry(self, request, pk=None):
        """Start a new run from the step this failed, timed-out or canceled run stopped on.

        The steps before it are carried over with their results (not re-sent); a fan-out
        step re-runs only its devices that did not succeed. 409 when the run is not
        retryable (active, succeeded, rolled back, or already retried).
        """
        run = self.get_object()
        if not request.user.has_perm("jobs.add_jobrun"):
            self.permission_denied(request, message=_("You may not start runs."))
        try:
            retry = run_retry(run=run, by=request.user.username, trigger="rest")
        except RetryError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(
            RunSerializer(retry, context={"request": request}).data, status=status.HTTP_201_CREATED
        )


LOCK_RELEASE_RESPONSE = inline_serializer(
    "LockRelease",
    {"device": CharField(), "released_from": CharField(allow_null=True, help_text="null: it was free")},
)


class DeviceLockView(APIView):
    """`GET /api/devices/<name>/lock/`: the lock's holder, fence and queue, and the runs and
    steps behind them (a bare `step:149` names no run). Needs the *view device* permission.

    Lives here, not in devices/api.py, for the reason DeviceLockReleaseView does: step rows
    are jobs business, and devices never imports jobs.
    """

    permission_classes = [IsAuthenticated]

    @extend_schema(responses={200: DeviceLockSerializer})
    def get(self, request, name: str):
        if not request.user.has_perm("devices.view_device"):
            self.permission_denied(request, message=_("You may not view devices."))
        device = get_object_or_404(Device, name=name)
        work = devices_work([device.name])[device.name]
        return Response(
            DeviceLockSerializer(
                {
                    **asdict(work.lock),
                    "holder_step": asdict(work.holder) if work.holder else None,
                    "waiting": [asdict(ref) for ref in work.queued],
                }
            ).data
        )


class DeviceLockReleaseView(APIView):
    """`POST /api/devices/<name>/lock/release/`: take a device's lock from its holder (audited).

    Lives here, not in devices/api.py: ending the holder's attempt is engine business, and
    devices never imports jobs. Needs the *change device* permission.
    """

    permission_classes = [IsAuthenticated]

    @extend_schema(
        request=None,
        responses={200: LOCK_RELEASE_RESPONSE},
    )
    def post(self, request, name: str):
        if not request.user.has_perm("devices.change_device"):
            self.permission_denied(request, message=_("You may not release device locks."))
        device = get_object_or_404(Device, name=name)
        holder = lock_force_release(device=device, by=request.user.username)
        return Response({"device": device.name, "released_from": holder})


CANVAS_CANCEL_RESPONSE = inline_serializer(
    "CanvasCancel",
    {
        "root_id": CharField(),
        "canceled": IntegerField(help_text="How many of the canvas's runs were canceled (0: all had ended)."),
    },
)


class CanvasCancelView(APIView):
    """`POST /api/canvases/<root id>/cancel/`: cancel a whole Celery canvas (jobs/canvas.py).

    Every run of it that has not ended is canceled (as `POST /api/runs/<id>/cancel/`, and with
    its permissions), and its later device commands start no run. 404 for a root id no device
    command of which was ever started.
    """

    permission_classes = [IsAuthenticated]

    @extend_schema(
        request=None,
        responses={
            200: CANVAS_CANCEL_RESPONSE,
            404: OpenApiResponse(description="No device command of this canvas is known."),
        },
    )
    def post(self, request, root_id: str):
        if not request.user.has_perm(RUN_VIEW_PERMISSION):
            raise NotFound()  # as for a run: who may not see runs learns nothing of canvases
        if not request.user.has_perm("jobs.change_jobrun"):
            self.permission_denied(request, message=_("You may not cancel runs."))
        canceled = canvas_cancel(root_id=root_id, by=request.user.username)
        if canceled is None:
            raise NotFound(_("no canvas with root id '%(root)s'") % {"root": root_id})
        return Response({"root_id": root_id, "canceled": canceled})


@extend_schema_view(
    create=extend_schema(
        description="Create a maintenance window (time windows). 400s name the field: a cron expression "
        "that does not parse or names no date (`cron`), an unknown time zone (`timezone`), a duration "
        "outside 1..10080 minutes (`duration_minutes`), not exactly one target (`template`, `group`, "
        "`label_key`)."
    ),
    list=extend_schema(description="Maintenance windows by name, with whether each is open now."),
)
class MaintenanceWindowViewSet(viewsets.ModelViewSet):
    """Maintenance windows: a command for a device outside every window that applies to it
    waits for the next opening. A run keeps the windows that exist when it is created."""

    queryset = MaintenanceWindow.objects.select_related("template", "group")
    serializer_class = MaintenanceWindowSerializer
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX


@extend_schema_view(create=template_create_schema)
class TemplateViewSet(viewsets.ModelViewSet):
    """Templates with nested ordered steps; validation errors name the step and field."""

    queryset = JobTemplate.objects.prefetch_related(STEPS_PREFETCH)
    serializer_class = JobTemplateSerializer
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX

    @extend_schema(responses={200: TemplateVersionSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="versions")
    def versions(self, request, name=None):
        """The template's recorded versions, newest first (read-only; needs view_jobtemplate)."""
        versions = self._versions()
        page = self.paginate_queryset(versions)
        return self.get_paginated_response(TemplateVersionSerializer(page, many=True).data)

    @extend_schema(
        parameters=[OpenApiParameter("number", int, OpenApiParameter.PATH, description="Version number.")],
        responses={200: TemplateVersionSerializer},
    )
    @action(detail=True, methods=["get"], url_path=r"versions/(?P<number>[0-9]+)")
    def version(self, request, name=None, number=None):
        """One version of the template: its steps as a run of it executes them."""
        version = get_object_or_404(self._versions(), number=int(number))
        return Response(TemplateVersionSerializer(version).data)

    def get_queryset(self):
        if self.action in ("versions", "version"):
            return JobTemplate.objects.all()  # the versions hold the steps
        return super().get_queryset()

    def _versions(self):
        template = self.get_object()
        return template.versions.select_related("author").order_by("-number")


@extend_schema_view(
    list=extend_schema(description="The shared concurrency limits, by name."),
    create=extend_schema(
        description="Add a limit: at most `max_concurrent` of the commands it applies to in flight at "
        "once per value of the device label `label`, across every run. A 400 names the field."
    ),
    retrieve=extend_schema(description="One limit, by name."),
    update=extend_schema(description="Change a limit; workers read the change within 5 seconds."),
    partial_update=extend_schema(description="Change some of a limit's fields."),
    destroy=extend_schema(description="Remove a limit: the commands it held back go on as slots free."),
)
class ConcurrencyLimitViewSet(viewsets.ModelViewSet):
    """Shared concurrency limits (docs/orchestration.md, "Shared concurrency limits")."""

    queryset = ConcurrencyLimit.objects.all()
    serializer_class = ConcurrencyLimitSerializer
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX
