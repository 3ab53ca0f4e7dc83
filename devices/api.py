"""REST endpoints for devices and groups, and a device's live lock state."""

import re
from dataclasses import asdict

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from .locks import device_lock_state
from .models import Device, DeviceGroup
from .serializers import DeviceGroupSerializer, DeviceSerializer, LockStateSerializer

LABEL_KEY_RE = re.compile(r"[A-Za-z0-9_.-]+")


class DeviceGroupViewSet(viewsets.ModelViewSet):
    queryset = DeviceGroup.objects.all()
    serializer_class = DeviceGroupSerializer
    lookup_field = "name"


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("label", str, many=True, description="KEY=VALUE; repeat to require several."),
            OpenApiParameter("online", bool, description="Only devices online (true) or offline (false)."),
        ]
    )
)
class DeviceViewSet(viewsets.ModelViewSet):
    """Devices by name; `GET /api/devices/<name>/lock/` shows holder, fence and wait queue."""

    queryset = Device.objects.prefetch_related("groups")
    serializer_class = DeviceSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9._:-]*"

    def get_queryset(self):
        queryset = super().get_queryset()
        for label in self.request.query_params.getlist("label"):
            key, _, value = label.partition("=")
            if not LABEL_KEY_RE.fullmatch(key) or "__" in key:
                raise ValidationError({"label": [f"use label=KEY=VALUE with a plain key, not {label!r}"]})
            # Portable across SQLite and PostgreSQL: JSON key lookup, not containment.
            queryset = queryset.filter(**{f"labels__{key}": value})
        if "online" in self.request.query_params:
            queryset = queryset.filter(online=self.request.query_params["online"].lower() in ("1", "true"))
        return queryset

    @extend_schema(responses=LockStateSerializer)
    @action(detail=True, methods=["get"])
    def lock(self, request, name=None):
        device = self.get_object()
        return Response(LockStateSerializer(asdict(device_lock_state(device.name))).data)
