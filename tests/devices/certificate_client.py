"""A certificate device for tests: a paho client on the broker's mTLS listener, recording what happens."""

from __future__ import annotations

import queue
import ssl
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt

from devices import certificates

# How long a test waits for the broker's answer (CONNACK, SUBACK, PUBACK, a kick).
ANSWER_SECONDS = 10.0


@dataclass(frozen=True)
class CertificateFiles:
    """The PEM files a certificate device holds."""

    certificate: Path
    key: Path
    ca: Path


def files_for(directory: Path, *, certificate_pem: str, key_pem: str, ca_pem: str) -> CertificateFiles:
    paths = certificates.files_write(
        directory, {"device.crt": certificate_pem, "device.key": key_pem, "ca.crt": ca_pem}
    )
    return CertificateFiles(paths["device.crt"], paths["device.key"], paths["ca.crt"])


class CertificateClient:
    """An MQTT v5 client logging in with a client certificate only (no user name, no password).

    Every broker answer lands in `events` as (kind, value): ("connack", ReasonCode),
    ("disconnect", ReasonCode), ("suback", [failed?...]), ("puback", ReasonCode),
    ("refused", error) when the TLS handshake or the socket failed. It does not reconnect on
    its own: `connect()` again to see what the broker does with a new connection.
    """

    def __init__(self, tls_url: str, files: CertificateFiles, *, client_id: str | None = None) -> None:
        self.address = urlsplit(tls_url)
        self.events: queue.Queue = queue.Queue()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id if client_id is not None else f"sdk-{uuid.uuid4().hex}",
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,  # the test connects again itself, to see each answer
        )
        self.client.tls_set(
            ca_certs=str(files.ca),
            certfile=str(files.certificate),
            keyfile=str(files.key),
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
        self.client.on_connect = lambda c, u, f, code, p: self.events.put(("connack", code))
        self.client.on_disconnect = lambda c, u, f, code, p: self.events.put(("disconnect", code))
        self.client.on_subscribe = lambda c, u, mid, codes, p: self.events.put(
            ("suback", [x.is_failure for x in codes])
        )
        self.client.on_publish = lambda c, u, mid, code, p: self.events.put(("puback", code))

    def connect(self) -> tuple[str, object]:
        """Open a connection; returns the first answer: ("connack", code) or ("refused"/"disconnect", why)."""
        try:
            self.client.connect(self.address.hostname, self.address.port)
        except (OSError, ssl.SSLError) as exc:
            return ("refused", exc)
        self.client.loop_start()
        return self.next_event()

    def next_event(self) -> tuple[str, object]:
        return self.events.get(timeout=ANSWER_SECONDS)

    def subscribe(self, *topics: str) -> list[bool]:
        """Subscribe; which of the topics the broker refused (True = refused)."""
        self.client.subscribe([(topic, 1) for topic in topics])
        kind, failed = self.next_event()
        assert kind == "suback", (kind, failed)
        return failed

    def publish_refused(self, topic: str) -> bool:
        """Publish at QoS 1; whether the broker's PUBACK says not authorised (MQTT v5 reason code)."""
        self.client.publish(topic, b"{}", qos=1)
        kind, code = self.next_event()
        assert kind == "puback", (kind, code)
        return code.is_failure

    def close(self) -> None:
        """Disconnect and forget what was recorded (our own disconnect included)."""
        self.client.disconnect()
        self.client.loop_stop()
        while not self.events.empty():
            self.events.get_nowait()
