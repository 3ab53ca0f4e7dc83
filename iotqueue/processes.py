"""Child processes of the dev stack and the test suite: worker, beat, bridge, web, simulator.

One Supervisor owns the children it started and stops only those, by PID: SIGTERM, a
grace period, then SIGKILL. Children log to files so a failure can show its log tail.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .servers import argv_dying_with_owner

BASE_DIR = Path(__file__).resolve().parent.parent
MANAGE = str(BASE_DIR / "manage.py")
# A child gets this long to exit after SIGTERM before it is killed; Celery's warm
# shutdown finishes the (millisecond) step tasks it is running well within it.
STOP_GRACE_SECONDS = 10.0


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "iotqueue", *args]


def worker_argv(*, concurrency: int = 2, hostname: str = "worker") -> list[str]:
    return celery_argv(
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        f"--hostname={hostname}@%h",
        "--without-gossip",
        "--without-mingle",
        "--loglevel=INFO",
    )


def beat_argv(state_dir: Path, *, scheduler: str = "") -> list[str]:
    """Beat with the configured scheduler, or e.g. celery.beat:PersistentScheduler (a file)."""
    extra = [f"--scheduler={scheduler}", f"--schedule={state_dir / 'beat-schedule'}"] if scheduler else []
    return celery_argv("beat", "--loglevel=INFO", f"--pidfile={state_dir / 'beat.pid'}", *extra)


def manage_argv(*args: str) -> list[str]:
    return [sys.executable, MANAGE, *args]


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class Supervisor:
    """Starts named children with a shared environment and stops them all on exit."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: dict[str, Child] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], *, extra_env: dict[str, str] | None = None) -> Child:
        child = self.children.get(name) or Child(
            name, argv, {**self.env, **(extra_env or {})}, self.log_dir / f"{name}.log"
        )
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                argv_dying_with_owner(child.argv),
                cwd=BASE_DIR,
                env=child.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group, so kill() can take a worker's pool children too.
                start_new_session=True,
            )
        self.children[name] = child
        return child

    def wait_for_log(self, name: str, pattern: str, *, timeout: float = 30.0, since: int = 0) -> None:
        """Block until the child's log (after byte offset `since`) matches `pattern`."""
        child = self.children[name]
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if regex.search(child.log_text()[since:]):
                return
            if not child.alive():
                raise RuntimeError(f"{name} exited ({child.process.returncode}):\n{child.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{name} did not log {pattern!r} within {timeout}s:\n{child.log_tail()}")

    def log_size(self, name: str) -> int:
        return len(self.children[name].log_text())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a child's whole process group (a Celery worker's pool children too)."""
        child = self.children[name]
        if child.alive():
            os.killpg(child.pid, sig)
            if sig == signal.SIGKILL:
                child.process.wait()

    def stop(self, name: str) -> None:
        child = self.children.get(name)
        if child is None or not child.alive():
            return
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.children)):
            self.stop(name)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
