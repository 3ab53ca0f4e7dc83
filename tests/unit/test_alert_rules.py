"""The shipped alert rules (deploy/prometheus/alerts.yml): valid, tested, and about metrics that exist.

promtool checks the file and runs alerts_test.yml (each rule against series that make it fire
and series that do not); without promtool the test fails with the command that installs it
(`make test` and `make test-fast` install it first). Every metric an expression names must be one /metrics
exports, with the labels it filters on: a renamed family would otherwise leave an alert that
can never fire.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from devtools.promtool import ALERTS, INSTALL_COMMAND, promtool_path, rules_check
from iotqueue.metrics import COUNTER, GAUGE_ERRORS, HISTOGRAM, families

# A metric in PromQL, with its label matchers if any: name{label="v", label=~"a|b"}.
SELECTOR = re.compile(r"\b(iotqueue_\w+)(\{([^}]*)\})?")
MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")


def exported() -> dict[str, tuple[str, ...]]:
    """Every sample name /metrics can serve -> the labels it carries."""
    names: dict[str, tuple[str, ...]] = {GAUGE_ERRORS.name: GAUGE_ERRORS.labels}
    for family in families():
        if family.kind == COUNTER:
            names[f"{family.name}_total"] = family.labels
        elif family.kind == HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[family.name + suffix] = family.labels + (("le",) if suffix == "_bucket" else ())
        else:
            names[family.name] = family.labels
    return names


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules_and_every_rule_fires_in_its_tests():
    if not promtool_path():
        pytest.fail(f"promtool is needed to check the alert rules: as root run `{INSTALL_COMMAND}`")
    # when promtool checks the rules and runs their tests
    try:
        result = rules_check()
    except subprocess.CalledProcessError as failed:
        pytest.fail(f"promtool: {failed.stdout}\n{failed.stderr}")
    # then both pass
    assert "SUCCESS" in result.stdout


def test_every_rule_has_a_duration_a_severity_and_annotations():
    for rule in rules():
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_alerts_name_only_metrics_and_labels_that_metrics_exports():
    # given what /metrics exports, as the apps declared and registered it
    names = exported()
    # then every metric an alert expression reads is among them, with the labels it filters on
    used = set()
    for rule in rules():
        for name, _braces, matchers in SELECTOR.findall(rule["expr"]):
            used.add(name)
            assert name in names, f"{rule['alert']} reads {name}, which /metrics does not export"
            for label in MATCHER_LABEL.findall(matchers):
                carried = names[name]
                assert label in carried, f"{rule['alert']} filters {name} on {label}, which it does not carry"
    # and the alerts read the state gauges the rules were written for
    assert {"iotqueue_runs_stuck", "iotqueue_beat_lease_held", "iotqueue_webhooks_disabled"} <= used
