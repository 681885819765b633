"""The router's side of the renewable decode lease (bidirectional mode; off by default).

The decode side and the whole design are in :mod:`kvtune.connectors.lease`. Here, with
``lease_s`` set in the router's config:

- after a turn whose decode answered with :data:`kvtune.vllm_pd.PARAMS_LEASE_PORT`, the router
  renews the decode's hold on that turn's blocks every ``lease_renew_every_s`` for ``lease_s``,
  as long as the conversation is live: until ``lease_idle_s`` pass with no new turn, or an
  explicit end;
- when the next turn claims the stored params it renews once more and gives the prefill the
  deadline the decode answered as ``remote_blocks_expiry_time`` (the expiry vLLM's prefill
  checks); a renewal that fails, or leaves under :data:`kvtune.vllm_pd.MIN_ROUTER_MARGIN_S`,
  withholds the history (the turn recomputes it) rather than let the prefill decline a read;
- an explicit end - the :data:`END_HEADER` on a turn (its blocks are released after it, not kept)
  or ``POST`` :data:`END_PATH` (``{"conversation_id": ...}`` or the conversation header; the
  tenant header as on completions) - forgets the stored params first, then releases the blocks;
- a decode that answers without the lease port keeps vLLM's fixed TTL: its params are offered
  only within the router's usual ``decoder_ttl_s - margin_s`` of being stored, and ``/health``
  (``decode_lease``) says which decodes hold a lease and which a fixed TTL.

Leases are held in this process's memory: a router that stops renews nothing, and the decode's
blocks lapse. Stored params that outlive a router restart are offered only after a successful
renewal.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

from aiohttp import web

from kvtune import spans, vllm_pd as pd
from kvtune.redact import redact_url
from kvtune.router import binding
from kvtune.router.config import RouterConfig
from kvtune.router.state import ConversationStore, InvalidConversationId, check_conversation_id

_log = logging.getLogger(__name__)

END_HEADER: Final = "X-Kvtune-Conversation-End"
"""Request header: a true value (``1``, ``true``, ``yes``) says this turn is the conversation's
last: its decode blocks are released after the answer instead of being kept."""
END_PATH: Final = "/v1/conversations/end"
"""``POST`` endpoint: the conversation is over; its held decode blocks are released now."""
CHANNEL_TIMEOUT_S: Final = 2.0
"""Bound on one lease-channel exchange (loopback: well under a millisecond normally)."""
MAX_REPLY_BYTES: Final = 4096
"""Longest reply line read from a decode's channel."""
MAX_END_BODY_BYTES: Final = 4096
MAX_ENDED: Final = 10_000
"""Ends remembered (per store key, the latest) so that a turn still in flight when its
conversation was ended releases its blocks instead of keeping them."""
_TRUE: Final = frozenset({"1", "true", "yes"})


class _Router(Protocol):
    config: RouterConfig
    store: ConversationStore

    async def _state_call(self, fn: Any, *args: Any) -> Any: ...


class LeaseChannelError(ConnectionError):
    """A decode's lease channel could not be reached or answered out of protocol."""


async def channel_call(host: str, port: int, messages: list[Mapping[str, Any]], *,
                       timeout_s: float = CHANNEL_TIMEOUT_S) -> list[dict[str, Any]]:
    """Send ``messages`` (one JSON line each) to a decode's lease channel over one connection;
    its replies in order. :class:`LeaseChannelError` when unreachable or out of protocol."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=MAX_REPLY_BYTES), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise LeaseChannelError(f"lease channel {host}:{port}: cannot connect: "
                                f"{type(exc).__name__} {exc}") from None
    try:
        writer.write(b"".join(json.dumps(m).encode() + b"\n" for m in messages))
        await asyncio.wait_for(writer.drain(), timeout_s)
        out = []
        for _ in messages:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            if not line.endswith(b"\n"):
                raise LeaseChannelError(f"lease channel {host}:{port}: connection closed")
            reply = json.loads(line)
            if not isinstance(reply, dict) or not isinstance(reply.get(pd.LEASE_OK), bool):
                raise LeaseChannelError(f"lease channel {host}:{port}: expected a reply object "
                                        f"with {pd.LEASE_OK!r}, got {line[:200]!r}")
            out.append(reply)
        return out
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        raise LeaseChannelError(f"lease channel {host}:{port}: {type(exc).__name__} "
                                f"{exc}"[:300]) from None
    finally:
        writer.close()


def conversation_ends(headers: Mapping[str, str]) -> bool:
    """Whether a request's :data:`END_HEADER` says its turn is the conversation's last."""
    return str(headers.get(END_HEADER, "")).strip().lower() in _TRUE


@dataclass(slots=True)
class _Held:
    """One conversation's held blocks on a decode."""

    decode_url: str
    request_id: str
    port: int | None
    """The decode's lease channel; None: a fixed-TTL decode."""
    stored_at: float
    """Router monotonic seconds when the turn's params were stored."""

    @property
    def host(self) -> str:
        return urlsplit(self.decode_url).hostname or "127.0.0.1"


def _lease_of(params: Mapping[str, Any]) -> tuple[str, int | None] | None:
    rid = params.get(pd.REMOTE_REQUEST_ID)
    if not isinstance(rid, str) or not rid:
        return None
    port = params.get(pd.PARAMS_LEASE_PORT)
    ok = isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535
    return rid, port if ok else None


class DecodeLeases:
    """The router's leases on decode blocks, one per conversation (see the module docstring).
    Reads ``router.config`` at each use, so a config swapped at run time applies."""

    def __init__(self, router: _Router, *, clock: Any = time.monotonic) -> None:
        self._router = router
        self._clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        """By store key, oldest stored first (records past their use are swept in :meth:`held`)."""
        self._decodes: dict[str, str] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()
        """Store key -> when :meth:`end` was last called for it (``time.perf_counter``, the
        clock of the server's ``_Call.t0``)."""
        self._task: asyncio.Task[None] | None = None
        self.counts = {"renewals": 0, "releases": 0, "lapsed": 0, "withheld": 0,
                       "channel_errors": 0}

    @property
    def config(self) -> RouterConfig:
        return self._router.config

    @property
    def enabled(self) -> bool:
        cfg = self.config
        return cfg.lease_s is not None and cfg.mode == spans.Mode.BIDIRECTIONAL

    # --- turns --------------------------------------------------------------------------------
    async def claim(self, store_key: str | None, params: Mapping[str, Any],
                    decode_url: str | None) -> Mapping[str, Any] | None:
        """The stored params a turn takes, with the renewed ``remote_blocks_expiry_time``; None
        when the history must be recomputed instead (the lease could not be renewed with enough
        time left). Unchanged when the lease is off."""
        if not self.enabled:
            return params
        held = self._held.pop(store_key, None) if store_key is not None else None
        lease = _lease_of(params)
        if lease is None or decode_url is None:
            return params if held is not None and held.port is None and self._fresh(held) \
                else self._withhold("no lease and no record of when the params were stored")
        rid, port = lease
        if port is None:  # a fixed-TTL decode: offered within the router's usual window
            return params if held is not None and self._fresh(held) else self._withhold(
                "fixed-TTL params older than the router's window or of unknown age")
        host = urlsplit(decode_url).hostname or "127.0.0.1"
        reply = await self._renew_one(host, port, rid, decode_url)
        if reply is None:
            return self._withhold(f"renewal of {rid} failed")
        remaining = reply[pd.LEASE_EXPIRY] - reply[pd.LEASE_NOW]
        if remaining < pd.MIN_ROUTER_MARGIN_S:
            await self._release(host, port, rid, decode_url)
            return self._withhold(f"{rid} holds {remaining:.1f} s, under "
                                  f"{pd.MIN_ROUTER_MARGIN_S:g} s")
        return {**params, pd.REMOTE_BLOCKS_EXPIRY_TIME: reply[pd.LEASE_EXPIRY]}

    async def held(self, store_key: str, params: Mapping[str, Any], decode_url: str, *,
                   turn_started: float | None = None) -> None:
        """A turn's params were stored for the next turn: renew them while the conversation is
        live (a lease decode), or remember when (a fixed-TTL decode). A turn that started
        (``turn_started``, ``time.perf_counter``) before its conversation was ended is its last:
        its params are forgotten and its blocks released."""
        lease = _lease_of(params)
        self._decodes[redact_url(decode_url)] = "lease" if lease and lease[1] else "fixed_ttl"
        if not self.enabled or lease is None:
            return
        ended = self._ended.get(store_key)
        if ended is not None and turn_started is not None and ended >= turn_started:
            await self._router._state_call(self._router.store.clear_params, store_key)
            await self.release_params(params, decode_url)
            return
        rid, port = lease
        now = self._clock()
        self._held.pop(store_key, None)
        self._held[store_key] = _Held(decode_url, rid, port, now)
        self._sweep(now)
        if port is not None:
            self._ensure_task()

    def _sweep(self, now: float) -> None:
        """Drop the oldest records no turn can use any more (conversations that never came back
        to a fixed-TTL decode; a lease past its idle time is dropped by the renewals)."""
        cfg = self.config
        while self._held:
            key, oldest = next(iter(self._held.items()))
            if oldest.port is not None or now - oldest.stored_at <= cfg.params_ttl_s:
                return
            del self._held[key]

    async def release_params(self, params: Any, decode_url: str) -> bool:
        """The conversation's last turn: release the blocks it just retained (not stored)."""
        lease = _lease_of(params) if isinstance(params, Mapping) else None
        if not self.enabled or lease is None or lease[1] is None:
            return False
        rid, port = lease
        return await self._release(urlsplit(decode_url).hostname or "127.0.0.1", port, rid,
                                   decode_url)

    async def end(self, store_key: str) -> bool:
        """The conversation is over: forget its stored params (first: no later turn can be given
        the blocks), then release them. Whether a release was applied."""
        self._ended.pop(store_key, None)
        self._ended[store_key] = time.perf_counter()
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        await self._router._state_call(self._router.store.clear_params, store_key)
        held = self._held.pop(store_key, None)
        if held is None or held.port is None:
            return False
        return await self._release(held.host, held.port, held.request_id, held.decode_url)

    # --- HTTP ---------------------------------------------------------------------------------
    async def end_handler(self, request: web.Request) -> web.Response:
        """``POST`` :data:`END_PATH`."""
        cid: Any = request.headers.get(spans.CONVERSATION_HEADER)
        if request.can_read_body:
            if request.content_length is not None and request.content_length > MAX_END_BODY_BYTES:
                return _error(413, f"body over {MAX_END_BODY_BYTES} bytes")
            raw = await request.content.read(MAX_END_BODY_BYTES + 1)
            if len(raw) > MAX_END_BODY_BYTES:
                return _error(413, f"body over {MAX_END_BODY_BYTES} bytes")
            if raw.strip():
                try:
                    body = json.loads(raw)
                except ValueError:
                    return _error(400, "body: expected a JSON object")
                if not isinstance(body, dict):
                    return _error(400, "body: expected a JSON object")
                cid = body.get("conversation_id", cid)
        try:
            cid = check_conversation_id(cid)
        except InvalidConversationId as exc:
            return _error(400, f"{exc} (give 'conversation_id' in a JSON body or the "
                          f"{spans.CONVERSATION_HEADER} header)")
        tenant_header = self.config.tenant_header
        tenant = request.headers.get(tenant_header) if tenant_header else None
        if tenant_header and not tenant:
            return _error(400, f"header {tenant_header!r}: expected the tenant key")
        try:
            released = await self.end(binding.store_key(cid, tenant))
        except Exception as exc:  # the store failed: say so, the client may retry
            _log.warning("ending conversation failed: %s", exc)
            return _error(503, f"conversation store: {type(exc).__name__}")
        return web.json_response({"conversation_id": cid, "released": released,
                                  "lease": self.enabled})

    def health(self) -> dict[str, Any]:
        """``/health``'s ``decode_lease``: the config, counters, and per decode (seen so far)
        whether it holds blocks under a lease (``lease``) or vLLM's fixed TTL (``fixed_ttl``)."""
        cfg = self.config
        return {"enabled": self.enabled, "lease_s": cfg.lease_s,
                "renew_every_s": cfg.lease_renew_every_s if self.enabled else None,
                "idle_s": cfg.lease_idle_s if self.enabled else None,
                "held": sum(1 for h in self._held.values() if h.port is not None),
                "decodes": dict(self._decodes),
                **{f"{k}_total": v for k, v in self.counts.items()}}

    # --- renewals -----------------------------------------------------------------------------
    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew_loop(),
                                                                name="kvtune-lease-renewals")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def _renew_loop(self) -> None:
        while any(h.port is not None for h in self._held.values()):
            every = self.config.lease_renew_every_s
            await asyncio.sleep(every if every is not None else 1.0)
            if not self.enabled:
                continue
            try:
                await self.renew_round()
            except Exception:  # never let the loop die with leases to renew
                _log.warning("lease renewal round failed", exc_info=True)

    async def renew_round(self) -> None:
        """Renew every live lease once (one connection per decode); drop those past
        ``lease_idle_s`` (they lapse) or refused by the decode (their params are forgotten)."""
        cfg = self.config
        assert cfg.lease_s is not None and cfg.lease_idle_s is not None
        now = self._clock()
        by_decode: dict[tuple[str, int, str], list[str]] = {}
        for key, h in list(self._held.items()):
            if h.port is None:
                if now - h.stored_at > cfg.params_ttl_s:
                    del self._held[key]
                continue
            if now - h.stored_at > cfg.lease_idle_s:  # not live any more: let it lapse
                await self._forget(key)
                continue
            by_decode.setdefault((h.host, h.port, h.decode_url), []).append(key)
        for (host, port, url), keys in by_decode.items():
            msgs = [{pd.LEASE_OP: pd.LEASE_OP_RENEW, pd.LEASE_ID: self._held[k].request_id,
                     pd.LEASE_S: cfg.lease_s} for k in keys]
            try:
                replies = await channel_call(host, port, msgs)
            except LeaseChannelError as exc:
                self._channel_failed(url, exc)
                continue
            for key, reply in zip(keys, replies):
                if reply[pd.LEASE_OK]:
                    self.counts["renewals"] += 1
                    continue
                # Gone (read back, freed), released or lapsing: nothing left to offer.
                _log.info("lease on %s not renewed: %s", key, reply.get(pd.LEASE_DETAIL))
                await self._forget(key)

    async def _forget(self, key: str) -> None:
        """Stop renewing ``key``'s lease (it lapses) and forget its stored params."""
        if self._held.pop(key, None) is None:
            return
        self.counts["lapsed"] += 1
        try:
            await self._router._state_call(self._router.store.clear_params, key)
        except Exception:  # the params then expire in the store; a claim renews first anyway
            _log.warning("clearing the params of a lapsed lease failed", exc_info=True)

    async def _renew_one(self, host: str, port: int, rid: str,
                         url: str) -> dict[str, Any] | None:
        cfg = self.config
        try:
            (reply,) = await channel_call(host, port, [{
                pd.LEASE_OP: pd.LEASE_OP_RENEW, pd.LEASE_ID: rid, pd.LEASE_S: cfg.lease_s}])
        except LeaseChannelError as exc:
            self._channel_failed(url, exc)
            return None
        if not reply[pd.LEASE_OK]:
            _log.info("lease renewal of %s refused: %s", rid, reply.get(pd.LEASE_DETAIL))
            return None
        if not all(isinstance(reply.get(k), (int, float)) for k in (pd.LEASE_EXPIRY, pd.LEASE_NOW)):
            return None
        self.counts["renewals"] += 1
        return reply

    async def _release(self, host: str, port: int, rid: str, url: str) -> bool:
        try:
            (reply,) = await channel_call(host, port, [{pd.LEASE_OP: pd.LEASE_OP_RELEASE,
                                                        pd.LEASE_ID: rid}])
        except LeaseChannelError as exc:
            self._channel_failed(url, exc)
            return False
        if reply[pd.LEASE_OK]:
            self.counts["releases"] += 1
        return bool(reply[pd.LEASE_OK])

    def _channel_failed(self, url: str, exc: Exception) -> None:
        self.counts["channel_errors"] += 1
        self._decodes[redact_url(url)] = "unreachable"
        _log.warning("decode %s: %s", redact_url(url), exc)

    def _fresh(self, held: _Held) -> bool:
        return self._clock() - held.stored_at <= self.config.params_ttl_base_s

    def _withhold(self, why: str) -> None:
        self.counts["withheld"] += 1
        _log.info("history withheld (the turn recomputes it): %s", why)
        return None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request",
                                        "code": status}}, status=status)
