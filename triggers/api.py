"""REST endpoints for schedules and MQTT trigger rules (looked up by name)."""

from rest_framework import viewsets

from .models import Schedule, TriggerRule
from .serializers import ScheduleSerializer, TriggerRuleSerializer


class ScheduleViewSet(viewsets.ModelViewSet):
    """Beat schedules: a template started every N seconds or on a crontab in a timezone."""

    queryset = Schedule.objects.select_related("template")
    serializer_class = ScheduleSerializer
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"


class TriggerRuleViewSet(viewsets.ModelViewSet):
    """MQTT trigger rules: a topic filter that starts a template with the message's values."""

    queryset = TriggerRule.objects.select_related("template")
    serializer_class = TriggerRuleSerializer
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"
