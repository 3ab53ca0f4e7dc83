"""The demo's devices played by the device agent library (iotqueue_device.Agent), as a
firmware team would write them: one handler per action, progress and extend_seconds on the
firmware update, a state directory so a restarted process asks jobs/get and carries on.

`manage.py demo_devices` (devtools/management/commands/demo_devices.py) runs them for the dev
stack; the demo's rows say `{"simulator": false}`, so the simulator leaves them to it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from iotqueue_device import Agent, Context

# How long a demo device takes over a command, like the simulator's `make run` latency: long
# enough to watch runs wait for lamp-2 in the progress display, short enough for a quick demo.
WORK_SECONDS = (0.2, 0.7)
# What the firmware update asks for, early, with its first progress (v1.1 extend_seconds):
# within every step's default max_extend_seconds (3600).
FLASH_EXTEND_SECONDS = 300


def _work() -> None:
    time.sleep(random.uniform(*WORK_SECONDS))


def _result(ctx: Context, device: str, **extra: Any) -> dict[str, Any]:
    """The simulator's result shape, which the demo's templates read ({{ params.previous.action }})."""
    return {"device": device, "action": ctx.action, "echo": ctx.args, **extra}


def demo_agent(name: str, url: str, *, password: str | None, state_dir: Path, prefix: str) -> Agent:
    """One demo device: the handlers of every action the demo's templates send."""
    agent = Agent(
        name, url, password=password, state_dir=str(state_dir), prefix=prefix, heartbeat_seconds=10.0
    )

    def plain(ctx: Context) -> dict[str, Any]:
        ctx.progress(50, f"{ctx.action} under way")
        _work()
        return _result(ctx, name)

    def firmware_update(ctx: Context) -> dict[str, Any]:
        ctx.progress(
            5, f"downloading {ctx.args.get('version', '')}".strip(), extend_seconds=FLASH_EXTEND_SECONDS
        )
        _work()
        ctx.progress(60, "flashing")
        _work()
        return _result(ctx, name, version=ctx.args.get("version"))

    for action in ("unlock", "on", "snapshot", "start"):
        agent.action(action)(plain)
    agent.action("firmware/update")(firmware_update)
    return agent
