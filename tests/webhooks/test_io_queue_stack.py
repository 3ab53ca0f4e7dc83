"""Webhook deliveries on their own queue and worker (IOTQUEUE_IO_QUEUE): a receiver that
hangs does not hold up the engine (docs/operations.md#queues)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunStatus
from jobs.services import run_start
from tests.conftest import READY, io_worker_argv, wait_for
from tests.factories import DeviceFactory, template_with_steps
from webhooks.models import EVENT_KINDS, Delivery, Webhook

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

RUNS = 10
# The receiver answers when the test lets it, or after this long: far beyond the runs.
HANG_SECONDS = 60


class HangingReceiver:
    """An HTTP receiver that holds every delivery until released (at most HANG_SECONDS)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.arrived.set()
                receiver.release.wait(HANG_SECONDS)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/hook"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_io_worker(stack, services):
    """The io queue's worker, with a webhook timeout longer than the receiver's hang: an
    attempt returns only when the receiver answers."""
    stack.supervisor.stop("worker-io")
    name = "worker-io-patient"
    offset = stack.supervisor.log_size(name)
    argv = io_worker_argv(f"{services.namespace}-io")
    stack.supervisor.start(name, argv, extra_env={"IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS": str(HANG_SECONDS * 2)})
    stack.supervisor.wait_for_log(name, READY["worker-io"], since=offset)
    yield
    stack.supervisor.stop(name)
    stack.restart("worker-io")


def succeeded(runs: list[JobRun]) -> bool:
    done = JobRun.objects.filter(pk__in=[run.pk for run in runs], status=RunStatus.SUCCEEDED)
    return done.count() == len(runs)


def test_a_hanging_webhook_receiver_does_not_hold_up_the_engine(stack, simulator, slow_io_worker):
    # given a receiver that hangs on every delivery, subscribed to every run event
    receiver = HangingReceiver()
    try:
        Webhook.objects.create(name="slow", url=receiver.url, events=list(EVENT_KINDS))
        devices = [DeviceFactory() for _ in range(RUNS)]
        simulator({device.name: DeviceBehaviour() for device in devices})
        # and a first run whose events keep the io worker in an HTTP call
        first, _ = run_start(template=template_with_steps((devices[0], "a", {})))
        wait_for(receiver.arrived.is_set, what="the first delivery to reach the receiver")

        # when ten more runs go through while that delivery hangs
        runs = [run_start(template=template_with_steps((device, "b", {})))[0] for device in devices]

        # then every run succeeds before any delivery attempt has come back
        wait_for(lambda: succeeded([first, *runs]), what="every run to succeed")
        assert not Delivery.objects.filter(attempts__gt=0).exists()
        assert Delivery.objects.exists()  # the events were there to deliver, waiting on the io queue
    finally:
        receiver.stop()
