"""Full garbage collections of the long-running processes, kept off the step path.

CPython's full collection (its oldest generation) walks every object the collector
tracks. A worker pool process holds about 140,000 from its imports and set-up (Django,
Celery, kombu, the models and their caches), the bridge about 90,000, nearly all of which
live as long as the process. In the benchmark one such collection took 45 to 87 ms in each
of the draining worker process, the bridge and the simulated devices, a few times a minute,
and every reply and command in flight waited for it: it made most of the paced hand-off's
p99 on SQLite (bench/README.md, eighth pass).

`startup_objects_freeze` collects once, then moves everything tracked into the
collector's permanent generation (`gc.freeze`), so later collections walk only what the
process created since it started serving. Cycles made while serving are still freed;
what start-up left and later drops is not (a few objects, once).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def startup_objects_freeze(process: str) -> int:
    """Collect, then freeze every object now tracked; returns how many are frozen.

    Call it once a long-running process has set itself up, before it serves (a prefork
    pool process from `worker_process_init`, the bridge before its loop).
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects from start-up frozen out of garbage collection", process, frozen)
    return frozen
