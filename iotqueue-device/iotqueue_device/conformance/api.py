"""The few calls of iotqueue's REST API the kit makes (standard library only): make sure a
one-step template exists, start a run, read it, cancel it. Authenticated with an API token
(`Authorization: Token ...`, docs/operations.md)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

# Each REST call's bound: a stalled server fails the case instead of hanging the kit.
HTTP_TIMEOUT_SECONDS = 15.0
TERMINAL = {"succeeded", "failed", "timed_out", "canceled", "compensated"}


class ApiError(RuntimeError):
    """iotqueue answered with an error status (the message has the status and body)."""


class Api:
    def __init__(self, base_url: str, token: str) -> None:
        self.base = base_url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """One request; returns (status, JSON body). Raises ApiError for 4xx/5xx (except a
        404, returned for the caller to judge) and OSError when iotqueue cannot be reached."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        request.add_header("Authorization", f"Token {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SECONDS) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            if exc.code == 404:
                return 404, None
            raise ApiError(f"{method} {path}: {exc.code} {text[:300]}") from None

    def template_ensure(self, name: str, step: dict[str, Any]) -> None:
        """A template `name` with this one step: created, or replaced when it exists."""
        body = {"name": name, "description": "iotqueue-device conformance kit", "steps": [step]}
        path = f"/api/templates/{quote(name, safe='')}/"
        status, _ = self.call("GET", path)
        if status == 404:
            self.call("POST", "/api/templates/", body)
        else:
            self.call("PUT", path, body)

    def run_start(self, template: str) -> str:
        """Start a run of the template; its id."""
        _, body = self.call("POST", "/api/runs/", {"template": template})
        return str(body["id"])

    def run_get(self, run_id: str) -> dict[str, Any]:
        _, body = self.call("GET", f"/api/runs/{run_id}/")
        return body

    def run_cancel(self, run_id: str) -> None:
        """Cancel a run (no error when it has ended meanwhile)."""
        try:
            self.call("POST", f"/api/runs/{run_id}/cancel/")
        except ApiError as exc:
            if " 409 " not in str(exc):
                raise
