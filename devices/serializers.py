"""REST representations of devices and groups."""

from rest_framework import serializers

from .models import Device, DeviceGroup


class DeviceGroupSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeviceGroup
        fields = ["name", "description"]


class DeviceSerializer(serializers.ModelSerializer):
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
            "config",
            "enabled",
            "presence_required",
            "min_interval_seconds",
            "max_per_minute",
            "online",
            "last_seen",
        ]
        read_only_fields = ["online", "last_seen"]


class LockStateSerializer(serializers.Serializer):
    device = serializers.CharField()
    holder = serializers.CharField(allow_null=True)
    fence = serializers.IntegerField(allow_null=True)
    since_ms = serializers.IntegerField(allow_null=True)
    lease_until_ms = serializers.IntegerField(allow_null=True)
    queue = serializers.ListField(child=serializers.CharField())
