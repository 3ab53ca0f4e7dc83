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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .servers import argv_dying_with_owner

BASE_DIR = Path(__file__).resolve().parent.parent
MANAGE = str(BASE_DIR / "manage.py")
# How often exited children are noticed and restarted.
WATCH_SECONDS = 0.5
# A child gets this long to exit after SIGTERM before it is killed; Celery's warm
# shutdown finishes the (millisecond) step tasks it is running well within it.
STOP_GRACE_SECONDS = 10.0


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "iotqueue", *args]


def worker_argv(
    *, concurrency: int = 2, hostname: str = "worker", include: list[str] | None = None
) -> list[str]:
    """A prefork worker; `include` names extra task modules to import (e.g. test-only tasks)."""
    return celery_argv(
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        f"--hostname={hostname}@%h",
        "--without-gossip",
        "--without-mingle",
        "--loglevel=INFO",
        *([f"--include={','.join(include)}"] if include else []),
    )


def beat_argv(state_dir: Path, *, scheduler: str = "") -> list[str]:
    """Beat with the configured scheduler, or e.g. iotqueue.beat_lease:LeasedPersistentScheduler (a file)."""
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
    # Restart the child when it exits on its own (what systemd or compose would do).
    restart: bool = False
    # Set while a stop or kill is deliberate, so the watcher leaves the child down.
    held: bool = False
    restarts: int = 0

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
    """Starts named children with a shared environment and stops them all on exit.

    Children started with restart=True are restarted when they exit on their own, like a
    process manager does in production: Celery 5.7 can exit with "Unrecoverable error"
    when Redis drops the connection while it holds unacknowledged tasks.
    """

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: dict[str, Child] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, argv: list[str], *, extra_env: dict[str, str] | None = None, restart: bool = False
    ) -> Child:
        with self._lock:
            child = self.children.get(name) or Child(
                name, argv, {**self.env, **(extra_env or {})}, self.log_dir / f"{name}.log", restart=restart
            )
            # Started again, it may be with other arguments (the web server on another port).
            child.argv = argv
            self._spawn(child)
            self.children[name] = child
        if child.restart and self._watcher is None:
            # The watcher must outlive what it starts: children die with the thread that forked them.
            self._watcher = threading.Thread(target=self._watch, name="supervisor-watch", daemon=True)
            self._watcher.start()
        return child

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_SECONDS):
            with self._lock:
                for child in self.children.values():
                    if child.restart and not child.held and not child.alive() and not self._closing.is_set():
                        child.restarts += 1
                        note = f"\n--- supervisor: exited ({child.process.returncode}); restarting\n"
                        with open(child.log_path, "ab") as log:
                            log.write(note.encode())
                        self._spawn(child)

    def _spawn(self, child: Child) -> None:
        child.held = False
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
        """How much `name`'s log holds now (also before it first starts: logs are appended
        across runs), for `wait_for_log(since=...)`."""
        if name in self.children:
            return len(self.children[name].log_text())
        path = self.log_dir / f"{name}.log"
        return len(path.read_text(errors="replace")) if path.exists() else 0

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a child's whole process group (a Celery worker's pool children too).

        A killed child stays down (no automatic restart) until start() is called again.
        """
        child = self.children[name]
        child.held = True
        if child.alive():
            os.killpg(child.pid, sig)
            if sig == signal.SIGKILL:
                child.process.wait()

    def stop(self, name: str) -> None:
        self._stop_many([name])

    def stop_all(self) -> None:
        """Stop every child, all at once: each gets SIGTERM now and its grace period runs
        alongside the others' (one after another, the warm shutdowns added up)."""
        self._closing.set()
        self._stop_many(list(reversed(list(self.children))))

    def _stop_many(self, names: list[str]) -> None:
        """SIGTERM each child named, then wait for each, killing the ones still up when
        STOP_GRACE_SECONDS have passed since the signal."""
        stopping = []
        for name in names:
            child = self.children.get(name)
            if child is None:
                continue
            child.held = True
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
                stopping.append(child)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in stopping:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
