"""REST endpoints for devices and groups, and a device's live lock state."""

from django.db import transaction
from django.db.models.fields.json import KeyTransform
from django.utils.translation import gettext as _
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from iotqueue.dynsec import DynsecError
from iotqueue.mqtt import broker_address
from iotqueue.names import URL_NAME_LOOKUP_REGEX

from .certificate_rules import AuthorityUnavailable, CsrRefused, NameUnfit
from .credentials import (
    CredentialsUnavailable,
    IdentityForeign,
    device_certificate_issue,
    device_password_issue,
)
from .labels import device_labels_update
from .models import Device, DeviceGroup
from .profiles import DeviceProtocol
from .selectors import selector_filter, selector_parse
from .serializers import (
    CertificateRequestSerializer,
    CertificateSerializer,
    CredentialsSerializer,
    DeviceGroupSerializer,
    DeviceLabelsResultSerializer,
    DeviceLabelsUpdateSerializer,
    DeviceSerializer,
)

# `?label=KEY=VALUE`: any key (compared as one key, never as a lookup path), any value.
LABEL_PARAMETER_PATTERN = r"^[^=]+=.*$"
BOOLEAN_PARAMETER = {"true": True, "1": True, "false": False, "0": False}


class DeviceGroupViewSet(viewsets.ModelViewSet):
    queryset = DeviceGroup.objects.all()
    serializer_class = DeviceGroupSerializer
    lookup_field = "name"
    lookup_value_regex = URL_NAME_LOOKUP_REGEX


DEVICE_EXAMPLE = {
    "name": "pump-7",
    "description": "Pump in hall 2",
    "labels": {"site": "berlin", "kind": "pump"},
    "groups": ["pumps"],
    "presence_required": True,
    "max_per_minute": 30,
}


class BrokerUnavailable(APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "broker_unavailable"


class IdentityTaken(APIException):
    """409: the device's name is a broker user or role iotqueue did not create (left alone)."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "identity_foreign"


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(
                "label",
                str,
                many=True,
                pattern=LABEL_PARAMETER_PATTERN,
                description="KEY=VALUE; repeat to require several.",
            ),
            OpenApiParameter(
                "selector",
                str,
                description="A label selector: KEY=VALUE, KEY!=VALUE, KEY in (A,B), KEY notin (A,B), "
                "KEY, !KEY, comma-separated (all must hold), e.g. site in (berlin,paris),!legacy.",
            ),
            OpenApiParameter("online", bool, description="Only devices online (true) or offline (false)."),
            OpenApiParameter(
                "protocol", str, enum=DeviceProtocol.values, description="Only devices of this protocol."
            ),
        ]
    ),
    create=extend_schema(
        examples=[OpenApiExample("Create a device", value=DEVICE_EXAMPLE, request_only=True)]
    ),
)
class DeviceViewSet(viewsets.ModelViewSet):
    """Devices by name. (`GET /api/devices/<name>/lock/`, the holder and queue with their runs,
    is jobs/api.py's DeviceLockView: step rows are jobs business.)

    Writing a device also writes its broker identity (devices/credentials.py) in the same
    transaction: when the broker cannot take it, the answer is 503 and nothing changed.
    `POST /api/devices/<name>/credentials/` issues a new MQTT password (*change device*);
    `POST /api/devices/<name>/certificate/` a client certificate for the mTLS listener.
    """

    queryset = Device.objects.prefetch_related("groups")
    # For the schema (iotqueue/openapi.py): what handle_exception below makes of a DynsecError.
    write_error_responses = {
        "409": "The name is a broker user or role iotqueue did not create; nothing changed.",
        "503": "The MQTT broker could not take the change; nothing changed.",
    }
    serializer_class = DeviceSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9._:-]*"

    def get_queryset(self):
        queryset = super().get_queryset()
        for n, label in enumerate(self.request.query_params.getlist("label")):
            key, equals, value = label.partition("=")
            if not key or not equals:
                raise ValidationError(
                    {"label": [_("use label=KEY=VALUE with a key, not %(label)r") % {"label": label}]}
                )
            # The key as one JSON key (KeyTransform, not the `labels__KEY` lookup), so `a__b` or
            # `contains` is a key like any other, not a lookup; portable across SQLite and PostgreSQL.
            queryset = queryset.alias(**{f"label_{n}": KeyTransform(key, "labels")})
            queryset = queryset.filter(**{f"label_{n}": value})
        if "selector" in self.request.query_params:
            try:
                requirements = selector_parse(self.request.query_params["selector"])
            except ValueError as exc:
                raise ValidationError(
                    {"selector": [_("not a label selector: %(error)s") % {"error": exc}]}
                ) from None
            queryset = selector_filter(queryset, requirements)
        if "online" in self.request.query_params:
            given = self.request.query_params["online"]
            if given.lower() not in BOOLEAN_PARAMETER:
                raise ValidationError({"online": [_("use true or false, not %(given)r") % {"given": given}]})
            queryset = queryset.filter(online=BOOLEAN_PARAMETER[given.lower()])
        if "protocol" in self.request.query_params:
            queryset = queryset.filter(protocol=self._protocol_parameter())
        if self.action in ("credentials", "certificate") and not self.request.user.has_perm(
            "devices.view_device"
        ):
            # No existence oracle: to a user who may not see devices, every device is unknown.
            queryset = queryset.none()
        return queryset

    def _protocol_parameter(self) -> str:
        """`?protocol=`: one of the device protocols, or a 400 naming the parameter."""
        given = self.request.query_params["protocol"]
        if given not in DeviceProtocol.values:
            choices = ", ".join(DeviceProtocol.values)
            message = _("use one of %(choices)s, not %(given)r") % {"choices": choices, "given": given}
            raise ValidationError({"protocol": [message]})
        return given

    def dispatch(self, request, *args, **kwargs):
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return super().dispatch(request, *args, **kwargs)
        with transaction.atomic():
            response = super().dispatch(request, *args, **kwargs)
            if response.status_code >= 400:
                # An error answer changes nothing. DRF's exception handler rolls back only
                # under ATOMIC_REQUESTS, which this project does not set.
                transaction.set_rollback(True)
            return response

    def handle_exception(self, exc):
        if isinstance(exc, IdentityForeign):  # checked before saving, or found when writing
            exc = IdentityTaken({"name": [str(exc)]})
        elif isinstance(exc, DynsecError):  # dispatch() then rolls the transaction back
            exc = BrokerUnavailable(
                _("the MQTT broker could not be updated, nothing changed: %(error)s") % {"error": exc}
            )
        return super().handle_exception(exc)

    @extend_schema(
        request=None,
        responses={
            201: CredentialsSerializer,
            409: OpenApiResponse(description="This broker's device identities are not managed by iotqueue."),
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[IsAuthenticated])
    def credentials(self, request, name=None):
        """A new MQTT password for the device, shown this once; the previous one stops working."""
        device = self.get_object()
        if not (
            request.user.has_perm("devices.view_device") and request.user.has_perm("devices.change_device")
        ):
            self.permission_denied(request, message=_("You may not issue device credentials."))
        try:
            password = device_password_issue(device)
        except CredentialsUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        address = broker_address()
        return Response(
            CredentialsSerializer(
                {"username": device.name, "password": password, "host": address.host, "tls": address.tls}
            ).data,
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(
        request=CertificateRequestSerializer,
        responses={
            201: CertificateSerializer,
            400: OpenApiResponse(description="The CSR is not one, names another device, or has a weak key."),
            409: OpenApiResponse(
                description="This broker's device identities are not managed by iotqueue, or the device's "
                "name is longer than a certificate's common name holds (64 characters)."
            ),
            503: OpenApiResponse(description="No device CA is configured (or readable): nothing was issued."),
        },
        examples=[
            OpenApiExample("iotqueue makes the key", value={}, request_only=True),
            OpenApiExample(
                "Sign the device's own key",
                value={
                    "csr": "-----BEGIN CERTIFICATE REQUEST-----\n...\n-----END CERTIFICATE REQUEST-----\n"
                },
                request_only=True,
            ),
        ],
    )
    @action(detail=True, methods=["post"], permission_classes=[IsAuthenticated])
    def certificate(self, request, name=None):
        """A client certificate (CN = the device's name) signed by the device CA, shown this once.

        For the broker's mTLS listener, where the device is confined by the same role as with
        a password. Send `csr` to certify the device's own key; otherwise the answer carries a
        new private key. Earlier certificates stay valid until they expire: disable or delete
        the device to lock them all out (docs/operations.md, "Certificate devices").
        """
        device = self.get_object()
        if not (
            request.user.has_perm("devices.view_device") and request.user.has_perm("devices.change_device")
        ):
            self.permission_denied(request, message=_("You may not issue device credentials."))
        serializer = CertificateRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            issued = device_certificate_issue(device, csr_pem=serializer.validated_data.get("csr"))
        except (CredentialsUnavailable, NameUnfit) as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        except AuthorityUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        except CsrRefused as exc:
            raise ValidationError({"csr": [str(exc)]}) from None
        return Response(
            CertificateSerializer(
                {
                    "username": device.name,
                    "certificate": issued.certificate_pem,
                    "private_key": issued.private_key_pem,
                    "ca_certificate": issued.ca_certificate_pem,
                    "broker_ca_certificate": issued.broker_ca_certificate_pem,
                    "serial": issued.serial,
                    "fingerprint": issued.fingerprint,
                    "not_after": issued.not_after,
                }
            ).data,
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(
        request=DeviceLabelsUpdateSerializer,
        responses={200: DeviceLabelsResultSerializer},
        examples=[
            OpenApiExample(
                "Move Paris pumps to a new tier",
                value={"selector": "site=paris,kind=pump", "set": {"tier": "beta"}, "remove": ["legacy"]},
                request_only=True,
            )
        ],
    )
    @action(detail=False, methods=["post"], url_path="labels", permission_classes=[IsAuthenticated])
    def labels(self, request):
        """Set and remove labels on many devices in one transaction (*view* and *change device*).

        Address them by `selector` or by `devices` (names; an unknown name refuses the whole
        edit). Label changes never touch the broker: labels are not part of a device's ACLs.
        """
        if not (
            request.user.has_perm("devices.view_device") and request.user.has_perm("devices.change_device")
        ):
            self.permission_denied(request, message=_("You may not change devices."))
        serializer = DeviceLabelsUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if "selector" in data:
            devices = selector_filter(Device.objects.all(), selector_parse(data["selector"]))
        else:
            devices = Device.objects.filter(name__in=data["devices"])
            unknown = sorted(set(data["devices"]) - set(devices.values_list("name", flat=True)))
            if unknown:
                raise ValidationError(
                    {"devices": [_("unknown devices: %(names)s") % {"names": ", ".join(unknown)}]}
                )
        matched = devices.count()
        changed = device_labels_update(
            devices=devices, set_labels=data.get("set", {}), remove=data.get("remove", [])
        )
        return Response(
            DeviceLabelsResultSerializer(
                {"matched": matched, "changed": len(changed), "devices": changed}
            ).data
        )
