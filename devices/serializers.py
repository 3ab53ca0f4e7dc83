"""REST representations of devices and groups."""

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils.translation import gettext as _
from rest_framework import serializers

from iotqueue.api import BoundedModelSerializer
from iotqueue.mqtt import broker_address

from .certificate_rules import CSR_MAX_CHARS
from .credentials import IdentityForeign, identity_conflict
from .models import Device, DeviceGroup, labels_validate, quiet_hours_problem
from .profiles import DeviceProtocol
from .selectors import SELECTOR_MAX_LENGTH, selector_parse
from .topic_claims import device_topic_collisions


class DeviceGroupSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeviceGroup
        fields = ["name", "description"]


class DeviceSerializer(BoundedModelSerializer):
    groups = serializers.SlugRelatedField(
        slug_field="name", many=True, queryset=DeviceGroup.objects.all(), required=False
    )

    class Meta:
        model = Device
        fields = [
            "name",
            "description",
            "labels",
            "groups",
            "command_topic",
            "reply_topic",
            "protocol",
            "config",
            "enabled",
            "presence_required",
            "min_interval_seconds",
            "max_per_minute",
            "timezone",
            "quiet_hours_start",
            "quiet_hours_end",
            "online",
            "last_seen",
            "presence_since",
            "certificate_serial",
            "certificate_fingerprint",
            "certificate_not_after",
        ]
        read_only_fields = [
            "online",
            "last_seen",
            "presence_since",
            "certificate_serial",
            "certificate_fingerprint",
            "certificate_not_after",
        ]

    def validate_name(self, value: str) -> str:
        """Refuse the service user's name (400) and a foreign broker identity's (409).

        How it fails: IdentityForeign (the view answers 409) when the broker holds a user or
        role of this name that iotqueue did not create; DynsecError (503) when the broker
        cannot be asked. Only a new name is checked: a device keeps the identity it has.
        """
        if settings.IOTQUEUE_MQTT_AUTH == "dynsec" and value == broker_address().username:
            raise serializers.ValidationError(_("iotqueue's own services use this MQTT user name."))
        if self.instance is None or self.instance.name != value:
            reason = identity_conflict(value)
            if reason:
                raise IdentityForeign(reason)
        return value

    def validate(self, attrs: dict) -> dict:
        def current(field: str) -> str:
            return attrs[field] if field in attrs else getattr(self.instance, field, "")

        errors = device_topic_collisions(
            pk=getattr(self.instance, "pk", None),
            name=current("name"),
            command_topic=current("command_topic"),
            reply_topic=current("reply_topic"),
        )
        errors.update(
            quiet_hours_problem(current("quiet_hours_start") or None, current("quiet_hours_end") or None)
        )
        if errors:
            raise serializers.ValidationError({field: [message] for field, message in errors.items()})
        if (
            self.instance is None
            and attrs.get("protocol") == DeviceProtocol.AWS_IOT_JOBS
            and "presence_required" not in self.initial_data
        ):
            # AWS IoT Jobs firmware publishes no status: it asks for its work when it connects
            # (start-next), so a new one does not wait for an "online" it will never send.
            attrs["presence_required"] = False
        return attrs


class CredentialsSerializer(serializers.Serializer):
    username = serializers.CharField(help_text="The device's MQTT username: its name.")
    password = serializers.CharField(help_text="Shown once; only the broker keeps (a hash of) it.")
    host = serializers.CharField(
        help_text="The broker as iotqueue reaches it; devices may use another address."
    )
    tls = serializers.BooleanField()


class CertificateRequestSerializer(serializers.Serializer):
    """`POST /api/devices/<name>/certificate/`: empty (iotqueue makes the key) or the device's CSR."""

    csr = serializers.CharField(
        required=False,
        trim_whitespace=False,
        max_length=CSR_MAX_CHARS,
        help_text="A PEM certificate signing request (-----BEGIN CERTIFICATE REQUEST-----) whose "
        "subject is CN=<device name>, with an RSA (2048 bits or more), EC P-256/384/521 or Ed25519 "
        "key. Omit it and iotqueue makes the key.",
    )


class CertificateSerializer(serializers.Serializer):
    username = serializers.CharField(help_text="The device's MQTT identity: its name, the certificate's CN.")
    certificate = serializers.CharField(help_text="The client certificate (PEM), signed by the device CA.")
    private_key = serializers.CharField(
        allow_blank=True,
        help_text="Its private key (PEM, unencrypted PKCS#8), shown this once and stored nowhere; "
        "empty when the device sent a CSR.",
    )
    ca_certificate = serializers.CharField(
        help_text="The device CA's certificate (PEM): the certificate's issuer."
    )
    broker_ca_certificate = serializers.CharField(
        help_text="The CA certificate (PEM) the device verifies the broker with (IOTQUEUE_BROKER_CA_CERT; "
        "the device CA when that is unset)."
    )
    serial = serializers.CharField(help_text="Serial number (hex), kept on the device.")
    fingerprint = serializers.CharField(help_text="SHA-256 fingerprint, kept on the device.")
    not_after = serializers.DateTimeField(help_text="End of validity.")


class LockStateSerializer(serializers.Serializer):
    device = serializers.CharField()
    holder = serializers.CharField(allow_null=True)
    fence = serializers.IntegerField(allow_null=True)
    since_ms = serializers.IntegerField(allow_null=True)
    lease_until_ms = serializers.IntegerField(allow_null=True)
    queue = serializers.ListField(child=serializers.CharField())


# Names one bulk label edit may list: a fleet's worth, not an unbounded request body.
LABELS_UPDATE_MAX_DEVICES = 10_000


class DeviceLabelsUpdateSerializer(serializers.Serializer):
    """`POST /api/devices/labels/`: which devices (a selector or names), what to set and remove."""

    selector = serializers.CharField(
        required=False,
        max_length=SELECTOR_MAX_LENGTH,
        help_text="The devices a label selector matches, e.g. site in (berlin,paris),!legacy.",
    )
    devices = serializers.ListField(
        child=serializers.CharField(max_length=128),
        required=False,
        allow_empty=False,
        max_length=LABELS_UPDATE_MAX_DEVICES,
        help_text="Or these devices, by name.",
    )
    set = serializers.DictField(
        child=serializers.CharField(allow_blank=True), required=False, help_text="Labels to set (KEY: VALUE)."
    )
    remove = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="Label keys to remove."
    )

    def validate_selector(self, value: str) -> str:
        try:
            requirements = selector_parse(value)
        except ValueError as exc:
            raise serializers.ValidationError(
                _("Not a label selector: %(error)s.") % {"error": exc}
            ) from None
        if not requirements:
            # A blank selector matches every device: the whole fleet relabelled by accident.
            raise serializers.ValidationError(
                _("An empty selector is refused; name at least one requirement.")
            )
        return value

    def validate_set(self, value: dict) -> dict:
        try:
            labels_validate(self.initial_data.get("set"))  # the values as sent, before coercion
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None
        return value

    def validate(self, attrs: dict) -> dict:
        if ("selector" in attrs) == ("devices" in attrs):
            raise serializers.ValidationError({"selector": [_('Give either "selector" or "devices".')]})
        if not attrs.get("set") and not attrs.get("remove"):
            raise serializers.ValidationError({"set": [_('Give labels to "set" and/or keys to "remove".')]})
        both = sorted(set(attrs.get("set", {})) & set(attrs.get("remove", [])))
        if both:
            raise serializers.ValidationError(
                {"remove": [_("Both set and removed: %(keys)s.") % {"keys": ", ".join(both)}]}
            )
        return attrs


class DeviceLabelsResultSerializer(serializers.Serializer):
    matched = serializers.IntegerField(help_text="Devices the selector or names addressed.")
    changed = serializers.IntegerField(help_text="Devices whose labels changed.")
    devices = serializers.ListField(child=serializers.CharField(), help_text="The changed devices' names.")
