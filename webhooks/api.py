"""REST endpoints: webhooks (CRUD, secret rotation) and each webhook's delivery log."""

from __future__ import annotations

from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.translation import gettext_lazy as _lazy
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response

from iotqueue.permissions import ModelPermissions

from . import signing
from .models import Delivery, Webhook
from .serializers import DeliverySerializer, SecretSerializer, WebhookSerializer


class MayChangeWebhooks(BasePermission):
    """Seeing a new secret is for users who may change webhooks (and view them)."""

    message = _lazy("Rotating a webhook's secret needs the change_webhook permission.")

    def has_permission(self, request: Request, view) -> bool:
        user = request.user
        return bool(user and user.is_authenticated) and user.has_perms(
            ["webhooks.view_webhook", "webhooks.change_webhook"]
        )


def secret_response(secret: str, data: dict | None = None, status_code: int = status.HTTP_200_OK) -> Response:
    """An answer carrying a secret: shown this once, never cached."""
    response = Response({**(data or {}), "secret": secret}, status=status_code)
    add_never_cache_headers(response)
    return response


class WebhookViewSet(viewsets.ModelViewSet):
    """Webhooks: run lifecycle events POSTed to a URL, signed with the webhook's secret
    (never shown back: `secret_status` says whether one is set)."""

    queryset = Webhook.objects.select_related("template")
    serializer_class = WebhookSerializer
    permission_classes = [ModelPermissions]

    def create(self, request: Request, *args, **kwargs) -> Response:
        """Create a webhook; a secret left out is generated and shown in this answer only."""
        response = super().create(request, *args, **kwargs)
        if "secret" in request.data:
            return response
        webhook = Webhook.objects.get(pk=response.data["id"])
        return secret_response(webhook.secret, response.data, status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=SecretSerializer)
    @action(
        detail=True,
        methods=["post"],
        url_path="rotate-secret",
        serializer_class=SecretSerializer,
        permission_classes=[MayChangeWebhooks],
    )
    def rotate_secret(self, request: Request, pk: str | None = None) -> Response:
        """Replace the webhook's secret with a new one, shown in this answer only (needs
        webhooks.change_webhook). Attempts signed from now on use the new secret."""
        webhook = self.get_object()
        secret = signing.secret_generate()
        Webhook.objects.filter(pk=webhook.pk).update(secret=secret, updated_at=timezone.now())
        return secret_response(secret)

    @extend_schema(responses=DeliverySerializer(many=True))
    @action(detail=True, methods=["get"], serializer_class=DeliverySerializer)
    def deliveries(self, request: Request, pk: str | None = None) -> Response:
        """The webhook's deliveries, newest first: state, attempts, last status code and latency."""
        webhook = self.get_object()
        page = self.paginate_queryset(Delivery.objects.filter(webhook=webhook).order_by("-id"))
        return self.get_paginated_response(DeliverySerializer(page, many=True).data)
