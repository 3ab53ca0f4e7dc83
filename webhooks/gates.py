"""A wave's webhook gate (jobs/engine/waves.py): ask an outside system whether the next wave may open.

The task POSTs what the rollout did to the gate's URL and hands the answer to
jobs/rollouts.py: a 2xx answer whose JSON body is {"approve": true} opens the next wave;
any other answer, an error or a timeout pauses the rollout with what happened as the
reason. It runs on the io queue (IOTQUEUE_IO_TASKS), never in a request nor in the engine.

How it fails: the URL is checked as a webhook's is (webhooks/addresses.py: no loopback,
private or metadata address unless IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS allows it), and the
connection goes to the address that was checked; redirects are not followed; the wait is
IOTQUEUE_WAVE_GATE_TIMEOUT_SECONDS at most. A task that is lost (a broker away when the
wave ended) leaves the rollout awaiting the webhook until the monitor's sweep asks again
(jobs/engine/wave_gates.py `gates_unanswered`), or an operator decides.
"""

from __future__ import annotations

import http.client
import json

from django.conf import settings

from jobs.rollouts import rollout_gate_answer, rollout_gate_request

from . import addresses
from .delivery import ERROR_MAX_CHARS, _PinnedHTTPConnection, _PinnedHTTPSConnection, request_body

WAVE_GATE_TASK = "webhooks.wave_gate"
# The most of an answer read: {"approve": true} and a reason fit many times over.
ANSWER_READ_BYTES = 4096


def gate_post(url: str, body: dict) -> tuple[bool, str]:
    """(approve, what happened): POST `body` to `url` and read its answer. Never raises for
    the receiver's failures: they are a refusal with the reason."""
    try:
        target = addresses.target_resolve(url)
    except addresses.AddressRefused as exc:
        return False, f"no request made: {exc}"[:ERROR_MAX_CHARS]
    connection_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    connection = connection_class(target, settings.IOTQUEUE_WAVE_GATE_TIMEOUT_SECONDS)
    headers = {"Content-Type": "application/json", "User-Agent": "iotqueue-wave-gate"}
    try:
        connection.request("POST", target.path, body=request_body(body), headers=headers)
        response = connection.getresponse()
        text = response.read(ANSWER_READ_BYTES)
        status = response.status
    except (OSError, ValueError, http.client.HTTPException) as exc:  # timeouts, refused, TLS
        return False, f"{type(exc).__name__}: {exc}"[:ERROR_MAX_CHARS]
    finally:
        connection.close()
    if not 200 <= status < 300:
        return False, f"HTTP {status}"
    try:
        answer = json.loads(text)
    except ValueError:
        return False, f"HTTP {status}, not a JSON answer"
    if isinstance(answer, dict) and answer.get("approve") is True:
        return True, f"HTTP {status}, approve"
    return False, f"HTTP {status}, not approved"


def wave_gate_ask(*, run_id: str, index: int, wave: int) -> None:
    """Ask the gate after `wave` of the run's step `index`, if the rollout still waits for it."""
    request = rollout_gate_request(run_id=run_id, index=index, wave=wave)
    if request is None:
        return
    approve, detail = gate_post(request["url"], request["body"])
    rollout_gate_answer(run_id=run_id, index=index, wave=wave, approve=approve, detail=detail)
