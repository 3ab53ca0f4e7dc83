"""Admin for devices and groups: labels, presence (online or offline since when), lock
holder and queue length at a glance, in a list that fits a 1280-px window."""

from __future__ import annotations

import logging

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from redis import RedisError

from iotqueue.dynsec import DynsecError
from iotqueue.forms import JSON_FORMFIELD_OVERRIDES
from iotqueue.moments import moment_html

from .certificate_rules import AuthorityUnavailable, NameUnfit
from .credentials import (
    CredentialsUnavailable,
    IssuedCertificate,
    device_certificate_issue,
    device_password_issue,
    identity_conflict,
)
from .locks import LockState, device_lock_state, device_lock_states
from .models import Device, DeviceGroup
from .topic_claims import device_topic_collisions

log = logging.getLogger(__name__)

# How many waiters the device page names (one query describes them all); the rest are counted.
QUEUE_NAMED = 50
# Passwords issued by one admin action: each is shown in a message, so a page full at most.
CREDENTIALS_AT_ONCE = 10
# Certificates issued by one admin action: each shows its PEM texts on one page, so a few.
CERTIFICATES_AT_ONCE = 10


@admin.register(DeviceGroup)
class DeviceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "device_count", "description"]
    search_fields = ["name"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(device_count=Count("devices"))

    @admin.display(description=gettext_lazy("devices"), ordering="device_count")
    def device_count(self, group: DeviceGroup) -> int:
        return group.device_count


# Time windows: the device's quiet hours, a section of their own on the device page.
QUIET_HOURS_FIELDS = ["timezone", "quiet_hours_start", "quiet_hours_end"]


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
            "protocol",
            "config",
            "min_interval_seconds",
            "max_per_minute",
            "enabled",
            "presence_required",
            *QUIET_HOURS_FIELDS,
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
    # Topics and flow limits are on the device page: the list says what an operator scans
    # for (which devices, where, up or down since when, busy with what) within 1280 px.
    list_display = ["name", "labels_list", "presence", "lock_holder", "queue_length"]
    list_filter = ["enabled", "online", "presence_required", "protocol", "groups"]
    search_fields = ["name", "description"]
    filter_horizontal = ["groups"]
    readonly_fields = [
        "presence",
        "lock",
        "certificate_serial",
        "certificate_fingerprint",
        "certificate_not_after",
        "created_at",
        "updated_at",
    ]
    # The device page opens with what it does now (the jobs app names the steps waiting for it).
    now_fields = ["presence", "lock"]
    actions = ["credentials_issue", "certificate_issue"]

    def get_fieldsets(self, request, obj=None):
        """What the device does now (an existing device only), then its fields as the form
        lists them, then when the row was created and changed."""
        form_fields = [name for name in DeviceForm.Meta.fields if name not in QUIET_HOURS_FIELDS]
        fields = [
            (None, {"fields": form_fields}),
            (
                _("Quiet hours"),
                {
                    "fields": [tuple(QUIET_HOURS_FIELDS)],
                    "description": _(
                        "No command is sent to the device between these local times, unless its "
                        "step is urgent; an empty time zone means the device's tz label, else UTC."
                    ),
                },
            ),
        ]
        if obj is None:
            return fields
        return [
            (_("Now"), {"fields": self.now_fields}),
            *fields,
            (
                _("Client certificate"),
                {"fields": ["certificate_serial", "certificate_fingerprint", "certificate_not_after"]},
            ),
            (None, {"fields": [("created_at", "updated_at")]}),
        ]

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
            request,
            _("The MQTT broker could not be updated, nothing changed: %(error)s") % {"error": exc},
            messages.ERROR,
        )
        return HttpResponseRedirect(request.get_full_path())

    @admin.action(description=gettext_lazy("Issue a new MQTT password (shown once)"), permissions=["change"])
    def credentials_issue(self, request, queryset):
        for device in queryset[:CREDENTIALS_AT_ONCE]:
            try:
                password = device_password_issue(device)
            except (CredentialsUnavailable, DynsecError) as exc:
                self.message_user(request, f"{device.name}: {exc}", messages.ERROR)
                continue
            issued = _(
                "%(device)s: MQTT username %(username)r, password %(password)r. Copy it now; it is "
                "not shown again. The previous password no longer works."
            ) % {"device": device.name, "username": device.name, "password": password}
            self.message_user(request, issued, messages.WARNING)

    @admin.action(
        description=gettext_lazy("Issue a client certificate and key (shown once)"), permissions=["change"]
    )
    def certificate_issue(self, request, queryset):
        """Sign a certificate for each selected device and show them, with their keys, on one page."""
        issued: list[tuple[Device, IssuedCertificate]] = []
        for device in queryset[:CERTIFICATES_AT_ONCE]:
            try:
                issued.append((device, device_certificate_issue(device)))
            except AuthorityUnavailable as exc:  # the same for every device: say it once
                self.message_user(request, str(exc), messages.ERROR)
                return None
            except (CredentialsUnavailable, NameUnfit, DynsecError) as exc:
                self.message_user(request, f"{device.name}: {exc}", messages.ERROR)
        if not issued:
            return None
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "issued": issued,
            "title": _("Client certificates issued"),
        }
        response = TemplateResponse(request, "admin/devices/device/certificates_issued.html", context)
        add_never_cache_headers(response)
        return response

    def get_changelist_instance(self, request):
        """What the page's devices do now, read for the whole page at once (`devices_describe`)
        and kept on its rows for the columns."""
        changelist = super().get_changelist_instance(request)
        devices = list(changelist.result_list)  # evaluates the page once; the template reuses it
        now = timezone.now()
        for device in devices:
            device.list_now = now
        self.devices_describe(devices)
        return changelist

    def devices_describe(self, devices: list[Device]) -> None:
        """Set each device's `lock_state`, `lock_holder_html` (None: the holder's name is
        shown) and `waiting` (how many wait for it; None: unknown) from one Redis round trip
        and `lock_holders_describe`. The jobs app also counts the steps that wait outside the
        lock queue (for a device that is offline)."""
        states = self.lock_states_read([device.name for device in devices])
        described = self.lock_holders_describe([state.holder for state in states.values() if state.holder])
        for device in devices:
            device.lock_state = states.get(device.name)
            holder = device.lock_state.holder if device.lock_state else None
            device.lock_holder_html = described.get(holder) if holder else None
            device.waiting = len(device.lock_state.queue) if device.lock_state else None

    def lock_states_read(self, names: list[str]) -> dict[str, LockState]:
        """Lock states from Redis; none (shown as '?') when Redis cannot be reached."""
        try:
            return device_lock_states(names)
        except RedisError as exc:
            log.warning("device list without lock states: %s", exc)
            return {}

    def lock_holders_describe(self, holders: list[str]) -> dict[str, str]:
        """HTML for lock holders, for the whole page at once; the jobs app describes its step
        holders as their run (linked) and step. A holder left out is shown as it is named."""
        return {}

    @admin.display(description=gettext_lazy("labels"))
    def labels_list(self, device: Device) -> str:
        """Each label as a pill linking to the list of devices with that label."""
        if not device.labels:
            return "-"
        return format_html_join(
            "",
            '<a class="iq-label" href="?{}">{}={}</a>',
            (
                (urlencode({f"labels__{key}": value}), key, value)
                for key, value in sorted(device.labels.items())
            ),
        )

    @admin.display(description=gettext_lazy("presence"), ordering="online")
    def presence(self, device: Device) -> str:
        """Online or offline since when (presence_since, written when presence changes), last
        seen when that is not known yet, or that presence is not tracked."""
        now = getattr(device, "list_now", None)
        if not device.enabled:
            state, text = "disabled", _("disabled")
        elif not device.presence_required:
            state, text = "untracked", _("presence not tracked")
        elif device.online:
            state, text = "online", _("online")
        else:
            state, text = "offline", _("offline")
        # An offline device sends nothing, so its last_seen is when it went offline.
        since = device.presence_since if state == "online" else None
        if state == "offline":
            since = device.presence_since or device.last_seen
        if since is not None:
            when = format_html("{} {}", _("since"), moment_html(since, now=now))
        elif device.last_seen is not None:
            when = format_html("{} {}", _("seen"), moment_html(device.last_seen, now=now))
        else:
            when = _("never seen") if state != "untracked" else ""
        return format_html(
            '<span class="iq-presence-{}">{}</span><br><span class="iq-quiet">{}</span>', state, text, when
        )

    @admin.display(description=gettext_lazy("lock holder"))
    def lock_holder(self, device: Device) -> str:
        state = getattr(device, "lock_state", None)
        if state is None:
            return "?"
        if state.holder is None:
            return format_html('<span class="iq-quiet">{}</span>', _("free"))
        return device.lock_holder_html or state.holder

    @admin.display(description=gettext_lazy("queue"))
    def queue_length(self, device: Device) -> str:
        waiting = getattr(device, "waiting", None)
        return "?" if waiting is None else str(waiting)

    @admin.display(description=gettext_lazy("Lock holder and queue"))
    def lock(self, device: Device) -> str:
        """Live from Redis: who executes on the device now and who waits, in order."""
        try:
            state = device_lock_state(device.name)
        except RedisError as exc:
            return _("unknown: Redis unreachable (%(error)s)") % {"error": exc}
        if state.holder is None and not state.queue:
            return _("free")
        named = state.queue[:QUEUE_NAMED]
        described = self.lock_holders_describe([h for h in (state.holder, *named) if h])
        if state.holder:
            fence = _("fence %(fence)s") % {"fence": state.fence}
            holder = format_html(
                '{} <span class="iq-quiet">({})</span>', described.get(state.holder, state.holder), fence
            )
        else:
            holder = _("free")
        if not state.queue:
            return format_html("{}<br>{}", holder, _("Nobody waits."))
        queue = format_html_join("", "<li>{}</li>", ((described.get(h, h),) for h in named))
        more = len(state.queue) - len(named)
        return format_html(
            '{}<br>{}<ol class="iq-queue">{}</ol>{}',
            holder,
            _("%(count)s waiting, in order:") % {"count": len(state.queue)},
            queue,
            _("and %(count)s more") % {"count": more} if more > 0 else "",
        )
