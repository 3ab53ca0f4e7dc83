"""`python -m iotqueue_device.conformance`: run the kit against a device and a running iotqueue."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

from ..protocol import DEFAULT_PREFIX, Topics
from .api import Api
from .kit import FAIL, Kit, table
from .observer import Observer

EXIT_FAILED = 1


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m iotqueue_device.conformance",
        description="Drive a device through iotqueue's device protocol cases and print a pass/fail table.",
    )
    parser.add_argument(
        "--mqtt-url",
        required=True,
        help="the broker, as a user that may read the device's topics and publish its commands "
        "(e.g. iotqueue's service user): mqtt://user:password@host:1883",
    )
    parser.add_argument("--cafile", default=None, help="CA certificate to verify an mqtts:// broker")
    parser.add_argument("--device", required=True, help="the device under test's name in iotqueue")
    parser.add_argument("--api", required=True, help="iotqueue's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--token", required=True, help="an API token of a user who may add templates and runs"
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"topic prefix (default {DEFAULT_PREFIX})")
    parser.add_argument("--wait", type=float, default=15.0, help="seconds to wait for each expected message")
    parser.add_argument(
        "--reboot-command",
        default=None,
        help="a shell command that reboots the device (returns once it is rebooting); without it "
        "the kit asks at a terminal, or skips the reboot case",
    )
    return parser.parse_args(argv)


def reboot_hook(command: str | None) -> Callable[[], None] | None:
    """How the kit reboots the device: the given command, the operator at a terminal, or not."""
    if command:
        return lambda: subprocess.run(command, shell=True, check=True)
    if sys.stdin.isatty():
        return lambda: input(
            "Reboot the device now (power-cycle it or restart its process), then press Enter: "
        )
    return None


def main(argv: list[str] | None = None, *, reboot: Callable[[], None] | None = None) -> int:
    """Run the kit; returns the exit status (0: every case passed or was skipped). `reboot`
    replaces --reboot-command for callers in Python (tests)."""
    args = arguments(argv)
    observer = Observer(args.mqtt_url, Topics(args.device, args.prefix), cafile=args.cafile)
    try:
        kit = Kit(
            Api(args.api, args.token),
            observer,
            args.device,
            reboot=reboot or reboot_hook(args.reboot_command),
            wait=args.wait,
        )
        results = kit.run()
    finally:
        observer.close()
    print(table(results))
    return EXIT_FAILED if any(result.outcome == FAIL for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
