"""Template validation: what an operator gets told when saving a template, field by field.

Checked on save (admin and REST), so a run never discovers a typo at 02:00: the target is
exactly one of device / device_param / group / labels / selector (a label selector that
parses); actions are topic-safe; args are
JSON objects whose {{ references }} are well-formed and point at run parameters or at
earlier steps (by position or name), never at the step itself or a later one; a task step
names a registered step task (jobs/tasksteps.py), so a template cannot run any other.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.utils.translation import gettext as _

from devices.protocol import ACTION_RE, EXTEND_SECONDS_LIMIT
from devices.selectors import selector_parse

from . import templating
from .choices import (
    FANOUT_VALUES,
    MAX_INCREMENT_FACTOR,
    OPEN_SECONDS_MAX,
    AbortCause,
    DevicesFromOutcome,
    StepKind,
    WaveGate,
    WaveOnFail,
)
from .tasksteps import step_task_registered

# What an args reference may start with.
REFERENCE_ROOTS = ("params", "steps", "run", "device")


def _target_count(step) -> int:
    targets = (
        step.device_id,
        step.device_param,
        step.group_id,
        step.labels,
        getattr(step, "selector", ""),
        getattr(step, "devices_from", {}),
    )
    return sum(bool(x) for x in targets)


def _fans_out(step) -> bool:
    """Whether a step fans out (jobs/engine/plan.py spec_is_fanout, on a step not yet saved)."""
    return bool(step.group_id or step.labels or step.selector or getattr(step, "devices_from", {}))


def step_errors(step) -> dict[str, str]:
    """Errors of one step on its own, keyed by field name."""
    errors: dict[str, str] = {}
    targets = _target_count(step)
    if step.kind == StepKind.DELAY:
        if targets:
            errors["device"] = _("A delay step has no target device.")
        if not step.delay_seconds or step.delay_seconds <= 0:
            errors["delay_seconds"] = _("A delay step needs delay_seconds > 0.")
        errors.update(continuous_errors(step))
        return errors
    extend = getattr(step, "max_extend_seconds", 0) or 0
    if not 0 <= extend <= EXTEND_SECONDS_LIMIT:
        errors["max_extend_seconds"] = _("Give 0 to %(limit)d seconds (a week at most).") % {
            "limit": EXTEND_SECONDS_LIMIT
        }
    if step.kind == StepKind.TASK:
        errors.update(_task_step_errors(step))
    elif targets != 1:
        errors["device"] = _(
            "Choose exactly one target: device, device_param, group, labels, selector or devices_from."
        )
    if step.kind == StepKind.WAIT_ONLINE and _fans_out(step):
        errors["group"] = _("wait_online waits for one device, not a group.")
    if step.kind == StepKind.COMMAND and not ACTION_RE.match(step.action or ""):
        errors["action"] = _("Use letters, digits and . _ / - only.")
    if (
        step.kind != StepKind.TASK  # a task's compensation is a task name, checked above
        and step.compensation_action
        and not ACTION_RE.match(step.compensation_action)
    ):
        errors["compensation_action"] = _("Use letters, digits and . _ / - only.")
    if step.labels and (
        not isinstance(step.labels, dict) or not all(isinstance(v, str) for v in step.labels.values())
    ):
        errors["labels"] = _('Labels must be a JSON object of strings, e.g. {"kind": "pump"}.')
    if step.selector:
        try:
            selector_parse(step.selector)
        except ValueError as exc:
            errors["selector"] = _("Not a label selector: %(problem)s.") % {"problem": exc}
    problem = devices_from_problem(getattr(step, "devices_from", {}))
    if problem:
        errors["devices_from"] = problem
    errors.update(rollout_errors(step))
    errors.update(continuous_errors(step))
    for field in ("args", "compensation_args"):
        value = getattr(step, field)
        if not isinstance(value, dict):
            errors[field] = _("Must be a JSON object.")
            continue
        size, limit = templating.json_size(value), settings.IOTQUEUE_COMMAND_MAX_BYTES
        if size > limit:
            # The args as written, references included: no run could send them. A render
            # that grows past the limit is caught when a run renders it (jobs/engine/plan.py).
            errors[field] = _(
                "Takes %(size)d bytes as JSON, more than %(limit)d (IOTQUEUE_COMMAND_MAX_BYTES)."
            ) % {"size": size, "limit": limit}
            continue
        try:
            for ref in templating.references(value):
                if ref.split(".")[0] not in REFERENCE_ROOTS:
                    raise templating.TemplateError(
                        _("{{ %(ref)s }}: a reference starts with one of %(roots)s")
                        % {"ref": ref, "roots": ", ".join(REFERENCE_ROOTS)}
                    )
        except templating.TemplateError as exc:
            errors[field] = str(exc)
    return errors


def _task_step_errors(step) -> dict[str, str]:
    """A task step: a registered task (and compensation task), on one device or none."""
    errors: dict[str, str] = {}
    if _fans_out(step) or _target_count(step) > 1:
        errors["device"] = _("A task step runs once: give a device, a device_param, or no target.")
    for field in ("action", "compensation_action"):
        name = getattr(step, field) or ""
        if (name or field == "action") and not step_task_registered(name):
            errors[field] = _("'%(name)s' is not a registered step task (decorate it with @step_task).") % {
                "name": name
            }
    # A message running longer than the broker's visibility timeout is handed out again
    # (acks_late): the task would run twice at once.
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout")
    if visibility and step.timeout_seconds >= visibility:
        errors["timeout_seconds"] = _(
            "A task step must end within the broker's visibility timeout "
            "(%(seconds)ss, CELERY_VISIBILITY_TIMEOUT)."
        ) % {"seconds": visibility}
    return errors


def template_errors(steps: list[Any]) -> dict[str, dict[str, str]]:
    """Errors of a template's steps in position order, keyed by "step <position>" then field.

    Adds the checks one step cannot make alone: references to other steps must name an
    earlier step, positions and names must be unique.
    """
    errors: dict[str, dict[str, str]] = {}
    ordered = sorted(steps, key=lambda s: s.position)
    seen_names: dict[str, int] = {}
    for index, step in enumerate(ordered):
        label = f"step {step.position}"
        own = step_errors(step)
        if step.name:
            if step.name in seen_names:
                own["name"] = _("Name '%(name)s' is already used by step %(position)s.") % {
                    "name": step.name,
                    "position": seen_names[step.name],
                }
            seen_names[step.name] = step.position
        source = getattr(step, "devices_from", None)
        if source and "devices_from" not in own:
            fanouts = {s.name for s in ordered[:index] if s.name and _fans_out(s)}
            if source["step"] not in fanouts:
                own["devices_from"] = _(
                    "'%(step)s' is not an earlier fan-out step of this template (name a step before "
                    "this one that targets a group, labels, a selector or devices_from)."
                ) % {"step": source["step"]}
        for field in ("args", "compensation_args"):
            if field in own or not isinstance(getattr(step, field), dict):
                continue
            problem = _step_reference_problem(getattr(step, field), index, ordered, seen_names, field)
            if problem:
                own[field] = problem
        if own:
            errors[label] = own
    return errors


def _step_reference_problem(value, index: int, ordered: list, names: dict[str, int], field: str) -> str:
    # A compensation runs after its own step succeeded, so it may use that step's result.
    limit = index + 1 if field == "compensation_args" else index
    earlier = {str(i): s for i, s in enumerate(ordered[:limit])}
    earlier.update({s.name: s for s in ordered[:limit] if s.name})
    for ref in templating.references(value):
        parts = ref.split(".")
        if parts[0] != "steps":
            continue
        if len(parts) < 2 or parts[1] not in earlier:
            target = parts[1] if len(parts) > 1 else ""
            return _(
                "{{ %(ref)s }}: '%(target)s' is not an earlier step (use its index from 0 or its name)"
            ) % {"ref": ref, "target": target}
        if len(parts) < 3 or parts[2] == "result":
            continue
        if not _fans_out(earlier[parts[1]]):
            return _(
                "{{ %(ref)s }}: a step reference reads its result, e.g. steps.%(step)s.result.serial"
            ) % {"ref": ref, "step": parts[1]}
        if parts[2] not in FANOUT_VALUES:
            return _(
                "{{ %(ref)s }}: a fan-out step's reference reads one of result, %(values)s, "
                "e.g. steps.%(step)s.counts.failed"
            ) % {"ref": ref, "values": ", ".join(FANOUT_VALUES), "step": parts[1]}
    return ""


def devices_from_problem(source: Any) -> str:
    """What is wrong with a step's `devices_from` on its own, or "" ({} is none, and so is
    an emptied admin field)."""
    if source in ({}, None):
        return ""
    outcomes = ", ".join(DevicesFromOutcome.values)
    if (
        not isinstance(source, dict)
        or set(source) != {"step", "outcome"}
        or not isinstance(source["step"], str)
        or not source["step"]
        or source["outcome"] not in DevicesFromOutcome.values
    ):
        message = _(
            'Use {"step": NAME, "outcome": OUTCOME}: the name of an earlier fan-out step, '
            "and one of %(outcomes)s."
        )
        return message % {"outcomes": outcomes}
    return ""


# Criteria a step may have: one per cause and a few thresholds each is plenty; the bound
# keeps the check a row end runs small.
ABORT_CRITERIA_MAX = 8
ABORT_CRITERION_KEYS = {"cause", "threshold_percent", "min_executed"}


def rollout_errors(step) -> dict[str, str]:
    """A fan-out step's ramp (exponential rollout) and abort criteria, keyed by field."""
    errors: dict[str, str] = {}
    problem = abort_criteria_problem(getattr(step, "abort_criteria", []))
    if problem:
        errors["abort_criteria"] = problem
    waves = getattr(step, "waves", [])
    problem = waves_problem(waves)
    if not problem and waves and not (step.group_id or step.labels or getattr(step, "selector", "")):
        problem = _("Waves split a fan-out: give the step a group, labels or a selector.")
    if problem:
        errors["waves"] = problem
    factor = getattr(step, "rollout_increment_factor", 1.0)
    if not isinstance(factor, int | float) or not 1 <= factor <= MAX_INCREMENT_FACTOR:
        errors["rollout_increment_factor"] = _("Give 1 (a fixed rate) to %(max)g.") % {
            "max": MAX_INCREMENT_FACTOR
        }
    elif factor > 1:
        if not step.rollout_per_minute:
            errors["rollout_per_minute"] = _("A ramp starts from a base rate: give rollout_per_minute > 0.")
        if not getattr(step, "rollout_increment_every", 0):
            errors["rollout_increment_every"] = _("A ramp steps up after a number of devices: give it (> 0).")
        maximum = getattr(step, "rollout_max_per_minute", 0)
        if maximum and maximum < step.rollout_per_minute:
            errors["rollout_max_per_minute"] = _("The maximum rate is at least rollout_per_minute (or 0).")
    return errors


def continuous_errors(step) -> dict[str, str]:
    """A continuous fan-out: only a command fanned out to a group, labels or a selector
    stays open; open_seconds (its end-by) only for one that does."""
    errors: dict[str, str] = {}
    continuous = getattr(step, "continuous", False)
    fans_out = bool(step.group_id or step.labels or getattr(step, "selector", ""))
    if continuous and (step.kind != StepKind.COMMAND or not fans_out):
        errors["continuous"] = _("Only a command step that fans out (group, labels or selector) stays open.")
    if getattr(step, "open_seconds", None) is not None and not continuous:
        errors["open_seconds"] = _("open_seconds is the end-by of a continuous fan-out: set continuous too.")
    elif getattr(step, "open_seconds", None) is not None and not 1 <= step.open_seconds <= OPEN_SECONDS_MAX:
        errors["open_seconds"] = _("Give 1 to %(max)d seconds, or leave it empty to close it by hand.") % {
            "max": OPEN_SECONDS_MAX
        }
    return errors


def abort_criteria_problem(criteria: Any) -> str:
    """What is wrong with a step's abort criteria, or "" (a list of criterion objects)."""
    if not isinstance(criteria, list):
        return _("Must be a JSON list of criteria.")
    if len(criteria) > ABORT_CRITERIA_MAX:
        return _("At most %(count)d criteria.") % {"count": ABORT_CRITERIA_MAX}
    causes = ", ".join(AbortCause.values)
    for number, criterion in enumerate(criteria):
        where = _("criterion %(number)d") % {"number": number}
        if not isinstance(criterion, dict) or set(criterion) - ABORT_CRITERION_KEYS:
            return _('%(where)s: use {"cause": …, "threshold_percent": …, "min_executed": …} only.') % {
                "where": where
            }
        if criterion.get("cause") not in AbortCause.values:
            return _("%(where)s: cause is one of %(causes)s.") % {"where": where, "causes": causes}
        percent = criterion.get("threshold_percent")
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
            return _("%(where)s: threshold_percent is a whole number from 0 to 100.") % {"where": where}
        minimum = criterion.get("min_executed", 0)
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            return _("%(where)s: min_executed is a whole number, 0 or more.") % {"where": where}
    return ""


# Waves a step may list (a by_label wave expands to one wave per label value besides): a
# rollout has a few stages, and the bound keeps the spec small.
WAVES_MAX = 20
# The longest soak after a wave: a week; longer is a pause, which an operator ends.
WAVE_SOAK_MAX_SECONDS = 7 * 24 * 3600
WAVE_SIZE_KEYS = ("percent", "count", "rest", "by_label")
WAVE_KEYS = {
    *WAVE_SIZE_KEYS,
    "min_succeeded_percent",
    "max_failed_percent",
    "on_fail",
    "soak_seconds",
    "gate",
    "webhook_url",
}
WEBHOOK_URL_MAX_LENGTH = 2000


def _whole(value: Any, low: int, high: int | None = None) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int)
        and value >= low
        and (high is None or value <= high)
    )


def waves_problem(waves: Any) -> str:
    """What is wrong with a step's waves, or "" (jobs/engine/waves.py says what they mean)."""
    if not isinstance(waves, list):
        return _("Must be a JSON list of waves.")
    if len(waves) > WAVES_MAX:
        return _("At most %(count)d waves.") % {"count": WAVES_MAX}
    for number, wave in enumerate(waves):
        problem = _wave_problem(wave, last=number == len(waves) - 1)
        if problem:
            return _("wave %(number)d: %(problem)s") % {"number": number + 1, "problem": problem}
    return ""


def _wave_problem(wave: Any, *, last: bool) -> str:
    if not isinstance(wave, dict) or set(wave) - WAVE_KEYS:
        return _("a wave is an object of %(keys)s only.") % {"keys": ", ".join(sorted(WAVE_KEYS))}
    sizes = [key for key in WAVE_SIZE_KEYS if key in wave]
    if len(sizes) != 1:
        return _("give exactly one of percent, count, rest or by_label.")
    size = sizes[0]
    if size == "percent" and not _whole(wave["percent"], 1, 100):
        return _("percent is a whole number from 1 to 100.")
    if size == "count" and not _whole(wave["count"], 1):
        return _("count is a whole number, 1 or more.")
    if size == "rest" and wave["rest"] is not True:
        return _('rest is true: "rest": true.')
    if size == "by_label" and (not isinstance(wave["by_label"], str) or not wave["by_label"]):
        return _('by_label names a label, e.g. "region".')
    if size in ("rest", "by_label") and not last:
        return _("rest and by_label take every device left: only the last wave may use them.")
    for key in ("min_succeeded_percent", "max_failed_percent"):
        if key in wave and not _whole(wave[key], 0, 100):
            return _("%(key)s is a whole number from 0 to 100.") % {"key": key}
    if "soak_seconds" in wave and not _whole(wave["soak_seconds"], 0, WAVE_SOAK_MAX_SECONDS):
        return _("soak_seconds is a whole number from 0 to %(max)d.") % {"max": WAVE_SOAK_MAX_SECONDS}
    if "on_fail" in wave and wave["on_fail"] not in WaveOnFail.values:
        return _("on_fail is one of %(values)s.") % {"values": ", ".join(WaveOnFail.values)}
    if "gate" in wave and wave["gate"] not in WaveGate.values:
        return _("gate is one of %(values)s.") % {"values": ", ".join(WaveGate.values)}
    url = wave.get("webhook_url")
    if (wave.get("gate") == WaveGate.WEBHOOK) != bool(url):
        return _("a webhook gate needs a webhook_url, and only a webhook gate has one.")
    if url:
        return gate_url_problem(url)
    return ""


def gate_url_problem(url: Any) -> str:
    """A webhook gate's URL: http or https with a host (no file:, no other scheme). Where it
    may point (no loopback or private address unless allowed) is checked when it is called
    (webhooks/gates.py), as for webhooks."""
    if not isinstance(url, str) or len(url) > WEBHOOK_URL_MAX_LENGTH:
        return _("webhook_url is a URL of at most %(max)d characters.") % {"max": WEBHOOK_URL_MAX_LENGTH}
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return _("webhook_url is not a URL.")
    if parts.scheme not in ("http", "https") or not host:
        return _("webhook_url is an http:// or https:// URL with a host.")
    return ""
