"""The metrics registry (iotqueue/metrics.py): only declared families and label values count.

Recording and scraping against Redis are in tests/iotqueue/test_metrics.py (stack tier).
"""

from __future__ import annotations

import pytest

from iotqueue import metrics
from iotqueue.metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    CounterBuffer,
    Family,
    MetricsBatch,
    UndeclaredMetric,
    family_declare,
    family_values,
    family_values_add,
    gauge_register,
)

OUTCOMES = Family("iotqueue_test_outcomes", "test only", COUNTER, ("outcome",), ("ok", "failed"))


@pytest.fixture(autouse=True)
def _registry_restored(monkeypatch):
    """What a test declares is gone after it: the apps' declarations stay as they loaded."""
    monkeypatch.setattr(metrics, "_registry", dict(metrics._registry))


def test_counting_an_undeclared_family_raises_at_the_caller():
    # given a family no app declared
    family = Family("iotqueue_test_undeclared", "test only", COUNTER)

    # then counting it fails at once, in a batch and in the bridge's buffer alike
    with pytest.raises(UndeclaredMetric, match="iotqueue_test_undeclared"):
        MetricsBatch().count(family)
    with pytest.raises(UndeclaredMetric):
        CounterBuffer().add(family)
    with pytest.raises(UndeclaredMetric):
        MetricsBatch().observe(Family("iotqueue_test_seconds", "test only", HISTOGRAM, buckets=(1,)), 0.5)


def test_a_declared_family_counts_its_declared_values_only():
    # given a declared one-label family
    family_declare(OUTCOMES)

    # when a declared value is counted, the batch holds it
    assert MetricsBatch().count(OUTCOMES, "ok")

    # then a value outside its vocabulary, or a wrong label count, raises
    with pytest.raises(UndeclaredMetric, match="'retried'"):
        MetricsBatch().count(OUTCOMES, "retried")
    with pytest.raises(ValueError):
        MetricsBatch().count(OUTCOMES)


def test_a_counter_is_not_observed_nor_a_histogram_counted():
    family_declare(OUTCOMES)
    durations = family_declare(Family("iotqueue_test_seconds", "test only", HISTOGRAM, buckets=(1,)))

    with pytest.raises(ValueError, match="not a histogram"):
        MetricsBatch().observe(OUTCOMES, 0.5, "ok")
    with pytest.raises(ValueError, match="not a counter"):
        MetricsBatch().count(durations)


def test_another_app_adds_the_values_it_decides():
    # given a family declared by one app
    family_declare(OUTCOMES)

    # when another app adds the outcomes its handlers decide
    family_values_add(OUTCOMES, "skipped")

    # then both vocabularies count, and both are reported before they happen
    assert family_values(OUTCOMES) == {"ok", "failed", "skipped"}
    assert MetricsBatch().count(OUTCOMES, "skipped")


def test_declaring_twice_is_harmless_but_a_name_has_one_meaning():
    family_declare(OUTCOMES)
    assert family_declare(OUTCOMES) is OUTCOMES

    with pytest.raises(ValueError, match="already declared"):
        family_declare(Family("iotqueue_test_outcomes", "another meaning", COUNTER))


def test_gauges_are_declared_with_their_reader():
    gauge = Family("iotqueue_test_depth", "test only", GAUGE, ("device",))

    with pytest.raises(ValueError, match="gauge_register"):
        family_declare(gauge)
    gauge_register(gauge, lambda: {("lamp-1",): 2})

    assert gauge in metrics.families()
