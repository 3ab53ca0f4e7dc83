"""A reference device on the agent library: the conformance kit's actions plus a lamp's `on`.

    python -m iotqueue_device.example --mqtt-url mqtt://broker:1883 --device lamp-2 \
        --password '<its password>' --state-dir /var/lib/lamp-2

Runs until SIGINT or SIGTERM, then stops gracefully (retained "offline").
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from .agent import Agent
from .conformance.actions import actions_register
from .protocol import DEFAULT_PREFIX


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m iotqueue_device.example", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--mqtt-url", required=True, help="mqtt://host:port or mqtts://host:port")
    parser.add_argument("--device", required=True, help="the device's name in iotqueue")
    parser.add_argument("--password", default=None, help="the device's broker password")
    parser.add_argument("--certfile", default=None, help="client certificate (PEM), instead of a password")
    parser.add_argument("--keyfile", default=None, help="the client certificate's key (PEM)")
    parser.add_argument("--cafile", default=None, help="CA certificate to verify the broker (mqtts)")
    parser.add_argument("--state-dir", default=None, help="where the device keeps its state across reboots")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"topic prefix (default {DEFAULT_PREFIX})")
    parser.add_argument("--heartbeat", type=float, default=30.0, help="seconds between heartbeats")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    agent = Agent(
        args.device,
        args.mqtt_url,
        password=args.password,
        certfile=args.certfile,
        keyfile=args.keyfile,
        cafile=args.cafile,
        state_dir=args.state_dir,
        prefix=args.prefix,
        heartbeat_seconds=args.heartbeat,
    )
    actions_register(agent)

    @agent.action("on")
    def on(ctx):
        return {"level": ctx.args.get("level", 100)}

    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    agent.start()
    logging.info("iotqueue-device %s: running", args.device)
    stopping.wait()
    agent.stop()


if __name__ == "__main__":
    main()
