"""Job templates: steps edited inline in position order, and *Run now* with its form."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from devices.models import DeviceGroup, labels_validate
from iotqueue.forms import JSON_FORMFIELD_OVERRIDES, json_text_parse

from ..models import EndBehaviour, JobRun, JobStep, JobTemplate, Trigger
from ..parameters import template_device_parameters, template_parameters
from ..preview import run_preview
from ..services import RunStartError, run_start, run_start_each, template_plan, template_version_record
from ..validation import step_errors, template_errors
from .display import run_url
from .versions import TemplateVersionsAdminMixin, version_number_param, version_steps

# The *Run now* form's submit button that previews instead of starting (its name in the POST).
PREVIEW_BUTTON = "_preview"


class JobStepForm(forms.ModelForm):
    """One step: its own checks (jobs/validation.py) reported on its fields."""

    def _post_clean(self) -> None:
        # Where Django runs the model's own clean(): after the instance has the form's
        # values, so the errors land on the same fields (as UserCreationForm does too).
        super()._post_clean()
        errors = step_errors(self.instance)
        if errors:
            self._update_errors(ValidationError(errors))


class JobStepFormSet(BaseInlineFormSet):
    """Checks across steps (references to earlier steps, unique names) on save."""

    def clean(self) -> None:
        # Before Django's own uniqueness check, which raises over a duplicate position with a
        # message on the whole row: the step rows say which position is wrong, and why.
        positions_valid = self._positions_valid()
        super().clean()
        steps = [
            form.instance
            for form in self.forms
            if getattr(form, "cleaned_data", None) and not form.cleaned_data.get("DELETE")
        ]
        limit = settings.IOTQUEUE_TEMPLATE_MAX_STEPS
        if len(steps) > limit:
            raise ValidationError(
                _("A template has at most %(limit)d steps (IOTQUEUE_TEMPLATE_MAX_STEPS).") % {"limit": limit}
            )
        if not positions_valid:
            return  # the checks across steps need each step's place
        errors = template_errors(steps)
        if errors:
            raise ValidationError(
                [
                    _("%(step)s, %(field)s: %(message)s")
                    % {"step": label, "field": field, "message": message}
                    for label, fields in errors.items()
                    for field, message in fields.items()
                ]
            )

    def _positions_valid(self) -> bool:
        """Each kept step has a position of its own; else the error is on its Position field."""
        seen: dict[int, int] = {}
        valid = True
        for number, form in enumerate(self.forms):
            data = getattr(form, "cleaned_data", None)
            if not data or data.get("DELETE"):
                continue
            position = data.get("position")
            if position is None:
                if "position" not in form.errors:
                    form.add_error("position", _("Give the step a position: 0, 1, 2, … in running order."))
                valid = False
            elif position in seen:
                message = _("Position %(position)d is already taken by step row %(row)d.")
                form.add_error("position", message % {"position": position, "row": seen[position] + 1})
                valid = False
            else:
                seen[position] = number
        return valid


class JobStepInline(admin.StackedInline):
    model = JobStep
    form = JobStepForm
    formfield_overrides = JSON_FORMFIELD_OVERRIDES
    formset = JobStepFormSet
    extra = 0
    ordering = ["position"]
    autocomplete_fields = ["device", "group"]
    fieldsets = [
        (None, {"fields": [("position", "name", "kind"), ("action", "args")]}),
        (
            gettext_lazy("Target (exactly one)"),
            {"fields": [("device", "device_param"), ("group", "labels", "selector"), ("devices_from",)]},
        ),
        (
            gettext_lazy("Timing and failure"),
            {
                "fields": [
                    ("timeout_seconds", "ack_timeout_seconds", "queue_timeout_seconds", "delay_seconds"),
                    ("max_attempts", "backoff_seconds", "on_failure", "max_extend_seconds"),
                    ("compensation_action", "compensation_args", "urgent"),
                ]
            },
        ),
        (
            gettext_lazy("Fan-out"),
            {
                "classes": ["collapse"],
                "fields": [
                    ("rollout_per_minute", "max_in_flight"),
                    ("rollout_increment_factor", "rollout_increment_every", "rollout_increment_on"),
                    ("rollout_max_per_minute",),
                    ("abort_failure_percent", "abort_min_devices", "success_percent"),
                    ("abort_criteria",),
                    ("compensation_per_minute",),
                    ("continuous", "open_seconds"),
                    ("waves",),
                ],
            },
        ),
    ]

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("device", "group")


def json_object_parse(text: str) -> dict:
    """A form field's JSON text as a dict; ValidationError saying what is wrong otherwise."""
    value = json_text_parse(text)
    if not isinstance(value, dict):
        raise ValidationError(_('Must be a JSON object, e.g. {"level": 80}.'))
    return value


# Typed text that starts like JSON was meant as JSON: a mistake in it is reported, not sent as text.
JSON_OPENERS = ("{", "[", '"')


def parameter_value_parse(text: str, *, device: bool) -> Any:
    """A parameter's input: JSON when it parses (80, true, [1, 2]), else the text as typed.

    A device's name (device_param) is always text: a device called 7 stays "7".
    """
    if device:
        return text
    try:
        return json_text_parse(text)
    except ValidationError:
        if text.lstrip().startswith(JSON_OPENERS):
            raise
        return text


# Each parameter's input is named PARAMETER_PREFIX + its name, so that a parameter called
# e.g. "priority" cannot take the place of the form's own field.
PARAMETER_PREFIX = "param_"


class RunNowForm(forms.Form):
    """What an admin-started run gets; *for each* starts one run per matching device.

    Each parameter the template's steps read (jobs/parameters.py) has an input of its own,
    required unless the JSON object of `parameters` gives it (pasted from elsewhere);
    `parameters` takes any others too.
    """

    parameters = forms.CharField(
        required=False,
        initial="{}",
        label=gettext_lazy("Other parameters (JSON)"),
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60, "spellcheck": "false"}),
        help_text=gettext_lazy(
            'JSON object, e.g. {"door": 7}, for values too complex for a field above, or '
            "parameters the steps do not read by name."
        ),
    )
    priority = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=9,
        label=gettext_lazy("Priority"),
        help_text=gettext_lazy("0 lowest .. 9 most urgent; empty: the template's."),
    )
    group = forms.ModelChoiceField(
        DeviceGroup.objects.all(),
        required=False,
        to_field_name="name",
        label=gettext_lazy("For each device of group"),
        help_text=gettext_lazy(
            "One run per enabled device; each run gets the device's name as parameter 'device'."
        ),
    )
    labels = forms.CharField(
        required=False,
        label=gettext_lazy("For each device with labels"),
        widget=forms.TextInput(attrs={"size": 60, "spellcheck": "false"}),
        help_text=gettext_lazy('JSON object, e.g. {"site": "berlin", "kind": "pump"}.'),
    )

    not_before = forms.DateTimeField(
        required=False,
        label=gettext_lazy("Start not before"),
        help_text=gettext_lazy("e.g. 2026-11-29 02:00 (the console's time zone); empty: now."),
    )
    end_by = forms.DateTimeField(
        required=False,
        label=gettext_lazy("End by"),
        help_text=gettext_lazy("Then the end behaviour decides what still runs; empty: no end."),
    )
    end_behaviour = forms.ChoiceField(
        choices=EndBehaviour.choices,
        initial=EndBehaviour.CANCEL,
        required=False,
        label=gettext_lazy("End behaviour"),
        help_text=gettext_lazy(
            "Cancel: the run is canceled at its end. Finish: commands at work finish, nothing new starts."
        ),
    )

    def __init__(self, *args, needed: list[str], devices: set[str], **kwargs) -> None:
        """`needed`: the parameters the steps read, in order; `devices`: those naming a device."""
        super().__init__(*args, **kwargs)
        self.needed, self.devices = needed, devices
        # For each device: every run gets its device's name as "device", no input needed.
        for_each = bool(self.data.get("group") or (self.data.get("labels") or "").strip())
        in_json = self._json_names()
        if not needed:
            self.fields["parameters"].label = _("Parameters (JSON)")
        for name in needed:
            self.fields[PARAMETER_PREFIX + name] = forms.CharField(
                label=name,
                required=name not in in_json and not (for_each and name == "device"),
                strip=True,
                widget=forms.TextInput(attrs={"size": 40, "spellcheck": "false"}),
                help_text=self._parameter_help(name),
                error_messages={
                    "required": _("The steps read {{ params.%(name)s }}: give it a value.") % {"name": name}
                },
            )

    def _parameter_help(self, name: str) -> str:
        if name in self.devices:
            return _("The name of the device the steps address as device_param %(name)s.") % {"name": name}
        return _(
            "The steps read it as {{ params.%(name)s }}. JSON when it parses (80, true, [1, 2]), else text."
        ) % {"name": name}

    def _json_names(self) -> set[str]:
        """The names the posted JSON object gives (none when it does not parse: its field says why)."""
        try:
            extra = json.loads(self.data.get("parameters") or "{}")
        except (ValueError, RecursionError):
            return set()
        return set(extra) if isinstance(extra, dict) else set()

    def parameter_fields(self) -> list[str]:
        return [PARAMETER_PREFIX + name for name in self.needed]

    def clean_parameters(self) -> dict:
        return json_object_parse(self.cleaned_data["parameters"].strip() or "{}")

    def clean_labels(self) -> dict:
        text = self.cleaned_data["labels"].strip()
        if not text:
            return {}
        labels = json_object_parse(text)
        labels_validate(labels)
        return labels

    def clean(self) -> dict:
        data = super().clean()
        if data.get("group") and data.get("labels"):
            raise ValidationError(_("For each device: choose a group or labels, not both."))
        given = {}
        for name in self.needed:
            field = PARAMETER_PREFIX + name
            text = data.get(field)
            if not text:
                continue  # required ones are reported by their field; "device" comes from for-each
            if name in data.get("parameters", {}):
                self.add_error(field, _("Given twice, here and in the JSON object below: give it once."))
                continue
            try:
                given[name] = parameter_value_parse(text, device=name in self.devices)
            except ValidationError as exc:
                self.add_error(field, exc)
        if "parameters" in data:
            data["parameters"] = {**data["parameters"], **given}
        return data

    def error_field(self, field: str) -> str | None:
        """The form field a RunStartError's field belongs to (None: the form as a whole)."""
        if field == "for_each":
            return "group" if self.cleaned_data.get("group") else "labels"
        return field if field in self.fields else None


@admin.register(JobTemplate)
class JobTemplateAdmin(TemplateVersionsAdminMixin, admin.ModelAdmin):
    formfield_overrides = JSON_FORMFIELD_OVERRIDES
    list_display = ["name", "step_count", "default_priority", "updated_at"]
    search_fields = ["name", "description"]
    inlines = [JobStepInline]
    change_form_template = "admin/jobs/jobtemplate/change_form.html"

    class Media:
        css = {"all": ["jobs/admin.css"]}

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(step_count=Count("steps"))

    @admin.display(description=gettext_lazy("steps"), ordering="step_count")
    def step_count(self, template: JobTemplate) -> int:
        return template.step_count

    def get_list_display(self, request):
        if self.has_run_permission(request):
            return [*self.list_display, "run_now_link"]
        return self.list_display

    @admin.display(description="")
    def run_now_link(self, template: JobTemplate) -> str:
        return format_html(
            '<a href="{}">{}</a>', reverse("admin:jobs_jobtemplate_run", args=[template.pk]), _("Run now…")
        )

    def has_run_permission(self, request) -> bool:
        return request.user.has_perm("jobs.add_jobrun")

    def get_urls(self):
        run_now = self.admin_site.admin_view(self.run_now_view)
        return [
            path("<path:object_id>/run/", run_now, name="jobs_jobtemplate_run"),
            *self.version_urls(),
            *super().get_urls(),
        ]

    def save_related(self, request, form, formsets, change) -> None:
        """After the inline steps are written (in the admin's transaction): the next version."""
        super().save_related(request, form, formsets, change)
        template_version_record(template=form.instance, author=request.user)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = {"can_run": self.has_run_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def run_now_view(self, request, object_id):
        """*Run now*: a form for the run's parameters, priority and for-each target."""
        template = self.get_object(request, unquote(object_id))
        if template is None:
            raise Http404(_("no template with id '%(id)s'") % {"id": object_id})
        if not self.has_run_permission(request):
            raise PermissionDenied
        # "Run this version" on a version's page comes here with ?version=N.
        number = version_number_param(request, "version")
        version = None if number is None else self._version(template, number)
        plan = version.steps if version else template_plan(template)
        form = RunNowForm(
            request.POST or None, needed=template_parameters(plan), devices=template_device_parameters(plan)
        )
        preview = None
        if request.method == "POST" and form.is_valid():
            try:
                if PREVIEW_BUTTON in request.POST:
                    preview = self._run_preview(template, form.cleaned_data, version=version)
                else:
                    runs = self._runs_start(request, template, form.cleaned_data, version=version)
                    return self._runs_started(request, template, runs)
            except RunStartError as exc:
                form.add_error(form.error_field(exc.field), str(exc))
        fieldsets = [
            (None, {"fields": ["parameters", "priority"]}),
            (_("For each device (optional)"), {"fields": ["group", "labels"]}),
            (_("Time window (optional)"), {"fields": ["not_before", "end_by", "end_behaviour"]}),
        ]
        if form.needed:
            description = _("What the template's steps read: each is required.")
            fieldsets.insert(
                0, (_("Parameters"), {"fields": form.parameter_fields(), "description": description})
            )
        title = _("Run %(template)s") % {"template": template.name}
        if version:
            title = _("Run %(template)s, version %(number)d") % {
                "template": template.name,
                "number": version.number,
            }
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "original": template,
            "adminform": helpers.AdminForm(form, fieldsets, {}),
            "form": form,
            "steps": version_steps(version)
            if version
            else template.steps.select_related("device", "group").order_by("position"),
            "media": self.media + form.media,
            "preview": preview,
            "preview_button": PREVIEW_BUTTON,
        }
        return TemplateResponse(request, "admin/jobs/jobtemplate/run_now.html", context)

    def _run_preview(self, template: JobTemplate, data: dict, version=None) -> dict:
        """*Preview*: what *Start run* would do with this form (jobs/preview.py), nothing started."""
        for_each = None
        if data["group"] or data["labels"]:
            for_each = {"group": data["group"].name if data["group"] else "", "labels": data["labels"]}
        return run_preview(
            template=template,
            version=version.number if version else None,
            parameters=data["parameters"],
            priority=data["priority"],
            for_each=for_each,
        )

    def _runs_start(self, request, template: JobTemplate, data: dict, version=None) -> list[JobRun]:
        options = {
            "template": template,
            "version": version.number if version else None,
            "parameters": data["parameters"],
            "trigger": Trigger.ADMIN,
            "triggered_by": request.user.username,
            "priority": data["priority"],
            "not_before": data["not_before"],
            "end_by": data["end_by"],
            "end_behaviour": data["end_behaviour"] or EndBehaviour.CANCEL,
        }
        if data["group"] or data["labels"]:
            group = data["group"].name if data["group"] else ""
            return run_start_each(**options, group=group, labels=data["labels"])
        return [run_start(**options)[0]]

    def _runs_started(self, request, template: JobTemplate, runs: list[JobRun]):
        if len(runs) == 1:
            self.message_user(request, _("Started run %(run)s.") % {"run": runs[0].pk}, messages.SUCCESS)
            return HttpResponseRedirect(run_url(runs[0].pk))
        message = ngettext(
            "Started %(count)d run, one per device.", "Started %(count)d runs, one per device.", len(runs)
        )
        self.message_user(request, message % {"count": len(runs)}, messages.SUCCESS)
        runs_list = reverse("admin:jobs_jobrun_changelist")
        return HttpResponseRedirect(f"{runs_list}?template__id__exact={template.pk}&trigger__exact=admin")
