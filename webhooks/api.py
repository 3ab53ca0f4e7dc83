"""REST endpoints: webhooks (CRUD) and each webhook's delivery log."""

from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from iotqueue.permissions import ModelPermissions

from .models import Delivery, Webhook
from .serializers import DeliverySerializer, WebhookSerializer


class WebhookViewSet(viewsets.ModelViewSet):
    """Webhooks: run lifecycle events POSTed to a URL, signed with the webhook's secret."""

    queryset = Webhook.objects.select_related("template")
    serializer_class = WebhookSerializer
    permission_classes = [ModelPermissions]

    @extend_schema(responses=DeliverySerializer(many=True))
    @action(detail=True, methods=["get"], serializer_class=DeliverySerializer)
    def deliveries(self, request: Request, pk: str | None = None) -> Response:
        """The webhook's deliveries, newest first: state, attempts, last status code and latency."""
        webhook = self.get_object()
        page = self.paginate_queryset(Delivery.objects.filter(webhook=webhook).order_by("-id"))
        return self.get_paginated_response(DeliverySerializer(page, many=True).data)
