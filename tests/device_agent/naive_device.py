"""Deliberately broken devices for the conformance kit's own test: what firmware gets wrong.

`NaiveDevice` runs every command it receives, in order, and answers ack, progress and done:
no dedupe by id, no token or deadline rules, no cancel. `wrong_id=True` also answers with an
id of its own making instead of the command's.
"""

from __future__ import annotations

import json
import queue
import threading
import time

from iotqueue_device.conformance.actions import REJECT, SLOW

from tests.mqtt_device import COMMAND_WAIT_SECONDS, mqtt_client


class NaiveDevice:
    def __init__(
        self, name: str, url: str, prefix: str, *, password: str | None, wrong_id: bool = False
    ) -> None:
        self.base, self.wrong_id = f"{prefix}/{name}", wrong_id
        self.commands: queue.Queue[dict | None] = queue.Queue()
        self.client = mqtt_client(url, username=name if password else None, password=password)
        # Only its command topics: amqtt (the pip broker) has been seen to hand a new
        # subscriber another device's retained status along with its SUBACK.
        self.client.on_message = lambda c, u, m: (
            self.commands.put(json.loads(m.payload)) if m.topic.startswith(f"{self.base}/cmd/") else None
        )
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.subscribe(f"{self.base}/cmd/#", qos=1)
        if not subscribed.wait(COMMAND_WAIT_SECONDS):
            raise TimeoutError(f"{name}: no SUBACK from the broker")
        self.client.publish(f"{self.base}/status", "online", qos=1, retain=True)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (command := self.commands.get()) is not None:
            reply_id = f"{command['id']}-mine" if self.wrong_id else command["id"]
            self._reply("ack", {"id": reply_id})
            self._reply("progress", {"id": reply_id, "progress": 50})
            if command.get("action") == SLOW:
                time.sleep(float(command["args"].get("seconds", 1)))
            if command.get("action") == REJECT:
                self._reply("done", {"id": reply_id, "ok": False, "status": "rejected", "error": "no"})
            else:
                self._reply("done", {"id": reply_id, "ok": True, "result": {"echo": command.get("args")}})

    def _reply(self, kind: str, body: dict) -> None:
        self.client.publish(f"{self.base}/{kind}", json.dumps(body), qos=1)

    def close(self) -> None:
        self.commands.put(None)
        self.client.publish(f"{self.base}/status", "offline", qos=1, retain=True).wait_for_publish(5)
        self.client.loop_stop()
        self.client.disconnect()
