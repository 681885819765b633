"""Stand-ins for vLLM prefill/decode servers with NIXL connectors: :class:`StandInVllmServer`.

They speak vLLM's P/D HTTP protocol (the ``kv_transfer_params`` each side expects and returns, in
pull, push and bidirectional mode) but compute nothing and move no KV: they exist to test and
benchmark the router where real vLLM engines are too slow to run many times. A shared
:class:`StandInKvLedger` plays the part of the KV blocks, so protocol mistakes fail loudly:

- a decode given ``do_remote_prefill`` params the prefill never issued answers 400;
- in push mode the decode waits (bounded) for the prefill with the same ``X-Request-Id``;
- a prefill given a decode's retained blocks that were already consumed or never retained
  answers 400 (blocks are consumed once, as vLLM frees them after the read);
- with ``lease=True`` the decode runs kvtune's real lease book and channel
  (:mod:`kvtune.connectors.lease`) and the prefill refuses, and records in
  ``ledger.lease_refusals``, a readback vLLM would decline (expiry within its margin) and one it
  could not catch: blocks released or lapsed, or an expiry later than the decode's deadline.

Streaming speaks either release's format (``sse_kv_params``): vLLM 0.32 sends no
``kv_transfer_params`` in SSE; vLLM 0.33 adds them, as a top-level ``kv_transfer_params`` key, to
the stream's last chunk (the one whose choice carries ``finish_reason``; a usage chunk, when asked
for, follows it). The exact bytes of each stream are kept in ``sent_streams``.

A decode with ``trickle_s`` set streams like an upstream that never ends: after its words it sends
one more word every ``trickle_s`` seconds (each well within any idle timeout) for up to
:data:`TRICKLE_MAX_S`; ``streams_aborted`` counts streams whose client went away meanwhile.

Tokens are whitespace-separated words of the prompt (or of the chat messages' contents). A
completion's text starts with a space (``" w0 w1"``), as vLLM's decoded word tokens do, so a
conversation's next prompt is ``prompt + text + ...``; a chat message's content does not.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvtune import vllm_pd as pd
from kvtune.connectors.lease import LeaseBook, LeaseChannel
from kvtune.router.config import InstanceConfig

T = TypeVar("T")
STANDIN_MODEL = "standin-model"
SSE_FORMATS = ("0.32", "0.33")
"""vLLM releases whose SSE the stand-ins speak: 0.33 carries ``kv_transfer_params`` in the last
chunk of a stream, 0.32 does not."""
OUTPUT_TOKEN_ID_BASE = 1_000_000
"""Token id of the generated word ``w<i>`` (``return_token_ids``): ``OUTPUT_TOKEN_ID_BASE + i``."""
PUSH_WAIT_S = 60.0
"""How long a push decode stand-in waits for its prefill before failing (a bounded wait)."""
TRICKLE_MAX_S = 60.0
"""A trickling decode stand-in (``trickle_s``) ends its stream after this long at most, so a test
of a router that fails to cut it off still ends (with a complete stream: its check fails)."""


@dataclass(frozen=True)
class ReceivedRequest:
    """One request a stand-in received, and the ``kv_transfer_params`` it answered with."""

    server: str
    path: str
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    """Case-insensitive."""
    status: int
    returned_kv_params: Mapping[str, Any] | None
    pulled_tokens: int = 0
    """Prefill: history tokens taken from a decode's retained blocks (bidirectional)."""


@dataclass
class StandInKvLedger:
    """The blocks the stand-ins pretend to hold, shared by one cluster's servers."""

    issued: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """Prefill's returned params by remote_request_id (pull), waiting for a decode to read them."""
    retained: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """Decode's returned params by remote_request_id (bidirectional), until a prefill pulls them."""
    pushed: dict[str, asyncio.Event] = field(default_factory=dict)
    """Push: one event per request id, set when the prefill has 'written' the KV."""
    blocks: itertools.count = field(default_factory=lambda: itertools.count(1))
    leases: dict[str, LeaseBook] = field(default_factory=dict)
    """Renewable decode lease: the decode's book by remote_request_id (kvtune's real one)."""
    lease_refusals: list[str] = field(default_factory=list)
    """Why a prefill refused a readback of leased blocks (the checks vLLM makes, and one it
    cannot: a read of blocks the decode released or let lapse)."""

    def push_event(self, request_id: str) -> asyncio.Event:
        return self.pushed.setdefault(request_id, asyncio.Event())


def _prompt_words(path: str, body: Mapping[str, Any]) -> list[str]:
    if path.endswith("/chat/completions"):
        words: list[str] = []
        for msg in body.get("messages") or ():
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                words.extend(content.split())
        return words
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return str(prompt).split()


def _pieces(out_words: Sequence[str], chat: bool) -> list[str]:
    """The text of each generated token: a completion continues its prompt, so every word comes
    with its leading space (as vLLM decodes word tokens: ``prompt + text`` is the history); a chat
    message's content starts with its first word."""
    return [word if chat and i == 0 else " " + word for i, word in enumerate(out_words)]


class StandInVllmServer:
    """A stand-in vLLM server (``role`` "prefill" or "decode"); see the module docstring.

    Run it with a :class:`StandInVllmCluster`. ``fail_status`` (answer every completion with that
    status) and ``delay_s`` (sleep before answering) may be changed while it runs.
    """

    def __init__(self, role: str, name: str, ledger: StandInKvLedger, *, kv_port: int,
                 bidirectional: bool = False, decoder_ttl_s: float = 480.0,
                 sse_format: str = "0.32", lease: bool = False) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: expected 'prefill' or 'decode', got {role!r}")
        if sse_format not in SSE_FORMATS:
            raise ValueError(f"sse_format: expected one of {SSE_FORMATS}, got {sse_format!r}")
        self.sse_format = sse_format
        self.sent_streams: dict[str, bytes] = {}
        """The exact SSE bytes sent, by the request's ``X-Request-Id``."""
        self.role, self.name, self.ledger = role, name, ledger
        self.engine_id = name
        self.kv_port = kv_port
        self.bidirectional = bidirectional
        self.decoder_ttl_s = decoder_ttl_s
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.trickle_s: float | None = None
        self.streams_aborted = 0
        self.received: list[ReceivedRequest] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.lease_book: LeaseBook | None = None
        """Decode with ``lease=True``: kvtune's real lease book and channel (the engine's part,
        freeing blocks at their deadline, is played by the prefill's checks)."""
        self.lease_channel: LeaseChannel | None = None
        if lease and role == "decode":
            self.lease_book = LeaseBook(3600.0)

    def instance(self) -> InstanceConfig:
        """This server as a router instance (with its engine id and side-channel port)."""
        return InstanceConfig(url=self.url, engine_id=self.engine_id, kv_host="127.0.0.1",
                              kv_port=self.kv_port)

    async def start(self) -> None:
        if self.lease_book is not None:
            self.lease_channel = LeaseChannel(self.lease_book, 0)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # handler_cancellation: a client that goes away aborts the request, as in vLLM.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.lease_channel is not None:
            self.lease_channel.close()
            self.lease_channel = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": STANDIN_MODEL, "object": "model", "owned_by": f"stand-in {self.name}"}]})

    def _record(self, request: web.Request, body: Mapping[str, Any], status: int,
                returned: Mapping[str, Any] | None, pulled: int = 0) -> None:
        self.received.append(ReceivedRequest(self.name, request.path, body,
                                             CIMultiDictProxy(CIMultiDict(request.headers)),
                                             status, returned, pulled))

    def _reject(self, request: web.Request, body: Mapping[str, Any], status: int,
                message: str) -> web.Response:
        self._record(request, body, status, None)
        return web.json_response({"error": {"message": f"stand-in {self.name}: {message}",
                                            "type": "BadRequestError", "code": status}},
                                 status=status)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status is not None:
            return self._reject(request, body, self.fail_status, "failing on purpose")
        params = body.get(pd.KV_TRANSFER_PARAMS)
        if not isinstance(params, dict):
            return self._reject(request, body, 400, "expected kv_transfer_params (P/D protocol)")
        if self.role == "prefill":
            return await self._prefill(request, body, params)
        return await self._decode(request, body, params)

    def _kv_params(self, request_id: str, tokens: int, *, decode_side: bool) -> dict[str, Any]:
        n_blocks = max(1, -(-tokens // 16))
        return {
            pd.DO_REMOTE_PREFILL: not decode_side, pd.DO_REMOTE_DECODE: decode_side,
            pd.REMOTE_BLOCK_IDS: [[next(self.ledger.blocks) for _ in range(n_blocks)]],
            pd.REMOTE_ENGINE_ID: self.engine_id, pd.REMOTE_REQUEST_ID: request_id,
            pd.REMOTE_HOST: "127.0.0.1", pd.REMOTE_PORT: self.kv_port, pd.TP_SIZE: 1,
            pd.PP_SIZE: 1, pd.REMOTE_NUM_TOKENS: tokens,
            pd.REMOTE_BLOCKS_EXPIRY_TIME: (time.perf_counter() + self.decoder_ttl_s
                                           if decode_side else None)}

    async def _prefill(self, request: web.Request, body: dict[str, Any],
                       params: dict[str, Any]) -> web.Response:
        if not params.get(pd.DO_REMOTE_DECODE):
            return self._reject(request, body, 400, "prefill expects do_remote_decode")
        if body.get("max_tokens") != 1 or body.get("stream"):
            return self._reject(request, body, 400, "prefill leg expects max_tokens 1, no stream")
        words = _prompt_words(request.path, body)
        pulled = 0
        if params.get(pd.REMOTE_BLOCK_IDS):  # bidirectional: the decode's retained history
            held = self.ledger.retained.pop(str(params.get(pd.REMOTE_REQUEST_ID)), None)
            if held is None or held.get(pd.REMOTE_BLOCK_IDS) != params[pd.REMOTE_BLOCK_IDS]:
                return self._reject(request, body, 400, "decode blocks not retained (expired, "
                                    "consumed or never issued)")
            refused = self._lease_refusal(str(params[pd.REMOTE_REQUEST_ID]), params)
            if refused:
                self.ledger.lease_refusals.append(refused)
                return self._reject(request, body, 400, refused)
            pulled = min(int(params.get(pd.REMOTE_NUM_TOKENS) or 0), len(words))
        rid = request.headers.get("X-Request-Id", f"standin-{id(body)}")
        returned = self._kv_params(f"cmpl-{rid}-0", len(words), decode_side=False)
        self.ledger.issued[returned[pd.REMOTE_REQUEST_ID]] = returned
        self.ledger.push_event(rid).set()  # push: the KV is "written"
        self._record(request, body, 200, returned, pulled)
        return web.json_response(self._answer(request.path, rid, ["P"], len(words), returned))

    def _lease_refusal(self, rid: str, params: Mapping[str, Any]) -> str | None:
        """A leased readback's checks: vLLM's (the expiry the prefill was given, within its
        margin) and the safety one (the decode still holds the blocks, at least that long)."""
        book = self.ledger.leases.pop(rid, None)
        if book is None:
            return None
        held = book.held().get(rid)
        book.gone({rid})
        now = book.now()
        if held is None or held <= now:
            return f"read of {rid}'s blocks after the decode released them or they lapsed"
        expiry = params.get(pd.REMOTE_BLOCKS_EXPIRY_TIME)
        if not isinstance(expiry, (int, float)) or now + pd.READBACK_SAFETY_MARGIN_S >= expiry:
            return f"readback declined: expiry {expiry!r} within vLLM's margin"
        if expiry > held + 1e-6:
            return f"params claim expiry {expiry} past the decode's deadline {held}"
        return None

    async def _decode(self, request: web.Request, body: dict[str, Any],
                      params: dict[str, Any]) -> web.StreamResponse:
        if not params.get(pd.DO_REMOTE_PREFILL):
            return self._reject(request, body, 400, "decode expects do_remote_prefill")
        rid = request.headers.get("X-Request-Id", f"standin-{id(body)}")
        if params.get(pd.REMOTE_BLOCK_IDS) is None:  # push: wait for the named prefill's write
            missing = [k for k in (pd.REMOTE_ENGINE_ID, pd.REMOTE_HOST, pd.REMOTE_PORT, pd.TP_SIZE,
                                   pd.PP_SIZE, pd.REMOTE_REQUEST_ID) if params.get(k) is None]
            if missing:
                return self._reject(request, body, 400, f"push decode params lack {missing}")
            try:
                await asyncio.wait_for(self.ledger.push_event(str(params[pd.REMOTE_REQUEST_ID]))
                                       .wait(), PUSH_WAIT_S)
            except asyncio.TimeoutError:
                return self._reject(request, body, 504, "push: the prefill never wrote the KV")
        else:  # pull: read the blocks the prefill issued, once
            issued = self.ledger.issued.pop(str(params.get(pd.REMOTE_REQUEST_ID)), None)
            if issued is None or issued.get(pd.REMOTE_BLOCK_IDS) != params[pd.REMOTE_BLOCK_IDS]:
                return self._reject(request, body, 400, "prefill blocks unknown or already read")
        words = _prompt_words(request.path, body)
        n_out = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        out_words = [f"w{i}" for i in range(n_out)]
        returned = None
        if self.bidirectional:
            returned = self._kv_params(f"cmpl-{rid}-0", len(words) + n_out, decode_side=True)
            self.ledger.retained[returned[pd.REMOTE_REQUEST_ID]] = returned
            if self.lease_book is not None and self.lease_channel is not None:
                self.lease_book.hold(returned[pd.REMOTE_REQUEST_ID],
                                     returned[pd.REMOTE_BLOCKS_EXPIRY_TIME])
                self.ledger.leases[returned[pd.REMOTE_REQUEST_ID]] = self.lease_book
                returned[pd.PARAMS_LEASE_PORT] = self.lease_channel.port
        self._record(request, body, 200, returned)
        if not body.get("stream"):
            return web.json_response(self._answer(request.path, rid, out_words, len(words), returned,
                                                  token_ids=bool(body.get("return_token_ids"))))
        return await self._stream(request, rid, out_words, len(words), body,
                                  returned if self.sse_format == "0.33" else None)

    @staticmethod
    def _answer(path: str, rid: str, out_words: Sequence[str], prompt_tokens: int,
                kv_params: Mapping[str, Any] | None, *, token_ids: bool = False) -> dict[str, Any]:
        chat = path.endswith("/chat/completions")
        text = "".join(_pieces(out_words, chat))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if token_ids:  # vLLM's return_token_ids: the generated tokens' ids
            choice["token_ids"] = [OUTPUT_TOKEN_ID_BASE + i for i in range(len(out_words))]
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": STANDIN_MODEL, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out_words),
                          "total_tokens": prompt_tokens + len(out_words)},
                pd.KV_TRANSFER_PARAMS: dict(kv_params) if kv_params is not None else None}

    async def _stream(self, request: web.Request, rid: str, out_words: Sequence[str],
                      prompt_tokens: int, body: Mapping[str, Any],
                      kv_params: Mapping[str, Any] | None) -> web.StreamResponse:
        # vLLM 0.32: no kv_transfer_params in the stream; 0.33: in its last chunk (kv_params).
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = bytearray()

        async def send(event: Mapping[str, Any]) -> None:
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            sent.extend(data)
            await resp.write(data)

        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "model": STANDIN_MODEL,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time())}
        if chat:
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]})
        for i, text in enumerate(_pieces(out_words, chat)):
            last = i == len(out_words) - 1
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}} if chat
                                      else {"index": 0, "text": text, "logprobs": None})
            choice["finish_reason"] = "length" if last else None
            if body.get("return_token_ids"):
                choice["token_ids"] = [OUTPUT_TOKEN_ID_BASE + i]
            event: dict[str, Any] = {**base, "choices": [choice]}
            if last and kv_params is not None:
                event[pd.KV_TRANSFER_PARAMS] = dict(kv_params)
            await send(event)
        if self.trickle_s is not None:
            await self._trickle(send, base, chat)
        opts = body.get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage"):
            await send({**base, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": len(out_words),
                "total_tokens": prompt_tokens + len(out_words)}})
        sent.extend(b"data: [DONE]\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.sent_streams[rid] = bytes(sent)
        return resp


    async def _trickle(self, send: Callable[[Mapping[str, Any]], Awaitable[None]],
                       base: Mapping[str, Any], chat: bool) -> None:
        """One more word every ``trickle_s`` seconds, for up to :data:`TRICKLE_MAX_S`; a client
        going away (the handler cancelled, or the write failing) is counted."""
        assert self.trickle_s is not None
        end = time.monotonic() + TRICKLE_MAX_S
        try:
            while time.monotonic() < end:
                await asyncio.sleep(self.trickle_s)
                choice: dict[str, Any] = ({"index": 0, "delta": {"content": " t"}} if chat
                                          else {"index": 0, "text": " t", "logprobs": None})
                await send({**base, "choices": [choice]})
        except (asyncio.CancelledError, ConnectionResetError):
            self.streams_aborted += 1
            raise


class StandInVllmCluster:
    """Prefill and decode stand-ins on loopback, served from one background event-loop thread.

    Use as a context manager; ``prefill`` / ``decode`` list the servers, and :meth:`router_config`
    gives a router configuration in front of them.
    """

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, *, bidirectional: bool = False,
                 decoder_ttl_s: float = 480.0, sse_format: str = "0.32",
                 lease: bool = False) -> None:
        self.ledger = StandInKvLedger()
        self.prefill = [StandInVllmServer("prefill", f"standin-prefill-{i}", self.ledger,
                                          kv_port=15600 + i) for i in range(n_prefill)]
        self.decode = [StandInVllmServer("decode", f"standin-decode-{i}", self.ledger,
                                         kv_port=15700 + i, bidirectional=bidirectional,
                                         decoder_ttl_s=decoder_ttl_s, sse_format=sse_format,
                                         lease=lease)
                       for i in range(n_decode)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StandInVllmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="standin-vllm", daemon=True)
        self._thread.start()
        ready.wait(30)
        for server in (*self.prefill, *self.decode):
            self.call(server.start())

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run a coroutine on the cluster's loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._loop is None:
            return
        for server in (*self.prefill, *self.decode):
            self.call(server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop.close()
        self._loop = None

    def router_config(self, mode: str = "pull", **overrides: Any) -> Any:
        """A :class:`~kvtune.router.config.RouterConfig` in front of these stand-ins."""
        from kvtune.router.config import RouterConfig
        from kvtune.spans import Mode
        overrides.setdefault("port", 0)
        return RouterConfig(prefill=tuple(s.instance() for s in self.prefill),
                            decode=tuple(s.instance() for s in self.decode), mode=Mode(mode),
                            **overrides)

    def requests(self, role: str | None = None) -> list[ReceivedRequest]:
        """All requests received (by role), in arrival order per server."""
        servers = (self.prefill if role == "prefill" else self.decode if role == "decode"
                   else [*self.prefill, *self.decode])
        return [r for s in servers for r in list(s.received)]
