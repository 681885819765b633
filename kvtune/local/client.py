"""A small blocking HTTP client for vLLM's OpenAI server (stdlib and kvtune's P/D names only;
loopback use).

Blocking calls keep the P/D flow easy to follow; push mode runs its two legs on two threads.
"""
from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtune.vllm_pd import KV_TRANSFER_PARAMS


class HttpError(Exception):
    """A non-2xx response or a transport failure (internal; callers turn it into a kvtune error)."""

    def __init__(self, url: str, status: int | None, body: str) -> None:
        self.url, self.status, self.body = url, status, body
        super().__init__(f"{url}: HTTP {status if status is not None else 'transport error'}: "
                         f"{body[:2000]}")


@dataclass(frozen=True)
class CompletionResponse:
    """One ``/v1/completions`` call, with client-side timings in milliseconds."""

    body: dict[str, Any]
    """The JSON body (for streams: the last chunk, merged text and token ids filled in)."""
    text: str
    token_ids: tuple[int, ...]
    kv_transfer_params: dict[str, Any] | None
    elapsed_ms: float
    first_token_ms: float | None
    """Request sent -> first generated token seen (streams only; None otherwise)."""


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise HttpError(url, None, "expected an http://host:port URL")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    return conn, parts.path.rstrip("/")


def get(url: str, path: str, *, timeout_s: float = 10.0) -> tuple[int, str]:
    """GET ``url+path``; returns (status, body text). Transport errors raise ``HttpError``."""
    conn, base = _connection(url, timeout_s)
    try:
        conn.request("GET", base + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        raise HttpError(url + path, None, repr(exc)) from exc
    finally:
        conn.close()


def complete(url: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
             timeout_s: float = 300.0) -> CompletionResponse:
    """POST ``/v1/completions``; streams when ``body["stream"]`` is true (to time the first
    token)."""
    conn, base = _connection(url, timeout_s)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    stream = bool(body.get("stream"))
    t0 = time.perf_counter()
    try:
        conn.request("POST", base + "/v1/completions", body=json.dumps(body).encode(),
                     headers=hdrs)
        resp = conn.getresponse()
        if resp.status // 100 != 2:
            raise HttpError(url + "/v1/completions", resp.status,
                            resp.read().decode("utf-8", "replace"))
        if not stream:
            data = json.loads(resp.read())
            elapsed = (time.perf_counter() - t0) * 1e3
            choice = data["choices"][0]
            return CompletionResponse(
                body=data, text=choice.get("text") or "",
                token_ids=tuple(choice.get("token_ids") or ()),
                kv_transfer_params=data.get(KV_TRANSFER_PARAMS),
                elapsed_ms=elapsed, first_token_ms=None)
        return _read_stream(url, resp, t0)
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as exc:
        raise HttpError(url + "/v1/completions", None, repr(exc)) from exc
    finally:
        conn.close()


def _read_stream(url: str, resp: http.client.HTTPResponse, t0: float) -> CompletionResponse:
    text: list[str] = []
    token_ids: list[int] = []
    first_ms: float | None = None
    last: dict[str, Any] = {}
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise HttpError(url + "/v1/completions", None, payload)
        last = chunk
        for choice in chunk.get("choices") or ():
            piece_ids = choice.get("token_ids") or ()
            piece_text = choice.get("text") or ""
            if (piece_ids or piece_text) and first_ms is None:
                first_ms = (time.perf_counter() - t0) * 1e3
            token_ids.extend(piece_ids)
            text.append(piece_text)
    elapsed = (time.perf_counter() - t0) * 1e3
    return CompletionResponse(body=last, text="".join(text), token_ids=tuple(token_ids),
                              kv_transfer_params=last.get(KV_TRANSFER_PARAMS),
                              elapsed_ms=elapsed, first_token_ms=first_ms)
