"""A small blocking HTTP client for talking to the router (tests, benchmarks, the tune job)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class HttpResult:
    """One HTTP answer: status, headers and the whole body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_events(self) -> list[dict[str, Any]]:
        """The JSON events of an SSE body (``data: [DONE]`` and non-JSON lines left out)."""
        return parse_sse(self.body)

    def text(self) -> str:
        """The generated text: from a JSON completion or chat answer, or joined from SSE events."""
        if self.body.lstrip().startswith(b"data:"):
            parts = []
            for event in self.sse_events():
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    parts.append(choice.get("text") or delta.get("content") or "")
            return "".join(parts)
        choice = self.json()["choices"][0]
        return choice.get("text") if "text" in choice else choice["message"]["content"]


def parse_sse(body: bytes) -> list[dict[str, Any]]:
    events = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def request(method: str, url: str, body: Mapping[str, Any] | bytes | None = None, *,
            headers: Mapping[str, str] | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> HttpResult:
    """Send one request; HTTP error statuses are returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return HttpResult(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as exc:
        return HttpResult(exc.code, dict(exc.headers), exc.read())


def post(url: str, body: Mapping[str, Any] | bytes, *, headers: Mapping[str, str] | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> HttpResult:
    return request("POST", url, body, headers=headers, timeout_s=timeout_s)


def get(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> HttpResult:
    return request("GET", url, timeout_s=timeout_s)
