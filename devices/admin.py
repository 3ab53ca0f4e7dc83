"""Admin for devices and groups: online state at a glance."""

from django.contrib import admin

from .models import Device, DeviceGroup


@admin.register(DeviceGroup)
class DeviceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "description"]
    search_fields = ["name"]


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "enabled",
        "online",
        "presence_required",
        "last_seen",
        "command_topic",
        "reply_topic",
    ]
    list_filter = ["enabled", "online", "presence_required", "groups"]
    search_fields = ["name", "description"]
    filter_horizontal = ["groups"]
    readonly_fields = ["online", "last_seen", "created_at", "updated_at"]
