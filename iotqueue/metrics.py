"""Prometheus metrics that every process records and any web process serves at /metrics.

Runs and steps move on in Celery pool processes, replies arrive in bridges, the monitor
ticks in beat, on any number of hosts. So the numbers live in Redis, not in a process: a
counter is a hash field bumped with HINCRBY, a histogram is a hash of per-bucket counts
plus a running sum. Recording costs one pipelined round trip and never raises on a Redis
failure: a count lost while Redis is down is better than a step that fails because of its
metric. At scrape time `RedisCollector` reads every family in one round trip and hands
prometheus_client the usual families; gauges about the present (a device's wait queue)
come from readers the apps register (`gauge_register`).

This module is the mechanism and the registry; it knows neither devices nor jobs. Each
family is declared by the app that counts it, when the app loads (`family_declare` in
iotqueue/bridge.py, devices/metrics.py, jobs/metrics.py); /metrics exports what was
declared (docs/operations.md, "Metrics and logs"). Counting a family, or a label value,
that was never declared raises `UndeclaredMetric` at the caller: a bug, not an outage.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from .redis_conn import redis_connection, redis_key

log = logging.getLogger(__name__)

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"
# Stored hash fields: label values joined by LABEL_SEP; a histogram field adds "#<le>" or
# "#sum". Label values are fixed vocabularies (outcomes, kinds), none contains these.
LABEL_SEP = "|"
FIELD_SEP = "#"
SUM = "sum"
INF = "+Inf"


@dataclass(frozen=True)
class Family:
    """One metric family: Prometheus name (a counter's without `_total`), help, labels.

    `values` is the vocabulary of a one-label family: reported as 0 before each first
    happens (so a dashboard shows it and rate() counts its first increment), and the only
    values counting accepts; another app may add its own (`family_values_add`). A family
    with a label and no `values` takes any value (a gauge's device names).
    """

    name: str
    doc: str
    kind: str
    labels: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def key(self) -> str:
        return redis_key("metrics", self.name)


# --- the registry ---------------------------------------------------------------------


class UndeclaredMetric(LookupError):
    """A family, or a label value, was counted without being declared (a bug)."""


GaugeReader = Callable[[], Mapping[tuple[str, ...], float]]


@dataclass
class _Declared:
    family: Family
    values: frozenset[str]
    read: GaugeReader | None = None


# Family name -> what was declared. Filled as the apps load (their metrics modules and
# AppConfig.ready), then only read: by every count and every scrape.
_registry: dict[str, _Declared] = {}


def family_declare(family: Family) -> Family:
    """Export a counter or histogram from now on; returns it (`X = family_declare(Family(...))`).

    Declaring the same family again changes nothing; another family under a declared
    name raises ValueError, so two apps cannot export one name with different meanings.
    """
    if family.kind == GAUGE:
        raise ValueError(f"{family.name}: a gauge is declared with its reader (gauge_register)")
    return _declare(family, None)


def family_values_add(family: Family, *values: str) -> None:
    """Add label values to a family another app declared: the bridge declares what it
    does with a message, the apps whose handlers take it add what they decide."""
    declared = _declared(family)
    if not family.values:
        raise ValueError(f"{family.name} has no closed vocabulary to add values to")
    declared.values |= frozenset(values)


def family_values(family: Family) -> frozenset[str]:
    """The label values `family` accepts (empty: any value)."""
    return _declared(family).values


def families() -> list[Family]:
    """Every declared family, by name."""
    return [_registry[name].family for name in sorted(_registry)]


def gauge_register(family: Family, read: GaugeReader) -> None:
    """Declare a gauge read at each scrape with `read()`: {label values: current value}."""
    if family.kind != GAUGE:
        raise ValueError(f"{family.name} is a {family.kind}, not a gauge")
    _declare(family, read)


def _declare(family: Family, read: GaugeReader | None) -> Family:
    if family.values and len(family.labels) != 1:
        raise ValueError(f"{family.name}: label values are listed for one-label families only")
    declared = _registry.get(family.name)
    if declared is None:
        _registry[family.name] = _Declared(family, frozenset(family.values), read)
    elif declared.family != family:
        raise ValueError(f"metric family {family.name} is already declared as {declared.family}")
    elif read is not None:
        declared.read = read
    return family


def _declared(family: Family) -> _Declared:
    declared = _registry.get(family.name)
    if declared is None or (declared.family is not family and declared.family != family):
        raise UndeclaredMetric(f"metric family {family.name} is counted but not declared (family_declare)")
    return declared


def _labelsets(family: Family) -> list[tuple[str, ...]]:
    """The label value tuples always reported (zero until counted)."""
    if not family.labels:
        return [()]
    return [(value,) for value in sorted(_declared(family).values)]


# --- recording ------------------------------------------------------------------------


def _labels_field(family: Family, kind: str, labels: tuple[str, ...]) -> str:
    """The hash field for `labels`; raises at the caller what no scrape could show."""
    declared = _declared(family)
    if family.kind != kind:
        raise ValueError(f"{family.name} is a {family.kind}, not a {kind}")
    if len(labels) != len(family.labels):
        raise ValueError(f"{family.name} takes labels {family.labels}, got {labels}")
    if declared.values and labels[0] not in declared.values:
        raise UndeclaredMetric(f"{family.name}: {family.labels[0]}={labels[0]!r} is counted but not declared")
    return LABEL_SEP.join(labels)


def _bucket_le(family: Family, value: float) -> str:
    """The `le` of the smallest bucket holding `value` (buckets are stored non-cumulative)."""
    position = bisect.bisect_left(family.buckets, value)
    return floatToGoString(family.buckets[position]) if position < len(family.buckets) else INF


class MetricsBatch:
    """Increments gathered by one caller and sent to Redis in one round trip."""

    def __init__(self) -> None:
        self._ops: list[tuple[str, str, str, float]] = []

    def __bool__(self) -> bool:
        return bool(self._ops)

    def count(self, family: Family, *labels: str, amount: int = 1) -> MetricsBatch:
        self._ops.append(("hincrby", family.key, _labels_field(family, COUNTER, labels), amount))
        return self

    def observe(self, family: Family, value: float, *labels: str) -> MetricsBatch:
        head = _labels_field(family, HISTOGRAM, labels) + FIELD_SEP
        self._ops.append(("hincrby", family.key, head + _bucket_le(family, value), 1))
        self._ops.append(("hincrbyfloat", family.key, head + SUM, value))
        return self

    def extend(self, other: MetricsBatch) -> MetricsBatch:
        self._ops.extend(other._ops)
        return self

    def pipe_add(self, pipe) -> None:
        """Queue the increments on a caller's pipeline (sent with its other commands)."""
        ops, self._ops = self._ops, []
        for method, key, field, amount in ops:
            getattr(pipe, method)(key, field, amount)

    def send(self) -> None:
        """Apply the increments; a Redis failure is logged and the increments are lost."""
        if not self._ops:
            return
        ops, self._ops = self._ops, []
        try:
            with redis_connection().pipeline(transaction=False) as pipe:
                for method, key, field, amount in ops:
                    getattr(pipe, method)(key, field, amount)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("metrics: %d increments not recorded: %s", len(ops), exc)


# The bridge counts every message it receives. A round trip per message would cost a
# tenth of its work on an ack, so those counts are summed in the process and sent at most
# this often; the bridge's loop also flushes them when messages stop coming.
BUFFER_FLUSH_SECONDS = 1.0


class CounterBuffer:
    """Counter increments summed in this process and sent in one round trip when due.

    Thread-safe (the MQTT network thread adds, the bridge's loop flushes). Counts not yet
    sent when the process dies are lost: a second or two's worth.
    """

    def __init__(self, flush_seconds: float = BUFFER_FLUSH_SECONDS) -> None:
        self.flush_seconds = flush_seconds
        self._lock = threading.Lock()
        self._counts: Counter[tuple[Family, tuple[str, ...]]] = Counter()
        self._sent_at = time.monotonic()

    def add(self, family: Family, *labels: str, amount: int = 1) -> None:
        _labels_field(family, COUNTER, labels)  # a wrong family or label fails here, at the caller
        with self._lock:
            self._counts[(family, labels)] += amount
            due = time.monotonic() - self._sent_at >= self.flush_seconds
        if due:
            self.flush()

    def flush(self) -> None:
        """Send what was counted since the last flush (never raises on a Redis failure)."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
            self._sent_at = time.monotonic()
        batch = MetricsBatch()
        for (family, labels), amount in counts.items():
            batch.count(family, *labels, amount=amount)
        batch.send()


counter_buffer = CounterBuffer()


# --- scraping -------------------------------------------------------------------------


def _counter_metric(family: Family, fields: dict[str, str]) -> Metric:
    metric = CounterMetricFamily(family.name, family.doc, labels=family.labels)
    values = {labels: 0.0 for labels in _labelsets(family)}
    for field, value in fields.items():
        values[tuple(field.split(LABEL_SEP)) if family.labels else ()] = float(value)
    for labels, value in sorted(values.items()):
        metric.add_metric(list(labels), value)
    return metric


def _histogram_metric(family: Family, fields: dict[str, str]) -> Metric:
    metric = HistogramMetricFamily(family.name, family.doc, labels=family.labels)
    series: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
    for labels in _labelsets(family):
        series[labels] = {}
    for field, value in fields.items():
        head, _, tail = field.rpartition(FIELD_SEP)
        series[tuple(head.split(LABEL_SEP)) if family.labels else ()][tail] = float(value)
    bounds = [floatToGoString(b) for b in family.buckets]
    for labels, stored in sorted(series.items()):
        cumulative, buckets = 0.0, []
        for le in bounds:
            cumulative += stored.get(le, 0.0)
            buckets.append((le, cumulative))
        # +Inf also takes counts of buckets that no longer exist (the bounds were changed).
        total = sum(v for k, v in stored.items() if k != SUM)
        buckets.append((INF, total))
        metric.add_metric(list(labels), buckets, stored.get(SUM, 0.0))
    return metric


def _gauge_metric(family: Family, read: GaugeReader) -> Metric:
    metric = GaugeMetricFamily(family.name, family.doc, labels=family.labels)
    for labels, value in sorted(read().items()):
        metric.add_metric(list(labels), value)
    return metric


class RedisCollector(Collector):
    """Reads every declared counter and histogram at scrape time; a Redis failure fails the scrape."""

    def collect(self) -> Iterator[Metric]:
        counted = [family for family in families() if family.kind != GAUGE]
        with redis_connection().pipeline(transaction=False) as pipe:
            for family in counted:
                pipe.hgetall(family.key)
            stored = dict(zip(counted, pipe.execute(), strict=True))
        for family in counted:
            if family.kind == HISTOGRAM:
                yield _histogram_metric(family, stored[family])
            else:
                yield _counter_metric(family, stored[family])


# Set by GaugeCollector at every scrape: a gauge whose reader failed is left out, and this says so.
GAUGE_ERRORS = Family(
    "iotqueue_gauge_read_errors",
    "1 for each gauge whose reader failed in this scrape (the gauge itself is left out), 0 for the others.",
    GAUGE,
    ("gauge",),
)


class GaugeCollector(Collector):
    """Reads every registered gauge at scrape time, each on its own: a reader that fails (its
    database or Redis away) is logged and its gauge left out of this scrape, with
    `iotqueue_gauge_read_errors{gauge=...}` at 1, so one missing dependency never fails the scrape."""

    def collect(self) -> Iterator[Metric]:
        errors = GaugeMetricFamily(GAUGE_ERRORS.name, GAUGE_ERRORS.doc, labels=GAUGE_ERRORS.labels)
        for family in families():
            if family.kind != GAUGE:
                continue
            try:
                metric = _gauge_metric(family, _registry[family.name].read)
            except Exception as exc:  # any dependency of any reader: logged, answered by the error gauge
                log.warning("metrics: gauge %s left out of this scrape: %s", family.name, exc)
                errors.add_metric([family.name], 1)
                continue
            errors.add_metric([family.name], 0)
            yield metric
        yield errors


# Only this project's families: the web process's own CPU and memory would say nothing
# about the workers and bridges the numbers come from.
registry = CollectorRegistry(auto_describe=False)
registry.register(RedisCollector())
registry.register(GaugeCollector())


def metrics_render(accept: str = "") -> tuple[bytes, str]:
    """The exposition for an Accept header (text 0.0.4 unless the scraper asks for more).

    Raises redis.RedisError when the counters' Redis is unreachable; a gauge that cannot be
    read is only left out (GaugeCollector).
    """
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type
