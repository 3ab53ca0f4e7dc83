"""Prometheus metrics that every process records and any web process serves at /metrics.

Runs and steps move on in Celery pool processes, replies arrive in bridges, the monitor
ticks in beat, on any number of hosts. So the numbers live in Redis, not in a process: a
counter is a hash field bumped with HINCRBY, a histogram is a hash of per-bucket counts
plus a running sum. Recording costs one pipelined round trip and never raises: a count lost
while Redis is down is better than a step that fails because of its metric. At scrape time
`RedisCollector` reads every family in one round trip and hands prometheus_client the
usual families; gauges about the present (a device's wait queue) come from readers the
apps register (`gauge_register`), so this module knows neither devices nor jobs.

The catalogue below is the list of what is exported (docs/operations.md, "Metrics and
logs"): names, help, labels and buckets live here; what counts as what is decided where
it happens (jobs/events.py, jobs/replies.py, jobs/monitor.py, iotqueue/bridge.py).
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

    `values` lists the label values (of a one-label family) reported as 0 before they
    first happen, so a dashboard shows them and rate() counts their first increment.
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

    def labelsets(self) -> list[tuple[str, ...]]:
        """The label value tuples always reported (zero until counted)."""
        if not self.labels:
            return [()]
        return [(value,) for value in self.values]


# --- the catalogue --------------------------------------------------------------------
# Step durations range from a lamp switching (tens of ms) to a database instance being
# created (scenario 3: up to 1800 s), so the buckets span both.
STEP_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A free device is dispatched within milliseconds; a busy one may keep a step waiting up
# to its queue timeout (default 600 s, longer for slow provisioning steps).
LOCK_WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800)

RUNS_STARTED = Family("iotqueue_runs_started", "Runs that started (pending -> running).", COUNTER)
RUNS = Family(
    "iotqueue_runs",
    "Runs that ended, by terminal status.",
    COUNTER,
    ("outcome",),
    ("succeeded", "failed", "timed_out", "canceled", "compensated"),
)
STEPS = Family(
    "iotqueue_steps",
    "Step runs (one per device of a fan-out, compensations included) that ended, by terminal status.",
    COUNTER,
    ("outcome",),
    ("succeeded", "failed", "timed_out", "canceled", "skipped"),
)
STEP_RETRIES = Family(
    "iotqueue_step_retries", "Failed attempts that will be retried after a back-off.", COUNTER
)
STEP_DURATION = Family(
    "iotqueue_step_duration_seconds",
    "Time from publishing a command to the end of that attempt, by how the attempt ended.",
    HISTOGRAM,
    ("outcome",),
    ("succeeded", "failed", "timed_out", "retrying"),
    STEP_DURATION_BUCKETS,
)
LOCK_WAIT = Family(
    "iotqueue_lock_wait_seconds",
    "Time a step attempt waited for its device (lock queue, offline device, flow control) before dispatch.",
    HISTOGRAM,
    buckets=LOCK_WAIT_BUCKETS,
)
BRIDGE_MESSAGES = Family(
    "iotqueue_bridge_messages",
    "Messages the bridge received, by what became of them. 'accepted' replies were valid and handed "
    "to the engine, which may still find them stale, unknown or from a foreign device.",
    COUNTER,
    ("kind",),
    ("accepted", "malformed", "stale", "unknown", "foreign_device", "unrouted", "handler_error"),
)
MONITOR_ACTIONS = Family(
    "iotqueue_monitor_actions",
    "What the monitor did: ticks, due deadlines fired (by kind), expired leases reclaimed, "
    "work re-found by the database sweep, lock rebuilds after Redis lost its data.",
    COUNTER,
    ("action",),
    (
        "tick",
        "deadline_ack",
        "deadline_done",
        "deadline_send",
        "deadline_retry",
        "deadline_queue",
        "deadline_dispatch",
        "deadline_pump",
        "lease_reclaimed",
        "reconciled",
        "locks_rebuilt",
    ),
)
DEVICE_QUEUE_DEPTH = Family(
    "iotqueue_device_queue_depth",
    "Holders waiting in a device's lock queue; only devices with someone waiting are listed.",
    GAUGE,
    ("device",),
)

FAMILIES = (
    RUNS_STARTED,
    RUNS,
    STEPS,
    STEP_RETRIES,
    STEP_DURATION,
    LOCK_WAIT,
    BRIDGE_MESSAGES,
    MONITOR_ACTIONS,
)


# --- recording ------------------------------------------------------------------------


def _labels_field(family: Family, labels: tuple[str, ...]) -> str:
    if len(labels) != len(family.labels):
        raise ValueError(f"{family.name} takes labels {family.labels}, got {labels}")
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
        self._ops.append(("hincrby", family.key, _labels_field(family, labels), amount))
        return self

    def observe(self, family: Family, value: float, *labels: str) -> MetricsBatch:
        head = _labels_field(family, labels) + FIELD_SEP
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
        _labels_field(family, labels)  # a wrong label count fails here, at the caller
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


# --- gauges computed at scrape time ---------------------------------------------------

GaugeReader = Callable[[], Mapping[tuple[str, ...], float]]
_gauges: dict[str, tuple[Family, GaugeReader]] = {}


def gauge_register(family: Family, read: GaugeReader) -> None:
    """Report `family` at each scrape with `read()`: {label values: current value}."""
    _gauges[family.name] = (family, read)


# --- scraping -------------------------------------------------------------------------


def _counter_metric(family: Family, fields: dict[str, str]) -> Metric:
    metric = CounterMetricFamily(family.name, family.doc, labels=family.labels)
    values = {labels: 0.0 for labels in family.labelsets()}
    for field, value in fields.items():
        values[tuple(field.split(LABEL_SEP)) if family.labels else ()] = float(value)
    for labels, value in sorted(values.items()):
        metric.add_metric(list(labels), value)
    return metric


def _histogram_metric(family: Family, fields: dict[str, str]) -> Metric:
    metric = HistogramMetricFamily(family.name, family.doc, labels=family.labels)
    series: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
    for labels in family.labelsets():
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
    """Reads every family from Redis at scrape time; a Redis failure fails the scrape."""

    def collect(self) -> Iterator[Metric]:
        with redis_connection().pipeline(transaction=False) as pipe:
            for family in FAMILIES:
                pipe.hgetall(family.key)
            stored = pipe.execute()
        for family, fields in zip(FAMILIES, stored, strict=True):
            if family.kind == HISTOGRAM:
                yield _histogram_metric(family, fields)
            else:
                yield _counter_metric(family, fields)
        for family, read in _gauges.values():
            yield _gauge_metric(family, read)


# Only this project's families: the web process's own CPU and memory would say nothing
# about the workers and bridges the numbers come from.
registry = CollectorRegistry(auto_describe=False)
registry.register(RedisCollector())


def metrics_render(accept: str = "") -> tuple[bytes, str]:
    """The exposition for an Accept header (text 0.0.4 unless the scraper asks for more).

    Raises redis.RedisError when Redis is unreachable.
    """
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type
