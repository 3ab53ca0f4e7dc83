"""Admin for devices and groups: online state at a glance."""

from django.contrib import admin

from .locks import device_lock_state
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
    readonly_fields = ["online", "last_seen", "lock", "created_at", "updated_at"]

    @admin.display(description="Lock holder and queue")
    def lock(self, device: Device) -> str:
        """Live from Redis: who executes on the device now and who waits."""
        state = device_lock_state(device.name)
        if state.holder is None:
            return "free"
        return (
            f"{state.holder} (fence {state.fence}); {len(state.queue)} waiting: {', '.join(state.queue[:10])}"
        )
