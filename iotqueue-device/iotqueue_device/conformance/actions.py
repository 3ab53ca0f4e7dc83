"""The three actions the conformance kit sends: a device under test wires them up (in its
test build) so the kit can drive it. `actions_register(agent)` does it for an `Agent`.

- `conformance/echo`: one progress, then done ok with `{"echo": args}`;
- `conformance/slow`: progress every PROGRESS_EVERY_SECONDS for `args.seconds`, then done ok
  with `{"resumed": bool}` (the kit reboots the device in the middle of it);
- `conformance/reject`: done with `"status": "rejected"`.
"""

from __future__ import annotations

import time
from typing import Any

ECHO, SLOW, REJECT = "conformance/echo", "conformance/slow", "conformance/reject"
# How often the slow action reports progress: the kit waits for the first one before it
# reboots the device, and a superseded or stopped command ends at its next report.
PROGRESS_EVERY_SECONDS = 0.2
REJECT_REASON = "conformance: refused on purpose"


def echo(ctx) -> dict[str, Any]:
    ctx.progress(50, "echoing")
    return {"echo": ctx.args}


def slow(ctx) -> dict[str, Any]:
    seconds = float(ctx.args.get("seconds", 2))
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        ctx.progress(min(99, int(100 * elapsed / seconds)), "working slowly")
        time.sleep(PROGRESS_EVERY_SECONDS)
    return {"resumed": ctx.resumed}


def reject(ctx) -> None:
    ctx.reject(REJECT_REASON)


def actions_register(agent) -> None:
    """Handle the kit's three actions on this agent."""
    for name, handler in ((ECHO, echo), (SLOW, slow), (REJECT, reject)):
        agent.action(name)(handler)
