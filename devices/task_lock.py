"""Run a user's own Celery task under the per-device lock and FIFO queue (devices/locks.py).

    @shared_task(base=DeviceLockedTask, device_arg="device", bind=True)
    def firmware_push(self, device: str, url: str) -> None:
        http_put(device, url, fence=self.lock_fence)   # the body talks to the device itself

or, equivalently, `@device_locked_task(device_arg="device", bind=True)`. The argument named
by `device_arg` (positional or keyword) carries the device name. The task's holder is
"task:<celery task id>". A task for a free device runs at once. A task for a busy device is
*parked*: what is needed to send it again is stored in Redis, it joins the device's wait
queue and returns without running (Celery state IGNORED: no chain or callback fires) — no
worker blocks and nothing polls. When the lock is handed to it, `task_handoff` sends the
same task (same id, args, chain, callbacks, queue) again, and that run finds itself holding
the lock. While the body runs a daemon thread extends the lease every third of
`lock_lease_seconds`; when the body ends — returning or raising — the lock is released and
handed to the next waiter, which may be another task or a job step.

Options: `device_arg` (default "device"), `lock_lease_seconds` (default 60 s, must outlast
one extension round-trip to Redis), `lock_priority` (0..9, 9 most urgent, default 5) as a
task attribute, or per call `task.apply_async(..., lock_priority=9)` (sent as a message
header). Inside the body, `self.lock_fence` (bound tasks) or `task_lock_hold().fence` is
the fencing token to pass to the device; `self.lock_held` turns False if the lease was lost.

How it fails:
- Redis lost its lock state (NotReady): the task rebuilds the locks itself
  (devices/lock_recovery.py, one process at a time) and is sent again in
  NOT_READY_RETRY_SECONDS (same id; the retry count is not touched).
- The lease runs out while the body still runs (Redis unreachable for a whole lease, the
  process frozen): the monitor reclaims it and hands the device on; the body is NOT
  stopped. The extender logs an error and `lock_held` turns False; only a device that
  checks the fencing token is safe from the overlap.
- A pool process dies while the body runs: the message comes back (acks_late,
  reject_on_worker_lost) and, its holder still owning the lock, runs again at once. A whole
  worker gone: the lease expires, the monitor passes the lock on, and the message returns
  after the broker's visibility timeout and queues again. Bodies run at least once.
- Redis loses its data: parked tasks and their queue places are lost with it (as are the
  Celery messages when Redis is also the broker), and the rebuilt fence counters know only
  the fences job steps stored in the database. Run Redis with persistence.
- The hand-off's message waits behind other tasks in its Celery queue; its lease is
  `lock_lease_seconds` from the hand-off. If it starts later than that, the lock has moved
  on and the task queues again at the back.
- Releasing (or handing on) fails: logged, never raised into the task's outcome; the lease
  expires and the monitor passes the lock on.
- A parked task that is revoked or expires is discarded by the worker when its hand-off
  message arrives; the `task_revoked` handler below then releases its lock at once.
- Arguments must be JSON-serializable (the project's task serializer): the parked entry
  is JSON.
- Called directly or eagerly (no worker, nothing to send again): runs only if the device is
  free, else raises DeviceBusy.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from celery import Task, current_app, shared_task, signature
from celery.exceptions import Ignore
from celery.signals import task_revoked
from redis.exceptions import RedisError

from iotqueue.redis_conn import SOCKET_TIMEOUT_SECONDS, redis_connection, redis_key

from .lock_recovery import locks_rebuild
from .locks import (
    Grant,
    NotReady,
    Queued,
    device_lock_acquire,
    device_lock_dequeue,
    device_lock_extend,
    device_lock_pass_on,
    device_lock_state,
    holder_name,
    holder_parse,
)

log = logging.getLogger(__name__)

HOLDER_KIND = "task"
DEFAULT_LOCK_PRIORITY = 5
# Long enough that a worker under load still extends in time (every third of it), short
# enough that a holder killed mid-body blocks its device for about a minute.
DEFAULT_LEASE_SECONDS = 60.0
# The monitor rebuilds lost lock state on its next tick (about a second).
NOT_READY_RETRY_SECONDS = 1.0
# After a hand-off the parked entry is only needed if the task loses that hand-off and
# parks again (which rewrites it); one that never starts within this long is gone.
HANDED_OFF_ENTRY_TTL_SECONDS = 3600
# An extension in flight when the body ends takes at most a Redis socket timeout (plus
# its one retry).
EXTENDER_JOIN_SECONDS = 2 * SOCKET_TIMEOUT_SECONDS + 1
# Message headers: the fence a hand-off granted (for the log), and a per-call priority.
HANDOFF_FENCE_HEADER = "lock_handoff_fence"
PRIORITY_HEADER = "lock_priority"


class DeviceBusy(RuntimeError):
    """A direct (non-worker) call found the device locked; it cannot be parked."""


@dataclass(frozen=True)
class LockHold:
    """The lock a running task body holds: its device, holder name and fencing token."""

    device: str
    holder: str
    fence: int
    lost: threading.Event = field(default_factory=threading.Event, compare=False)


_hold: ContextVar[LockHold | None] = ContextVar("device_task_lock_hold", default=None)


def task_lock_hold() -> LockHold | None:
    """The device lock held by the task body running in this thread, if any."""
    return _hold.get()


# --- parked tasks ----------------------------------------------------------------------


def _parked_key(task_id: str) -> str:
    return redis_key("parked", task_id)


def task_park(task_id: str, entry: dict[str, Any]) -> None:
    """Store what a hand-off needs to send task `task_id` again (no expiry while it waits)."""
    redis_connection().set(_parked_key(task_id), json.dumps(entry, separators=(",", ":")))


def task_parked(task_id: str) -> dict[str, Any] | None:
    raw = redis_connection().get(_parked_key(task_id))
    return json.loads(raw) if raw is not None else None


def task_unpark(task_id: str) -> None:
    redis_connection().delete(_parked_key(task_id))


def task_handoff(device: str, grant: Grant) -> None:
    """Grant handler for "task" holders: send the parked task again, under the same id.

    The new message may wait in its Celery queue behind others, so the lease becomes the
    task's own. A task with no parked entry (revoked, lost) cannot run: the lock is passed
    on so the device's queue never stalls.
    """
    _, task_id = holder_parse(grant.holder)
    entry = task_parked(task_id)
    if entry is None:
        log.warning("lock on %s handed to %s, which is not parked; passing it on", device, grant.holder)
        device_lock_pass_on(device, holder=grant.holder, fence=grant.fence)
        return
    device_lock_extend(device, holder=grant.holder, fence=grant.fence, lease_seconds=entry["lease_seconds"])
    # Before sending: if the task parks again, its own write clears this expiry.
    redis_connection().expire(_parked_key(task_id), HANDED_OFF_ENTRY_TTL_SECONDS)
    sig = signature(entry["signature"], app=current_app)
    headers = {**(sig.options.get("headers") or {}), HANDOFF_FENCE_HEADER: grant.fence}
    sig.apply_async(headers=headers)
    log.info("lock on %s handed to task %s (fence %d); task sent again", device, task_id, grant.fence)


def task_lock_abandon(*, device: str, task_id: str) -> None:
    """Forget a task that will not run: leave the queue, or release (and hand on) its lock."""
    holder = holder_name(HOLDER_KIND, task_id)
    task_unpark(task_id)
    if device_lock_dequeue(device, holder=holder):
        return
    state = device_lock_state(device)
    if state.holder == holder and state.fence is not None:
        device_lock_pass_on(device, holder=holder, fence=state.fence)


# --- the task base class ---------------------------------------------------------------


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    return value if value is not None else (request.headers or {}).get(name)


def _lease_keep(hold: LockHold, lease_seconds: float, stop: threading.Event) -> None:
    """Extend the lease every third of it until `stop`; flag and log a lost lock."""
    while not stop.wait(lease_seconds / 3):
        try:
            kept = device_lock_extend(
                hold.device, holder=hold.holder, fence=hold.fence, lease_seconds=lease_seconds
            )
        except RedisError as exc:
            log.warning("could not extend the lock of %s on %s: %s", hold.holder, hold.device, exc)
            continue
        if not kept and not stop.is_set():
            hold.lost.set()
            log.error(
                "%s lost its lock on %s (fence %d): the lease ran out and was reclaimed while the "
                "task still runs; only a device checking the fencing token is safe",
                hold.holder,
                hold.device,
                hold.fence,
            )
            return


def _lock_release(hold: LockHold) -> None:
    """Release the body's lock and start the next holder; failures are logged, not raised."""
    try:
        device_lock_pass_on(hold.device, holder=hold.holder, fence=hold.fence)
    except Exception:
        log.exception(
            "releasing %s on %s failed; the lease expires and the monitor passes the lock on",
            hold.holder,
            hold.device,
        )


class DeviceLockedTask(Task):
    """Task base class: the body runs holding its device's lock (see the module docstring)."""

    device_arg: str = "device"
    lock_priority: int = DEFAULT_LOCK_PRIORITY
    lock_lease_seconds: float = DEFAULT_LEASE_SECONDS

    @property
    def lock_fence(self) -> int | None:
        """The fencing token of the lock the running body holds (None outside a body)."""
        hold = _hold.get()
        return hold.fence if hold is not None else None

    @property
    def lock_held(self) -> bool:
        """False once the extender found the lease lost (the body should stop if it can)."""
        hold = _hold.get()
        return hold is not None and not hold.lost.is_set()

    def apply_async(self, args=None, kwargs=None, *, lock_priority: int | None = None, **options):
        """As Task.apply_async; `lock_priority` (0..9) places this call in the device's queue."""
        if lock_priority is not None:
            options["headers"] = {**(options.get("headers") or {}), PRIORITY_HEADER: lock_priority}
        return super().apply_async(args, kwargs, **options)

    def lock_device_for(self, args: tuple | list, kwargs: dict) -> str:
        """The device name a call's arguments carry in `device_arg`; ValueError if none."""
        try:
            bound = inspect.signature(self.run).bind_partial(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        device = bound.arguments.get(self.device_arg)
        if not isinstance(device, str) or not device:
            raise ValueError(f"{self.name}: argument {self.device_arg!r} must name a device, not {device!r}")
        return device

    def _lock_priority(self, request: Any) -> int:
        priority = _header(request, PRIORITY_HEADER)
        priority = self.lock_priority if priority is None else priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"{self.name}: lock priority must be an integer 0..9, not {priority!r}")
        return priority

    def __call__(self, *args, **kwargs):
        request = self.request
        if request.called_directly or request.is_eager:
            return self._call_inline(args, kwargs)
        device = self.lock_device_for(args, kwargs)
        grant = self._acquire_or_park(request, device)
        handed = _header(request, HANDOFF_FENCE_HEADER)
        if handed is not None and int(handed) != grant.fence:
            log.warning(
                "task %s was handed fence %s on %s but holds fence %d: its hand-off lease ran out first",
                request.id,
                handed,
                device,
                grant.fence,
            )
        return self._run_held(LockHold(device, grant.holder, grant.fence), self.run, args, kwargs)

    def _acquire_or_park(self, request: Any, device: str) -> Grant:
        """The device's lock for this task, or park it (raises Ignore: the run ends here).

        Holding the lock already (a hand-off, or a redelivery) is a grant too.
        """
        priority = self._lock_priority(request)
        # Parked before joining the queue: the hand-off can come before acquire returns.
        sig = self.signature_from_request(request)
        task_park(request.id, {"device": device, "lease_seconds": self.lock_lease_seconds, "signature": sig})
        outcome = device_lock_acquire(
            device,
            holder=holder_name(HOLDER_KIND, request.id),
            priority=priority,
            lease_seconds=self.lock_lease_seconds,
        )
        if isinstance(outcome, Queued):
            log.info("task %s[%s] parked behind %d on %s", self.name, request.id, outcome.position, device)
            raise Ignore()
        task_unpark(request.id)
        if isinstance(outcome, NotReady):
            log.warning("device locks are being rebuilt; %s[%s] is sent again", self.name, request.id)
            locks_rebuild()  # no-op when another process is already at it
            sig.apply_async(countdown=NOT_READY_RETRY_SECONDS)
            raise Ignore()
        return outcome

    def _call_inline(self, args: tuple, kwargs: dict):
        """A call outside a worker: nothing can send it again, so it runs only on a free device."""
        device = self.lock_device_for(args, kwargs)
        holder = holder_name(HOLDER_KIND, f"inline-{uuid.uuid4().hex}")
        outcome = device_lock_acquire(
            device, holder=holder, priority=self.lock_priority, lease_seconds=self.lock_lease_seconds
        )
        if not isinstance(outcome, Grant):
            if isinstance(outcome, Queued):
                device_lock_dequeue(device, holder=holder)
            raise DeviceBusy(f"{self.name}: device {device} is locked; send the task to a worker to wait")
        body = super().__call__ if self.request.called_directly else self.run
        return self._run_held(LockHold(device, holder, outcome.fence), body, args, kwargs)

    def _run_held(self, hold: LockHold, body, args: tuple, kwargs: dict):
        """Run the body with the lease kept alive; release and hand on however it ends."""
        token = _hold.set(hold)
        stop = threading.Event()
        extender = threading.Thread(
            target=_lease_keep,
            args=(hold, self.lock_lease_seconds, stop),
            name=f"lease-{hold.holder}",
            daemon=True,
        )
        extender.start()
        try:
            return body(*args, **kwargs)
        finally:
            stop.set()
            extender.join(EXTENDER_JOIN_SECONDS)
            _hold.reset(token)
            _lock_release(hold)


def device_locked_task(*args, device_arg: str = "device", **options):
    """`shared_task` whose body runs under its device's lock: @device_locked_task(bind=True)."""
    return shared_task(*args, base=DeviceLockedTask, device_arg=device_arg, **options)


@task_revoked.connect(dispatch_uid="devices.task_lock.revoked")
def _revoked_task_release(sender=None, request=None, **kwargs) -> None:
    """A revoked or expired locked task is dropped unrun: free its place or its lock now."""
    if not isinstance(sender, DeviceLockedTask) or request is None or not request.id:
        return
    try:
        device = sender.lock_device_for(request.args or (), request.kwargs or {})
    except ValueError:
        return
    task_lock_abandon(device=device, task_id=request.id)
