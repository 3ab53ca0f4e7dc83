"""Waves and gates in the admin: a run's rollouts on its page, and the gate buttons' view."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseRedirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _

from ..models import JobRun, Rollout, RolloutState, StepStatus
from ..rollouts import APPLIES, RolloutConflict, RolloutNotFound, rollout_act, rollout_waves
from .display import run_url

# The order a wave's counts are shown in (the rest by name after them).
COUNT_ORDER = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT)


def _count_rank(status: str) -> tuple[int, str]:
    return (COUNT_ORDER.index(status) if status in COUNT_ORDER else len(COUNT_ORDER), status)


def wave_rule_text(wave: dict[str, Any]) -> str:
    """A wave's condition, soak and what a failure does, for people: "≤ 2% failed, soak 600 s"."""
    parts = []
    if wave.get("min_succeeded_percent") is not None:
        parts.append(_("≥ %(n)s%% succeeded") % {"n": wave["min_succeeded_percent"]})
    if wave.get("max_failed_percent") is not None:
        parts.append(_("≤ %(n)s%% failed") % {"n": wave["max_failed_percent"]})
    if wave.get("soak_seconds"):
        parts.append(_("soak %(n)s s") % {"n": wave["soak_seconds"]})
    if parts and wave.get("on_fail") == "abort":
        parts.append(_("abort on failure"))
    return ", ".join(parts) or "-"


def wave_gate_text(wave: dict[str, Any]) -> str:
    gate = wave.get("gate") or "auto"
    if gate == "approval":
        return _("approval")
    if gate == "webhook":
        return _("webhook %(url)s") % {"url": wave.get("webhook_url", "")}
    return _("auto")


def rollouts_view(run: JobRun) -> list[dict[str, Any]]:
    """The run's rollouts in waves for its page: state, reason, the actions that apply, and
    each wave with its size, condition, gate and counts by status."""
    shown = []
    for rollout in Rollout.objects.filter(run=run).order_by("index"):
        waves = []
        listed = rollout_waves(rollout)
        for wave in listed:
            counts = sorted(wave["counts"].items(), key=lambda item: _count_rank(item[0]))
            labels = dict(StepStatus.choices)
            waves.append(
                {
                    **wave,
                    "rule": wave_rule_text(wave),
                    # The last wave's gate opens nothing.
                    "gate_text": wave_gate_text(wave) if wave["number"] < len(listed) else "-",
                    "count_list": [(status, labels.get(status, status), n) for status, n in counts],
                }
            )
        active = not run.is_terminal and run.cursor == rollout.index and rollout.state != RolloutState.ENDED
        shown.append(
            {
                "rollout": rollout,
                "waves": waves,
                "actions": [
                    action for action, states in APPLIES.items() if active and rollout.state in states
                ],
            }
        )
    return shown


def rollout_action_view(model_admin, request, object_id: str, verb: str):
    """POST: apply a gate action to the run's rollout (`step` from the form), then back to
    where the button was (the run page, or the dashboard's `next`)."""
    if request.method != "POST":
        raise Http404(_("Use the buttons of the run page."))
    run = model_admin.get_object(request, unquote(object_id))
    if run is None:
        raise Http404(_("No run with id %(id)r") % {"id": object_id})
    if not model_admin.has_change_permission(request, run):
        raise PermissionDenied
    step = request.GET.get("step", "")
    try:
        rollout = rollout_act(
            run=run,
            action=verb,
            by=request.user.get_username(),
            reason=request.POST.get(f"reason_{step}", "").strip(),
            step=int(step) if step.isdigit() else None,
        )
    except (RolloutNotFound, RolloutConflict) as exc:
        model_admin.message_user(request, str(exc), messages.ERROR)
    else:
        model_admin.message_user(
            request,
            _("Step %(step)s: wave %(wave)s of %(waves)s, %(state)s.")
            % {
                "step": rollout.index,
                "wave": rollout.wave + 1,
                "waves": len(rollout.waves),
                "state": rollout.get_state_display(),
            },
            messages.SUCCESS,
        )
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        target = run_url(run.pk)
    return HttpResponseRedirect(target)
