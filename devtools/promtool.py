"""Checking the shipped Prometheus alert rules with promtool (`make alerts-test`).

`promtool check rules` validates deploy/prometheus/alerts.yml and `promtool test rules`
runs deploy/prometheus/alerts_test.yml: for each rule, sample series that make it fire and
series that do not. promtool comes with Debian's `prometheus` package, which a fresh
machine may lack: `python -m devtools.promtool install` installs it when running as root
and says what to run otherwise; `python -m devtools.promtool` installs it if needed and runs
both checks. `make test` and `make test-fast` install it first, so tests/unit/test_alert_rules.py
runs the checks there. docs/operations.md, "Alert rules".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
RULES_DIR = PROJECT_DIR / "deploy" / "prometheus"
ALERTS = RULES_DIR / "alerts.yml"
ALERTS_TEST = RULES_DIR / "alerts_test.yml"
APT_PACKAGES = ("prometheus",)
INSTALL_COMMAND = f"apt-get update && apt-get install -y --no-install-recommends {' '.join(APT_PACKAGES)}"


class PromtoolMissing(RuntimeError):
    """promtool is not installed, and this process cannot install it."""


def promtool_path() -> str | None:
    return shutil.which("promtool")


def promtool_install() -> None:
    """Install Debian's prometheus (which brings promtool) when promtool is missing.

    How it fails: not running as root (or without apt-get), it raises PromtoolMissing naming
    the command to run; apt-get failing raises CalledProcessError (its output says why).
    """
    if promtool_path():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PromtoolMissing(
            f"promtool is missing: as root run `{INSTALL_COMMAND}` "
            "(or `python -m devtools.promtool install`; elsewhere, a Prometheus release's promtool on PATH)"
        )
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=environment)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    subprocess.run(install, check=True, env=environment)
    if not promtool_path():
        raise PromtoolMissing(f"{APT_PACKAGES} installed, yet promtool is still missing")


def rules_check() -> subprocess.CompletedProcess:
    """`promtool check rules` then `promtool test rules`; the second one's result (output captured).

    Raises PromtoolMissing without promtool, CalledProcessError (output attached) when a check fails.
    """
    promtool = promtool_path()
    if not promtool:
        raise PromtoolMissing(f"promtool is missing: as root run `{INSTALL_COMMAND}`")
    subprocess.run([promtool, "check", "rules", str(ALERTS)], check=True, capture_output=True, text=True)
    test = [promtool, "test", "rules", str(ALERTS_TEST)]
    return subprocess.run(test, check=True, capture_output=True, text=True, cwd=RULES_DIR)


def main(argv: list[str]) -> int:
    try:
        promtool_install()
        if argv[:1] != ["install"]:
            print(rules_check().stdout, end="")
    except PromtoolMissing as missing:
        print(missing, file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as failed:
        print(failed.stdout, failed.stderr, sep="\n", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
