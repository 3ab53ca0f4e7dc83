"""Admin for devices and groups: online state, lock holder and queue length at a glance."""

from __future__ import annotations

import logging

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.http import HttpResponseRedirect
from django.utils.html import format_html
from redis import RedisError

from iotqueue.dynsec import DynsecError
from iotqueue.forms import JSON_FORMFIELD_OVERRIDES

from .credentials import CredentialsUnavailable, device_password_issue, identity_conflict
from .locks import LockState, device_lock_state, device_lock_states
from .models import Device, DeviceGroup
from .topic_claims import device_topic_collisions

log = logging.getLogger(__name__)

# How many waiters the device page names; the rest are counted.
QUEUE_NAMED = 10
# Passwords issued by one admin action: each is shown in a message, so a page full at most.
CREDENTIALS_AT_ONCE = 10


@admin.register(DeviceGroup)
class DeviceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "device_count", "description"]
    search_fields = ["name"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(device_count=Count("devices"))

    @admin.display(description="devices", ordering="device_count")
    def device_count(self, group: DeviceGroup) -> int:
        return group.device_count


class DeviceForm(forms.ModelForm):
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
            "min_interval_seconds",
            "max_per_minute",
            "enabled",
            "presence_required",
        ]

    def clean_name(self) -> str:
        """A new name may not be a broker user or role iotqueue did not create.

        How it fails: DynsecError when the broker cannot be asked (the admin then says so and
        changes nothing, as for a failed write).
        """
        name = self.cleaned_data["name"]
        if name != self.instance.name:
            reason = identity_conflict(name)
            if reason:
                raise ValidationError(reason, code="identity_foreign")
        return name

    def clean(self) -> dict:
        data = super().clean()
        errors = device_topic_collisions(
            pk=self.instance.pk,
            name=data.get("name") or "",
            command_topic=data.get("command_topic") or "",
            reply_topic=data.get("reply_topic") or "",
        )
        if errors:
            raise ValidationError(errors)
        return data


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    formfield_overrides = JSON_FORMFIELD_OVERRIDES
    form = DeviceForm
    list_display = [
        "name",
        "enabled",
        "online",
        "presence_required",
        "last_seen",
        "lock_holder",
        "queue_length",
        "command_topic",
        "reply_topic",
    ]
    list_filter = ["enabled", "online", "presence_required", "groups"]
    search_fields = ["name", "description"]
    filter_horizontal = ["groups"]
    readonly_fields = ["online", "last_seen", "lock", "created_at", "updated_at"]
    actions = ["credentials_issue"]

    # Saving or deleting a device also writes its broker identity (devices/credentials.py)
    # inside the admin's transaction: a broker that cannot take it undoes the change.
    def changeform_view(self, request, *args, **kwargs):
        try:
            return super().changeform_view(request, *args, **kwargs)
        except DynsecError as exc:
            return self._broker_refused(request, exc)

    def delete_view(self, request, *args, **kwargs):
        try:
            return super().delete_view(request, *args, **kwargs)
        except DynsecError as exc:
            return self._broker_refused(request, exc)

    def changelist_view(self, request, *args, **kwargs):
        if request.method != "POST":  # only an action (e.g. "delete selected") writes
            return super().changelist_view(request, *args, **kwargs)
        try:  # the list's "delete selected": all or nothing, like a single delete
            with transaction.atomic():
                return super().changelist_view(request, *args, **kwargs)
        except DynsecError as exc:
            return self._broker_refused(request, exc)

    def _broker_refused(self, request, exc: DynsecError):
        self.message_user(
            request, f"The MQTT broker could not be updated, nothing changed: {exc}", messages.ERROR
        )
        return HttpResponseRedirect(request.get_full_path())

    @admin.action(description="Issue a new MQTT password (shown once)", permissions=["change"])
    def credentials_issue(self, request, queryset):
        for device in queryset[:CREDENTIALS_AT_ONCE]:
            try:
                password = device_password_issue(device)
            except (CredentialsUnavailable, DynsecError) as exc:
                self.message_user(request, f"{device.name}: {exc}", messages.ERROR)
                continue
            self.message_user(
                request,
                f"{device.name}: MQTT username {device.name!r}, password {password!r}. "
                "Copy it now; it is not shown again. The previous password no longer works.",
                messages.WARNING,
            )

    def get_changelist_instance(self, request):
        """The page's lock states in one Redis round trip, kept on its rows for the columns."""
        changelist = super().get_changelist_instance(request)
        devices = list(changelist.result_list)  # evaluates the page once; the template reuses it
        states = self.lock_states_read([device.name for device in devices])
        urls = self.lock_holder_urls([state.holder for state in states.values() if state.holder])
        for device in devices:
            device.lock_state = states.get(device.name)
            device.lock_holder_url = urls.get(device.lock_state.holder) if device.lock_state else None
        return changelist

    def lock_states_read(self, names: list[str]) -> dict[str, LockState]:
        """Lock states from Redis; none (shown as '?') when Redis cannot be reached."""
        try:
            return device_lock_states(names)
        except RedisError as exc:
            log.warning("device list without lock states: %s", exc)
            return {}

    def lock_holder_urls(self, holders: list[str]) -> dict[str, str]:
        """Admin links for lock holders; the jobs app links its step holders to their run."""
        return {}

    @admin.display(description="lock holder")
    def lock_holder(self, device: Device) -> str:
        state = getattr(device, "lock_state", None)
        if state is None:
            return "?"
        if state.holder is None:
            return "free"
        if device.lock_holder_url:
            return format_html('<a href="{}">{}</a>', device.lock_holder_url, state.holder)
        return state.holder

    @admin.display(description="queue")
    def queue_length(self, device: Device) -> str:
        state = getattr(device, "lock_state", None)
        return "?" if state is None else str(len(state.queue))

    @admin.display(description="Lock holder and queue")
    def lock(self, device: Device) -> str:
        """Live from Redis: who executes on the device now and who waits."""
        try:
            state = device_lock_state(device.name)
        except RedisError as exc:
            return f"unknown: Redis unreachable ({exc})"
        if state.holder is None:
            return "free"
        holder = state.holder
        url = self.lock_holder_urls([holder]).get(holder)
        if url:
            holder = format_html('<a href="{}">{}</a>', url, holder)
        waiting = ", ".join(state.queue[:QUEUE_NAMED])
        more = f" and {len(state.queue) - QUEUE_NAMED} more" if len(state.queue) > QUEUE_NAMED else ""
        return format_html(
            "{} (fence {}); {} waiting: {}{}", holder, state.fence, len(state.queue), waiting, more
        )
