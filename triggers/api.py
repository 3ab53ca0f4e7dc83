"""REST endpoints for schedules and MQTT trigger rules (looked up by name)."""

from django.utils.translation import gettext_lazy
from rest_framework import viewsets
from rest_framework.permissions import BasePermission

from iotqueue.names import URL_NAME_LOOKUP_REGEX
from iotqueue.permissions import ModelPermissions
from jobs.permissions import user_may_start_runs

from .models import Schedule, TriggerRule
from .serializers import ScheduleSerializer, TriggerRuleSerializer


class StartsRunsPermission(BasePermission):
    """Creating or changing a schedule or rule sets up runs: it needs the permission to start them.

    Deleting one starts nothing, so its model permission is enough.
    """

    message = gettext_lazy("You may not start runs, so you may not create or change what starts them.")

    def has_permission(self, request, view) -> bool:
        return request.method not in ("POST", "PUT", "PATCH") or user_may_start_runs(request.user)


class ScheduleViewSet(viewsets.ModelViewSet):
    """Beat schedules: a template started every N seconds or on a crontab in a timezone."""

    queryset = Schedule.objects.select_related("template")
    serializer_class = ScheduleSerializer
    permission_classes = [ModelPermissions, StartsRunsPermission]
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX


class TriggerRuleViewSet(viewsets.ModelViewSet):
    """MQTT trigger rules: a topic filter that starts a template with the message's values."""

    queryset = TriggerRule.objects.select_related("template")
    serializer_class = TriggerRuleSerializer
    permission_classes = [ModelPermissions, StartsRunsPermission]
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX
