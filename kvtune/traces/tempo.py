"""Reading traces from a Grafana Tempo server over its HTTP API.

Search (``GET /api/search?q=<TraceQL>&start=&end=&limit=`` -> ``{"traces": [{"traceID": ..}]}``),
then fetch each trace: ``/api/v2/traces/<id>`` (``{"trace": {"resourceSpans": [...]}}``) or
``/api/traces/<id>`` (``{"batches": [...]}``). With ``api="auto"`` the v2 path is tried first and a
404 falls back to v1. Trace ids may come back hex or base64 (Tempo's protobuf-JSON); the loader
accepts both.

A source URL: ``tempo+http://HOST:PORT[/prefix]?q={}&start=<unix s>&end=<unix s>&limit=<n>``, or
``...?q={}&since=2h`` (the last two hours). The search always sends an explicit time range: a
Tempo search without one reads only the ingesters' recent data and silently misses the rest.
Without ``start``/``since`` the range is the last :data:`DEFAULT_SINCE_S` seconds (one hour, the
dashboards' default), ending now or at ``end``.

A window of the range whose search returns ``limit`` traces may hold more: it is split in halves
and each half searched again, down to one second; windows longer than Tempo's maximum search
duration are split before they are sent (and again if the server answers that a range is too
long); a ``limit`` over the server's ``max_result_limit`` is lowered to it. What the search did is
returned as a :class:`TempoSearch` (range, requests, traces found, why it was cut short, if it was).

A long range is read in *pages* of ``page`` seconds (URL ``page=1h``; default
:data:`DEFAULT_PAGE_S`), each searched and fetched before the next, with a progress bar. A trace
belongs to the page its start time falls in (Tempo's search answer gives ``startTimeUnixNano``), so
traces that cross a page boundary are read once. Each page's search also covers the
``lookahead`` seconds after it (URL ``lookahead=5m``; default :data:`DEFAULT_LOOKAHEAD_S`, ``0``
turns it off), keeping only the traces that start in the page: Tempo finds a trace only in a window
that overlaps both its spans and the time range of the block it was written to, and it dates a
trace that arrived more than its ``ingestion_time_range_slack`` (2 min) after it started by its
arrival. A trace that an earlier page's windows found (with its start, in a later page) is read
by its page even when that page's own windows miss it. Measured with a real run replayed into Tempo
(``tests/test_traces_tempo_real.py``): one-minute pages without either missed the three traces
longer than 70 s (91 of 94 traces read) on 2.10.8 and 3.0.3; on 2.10.8 the same trace was found
by some windows over it and not by others, so a trace can still be missed where no window finds it,
and no answer of Tempo's says so (a resumed read also starts without the traces seen ahead).
With ``cursor=FILE`` every finished page is
appended to a spool file beside the cursor and recorded in it (``kvtune.traces.cursor``): a read
interrupted by Ctrl-C or a Tempo error resumes at the first unfinished page. With
``skip_failed=1`` a page whose search or fetch fails is left out, and the read report says which
(``tempo_windows_failed``), instead of the read stopping. With ``metrics=1`` the read also asks
Tempo's TraceQL metrics for aggregates over the whole range (``kvtune.traces.tempo_metrics``).
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtune.errors import TraceFormatError, TraceSourceError
from kvtune.traces.http import get as http_get

_logger = logging.getLogger(__name__)

SCHEMES = ("tempo+http", "tempo+https")
DEFAULT_QUERY = "{}"
DEFAULT_LIMIT = 1000
"""Traces per search request when the URL gives no ``limit`` (Tempo's own default is 20); a window
that returns this many is split and searched again."""
DEFAULT_SINCE_S = 3600
"""Range searched when the source gives no ``start`` and no ``since``: the last hour (the
dashboards' default range)."""
MAX_WINDOW_S = 168 * 3600
"""Longest range sent in one search: Tempo's default ``query_frontend.search.max_duration``
(168 h); longer ranges are split first. A server configured lower answers HTTP 400, and the
window is halved until it is accepted."""
MIN_WINDOW_S = 1
"""Tempo's search range is in whole seconds: a one-second window cannot be split further."""
MAX_SEARCH_REQUESTS = 2000
"""Search requests one page may send before the read stops, saying so (splitting is bounded)."""
DEFAULT_TIMEOUT_S = 30.0
API_VERSIONS = ("auto", "v1", "v2")
MAX_SEARCH_BODY_BYTES = 64 * 2**20
"""Largest search answer read (64 MiB: over 100 000 traces' summaries)."""
MAX_TRACE_BODY_BYTES = 256 * 2**20
"""Largest trace answer read (256 MiB; Tempo's own ``max_bytes_per_trace`` default is 5 MB)."""
DEFAULT_PAGE_S = 3600
"""Seconds of the range searched and fetched as one page (the cursor's unit of resumption). An
hour of a 16-pair fleet at 10 requests/s per pair is 576,000 traces: at ``limit=1000`` its search
takes 2,047 requests, more than a page may send (:data:`MAX_SEARCH_REQUESTS`); such a fleet reads
with ``page=10m`` or a higher ``limit`` (``docs/fleet-scale.md``)."""
DEFAULT_LOOKAHEAD_S = 300
"""Seconds after a page also searched for traces that start in the page but reached Tempo later
(see the module doc): a long trace, or spans pushed late."""
MAX_UNIX_S = 2**63 // 10**9
"""Latest time a range may name (Tempo keeps nanoseconds in int64)."""
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}
_DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_START_NOT_BEFORE_END = re.compile(r"start must be before end")
"""Tempo's answer to a search window it clamped to its clock (a window starting past its now)."""
CLOCK_SKEW_S = 120
"""A window refused so starting up to this long before our clock counts as past Tempo's clock
(nothing there yet), not as an error."""
_RANGE_TOO_LONG = re.compile(r"range specified by start and end exceeds "
                             r"((?:\d+(?:\.\d+)?(?:h|ms|m|s|us|ns))+)")
_LIMIT_TOO_HIGH = re.compile(r"limit \d+ exceeds max limit (\d+)")


def parse_since(text: str, *, where: str = "since") -> int:
    """Seconds in a ``since`` value: ``3600``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m``, ``1w``."""
    s = text.strip()
    try:
        value = float(s)
    except ValueError:
        pos, total = 0, 0.0
        for m in _DURATION_RE.finditer(s):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _DURATION_UNITS_S[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise TraceSourceError(f"{where}: expected a duration such as 3600, 90s, 30m, 2h or 1d, "
                                   f"got {text!r}") from None
        value = total
    if not math.isfinite(value) or value <= 0 or value > MAX_UNIX_S:
        raise TraceSourceError(f"{where}: expected a positive, finite duration, got {text!r}")
    return max(MIN_WINDOW_S, math.ceil(value))


def _go_duration_s(text: str) -> int | None:
    """Seconds in a Go duration such as ``168h0m0s`` (None when it is not one)."""
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(h|m|s|ms|us|ns)", text):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6,
                                      "ns": 1e-9}[m.group(2)]
        pos = m.end()
    return int(total) if pos == len(text) and total >= 1 else None


@dataclass(frozen=True)
class TempoSearch:
    """What one read's search did: the range, the requests sent, the traces found."""

    url: str
    """The search endpoint."""
    query: str
    start_s: int
    end_s: int
    """Range searched, unix seconds (Tempo's ``start``/``end``)."""
    range_from: str
    """Where the range came from: ``"start/end"``, ``"since=<s>"`` or ``"default: last <s> s"``."""
    limit: int
    """Traces asked per request (after any lowering to the server's maximum)."""
    trace_ids: tuple[str, ...]
    """Every trace id found, first-seen order, without duplicates."""
    requests: int
    """Search requests sent (including ones answered "too long" or "limit too high")."""
    windows: int
    """Windows whose answer was kept (after splitting)."""
    cut_short: tuple[str, ...] = ()
    """Why traces in the range may have been left out (empty: the search covered it all)."""
    traces_found: int | None = None
    """Traces found when ``trace_ids`` is not kept (a paged read); None: ``len(trace_ids)``."""

    @property
    def complete(self) -> bool:
        return not self.cut_short

    @property
    def n_found(self) -> int:
        return len(self.trace_ids) if self.traces_found is None else self.traces_found


@dataclass(frozen=True)
class TempoRead:
    """What one Tempo source gave the loader: the search, the traces fetched, the spans read."""

    search: TempoSearch
    traces_fetched: int
    spans_read: int
    one_sided_transfers: int = 0
    """Transfers (``kv.transfer_id``) with an initiator ``kv.rdma`` span and no target ``kv.notify``
    or the reverse: a sign that Tempo answered part of the traces (still ingesting, blocks missed)."""
    partial_answers: tuple[str, ...] = ()
    """``URL: message`` of each trace Tempo itself answered as partial (``"status": "PARTIAL"``:
    the trace exceeded its ``max_bytes_per_trace``; HTTP 206: blocks it could not read). At most
    :data:`MAX_NOTES` are kept; ``partial_answer_count`` counts them all."""
    partial_answer_count: int | None = None
    failed_windows: tuple[str, ...] = ()
    """``start .. end: error`` of each page left out because its search or a fetch failed
    (``skip_failed=1``)."""
    pages: int = 1
    """Pages the range was read in."""
    pages_resumed: int = 0
    """Pages a cursor had already finished: their spans were read back from its spool file."""
    cursor: str | None = None
    """The cursor file, when the read kept one."""
    fleet: Any = None
    """``kvtune.traces.tempo_metrics.FleetMetrics``: Tempo's own aggregates over the whole range
    (``metrics=1``), or None."""

    @property
    def n_partial_answers(self) -> int:
        return (len(self.partial_answers) if self.partial_answer_count is None
                else self.partial_answer_count)

    @property
    def partial(self) -> bool:
        return (bool(self.search.cut_short) or self.one_sided_transfers > 0
                or bool(self.n_partial_answers) or bool(self.failed_windows)
                or (self.fleet is not None and not self.fleet.complete))

    def summary(self) -> str:
        s = self.search
        paged = (f", {self.pages} page(s)" + (f", {self.pages_resumed} resumed from "
                                              f"{self.cursor}" if self.pages_resumed else "")
                 if self.pages > 1 or self.pages_resumed else "")
        return (f"tempo {s.url}: searched {_iso(s.start_s)} .. {_iso(s.end_s)} ({s.range_from}; "
                f"q={s.query}, limit {s.limit}, {s.requests} request(s), {s.windows} window(s)"
                f"{paged}): {s.n_found} trace(s) found, {self.traces_fetched} fetched, "
                f"{self.spans_read} span(s) read")

    def findings(self) -> list[dict[str, Any]]:
        """Findings (``code``, ``severity``, ``message``, ``evidence``) for the recommendation:
        the first is the read itself (info); every way the answer may be partial is a warning
        that names what is missing."""
        s = self.search
        evidence = self.as_dict()
        out = [{"code": "tempo_read", "severity": "info", "message": self.summary(),
                "evidence": evidence}]
        if s.cut_short:
            out.append({"code": "tempo_search_cut_short", "severity": "warning",
                        "message": f"the Tempo search was cut short, traces in the range may be "
                                   f"missing: {first_notes(s.cut_short, MAX_NOTES)}",
                        "evidence": evidence})
        if self.failed_windows:
            out.append({"code": "tempo_windows_failed", "severity": "warning",
                        "message": f"{len(self.failed_windows)} of {self.pages} page(s) of the "
                                   f"range failed and their traces are missing: "
                                   f"{first_notes(self.failed_windows, MAX_NOTES)}"
                                   + (f" (run again with cursor={self.cursor} to read only them)"
                                      if self.cursor else ""),
                        "evidence": evidence})
        if self.n_partial_answers:
            out.append({"code": "tempo_partial_answers", "severity": "warning",
                        "message": f"Tempo answered {self.n_partial_answers} trace(s) as "
                                   f"partial (their spans beyond Tempo's size limit, or in blocks "
                                   f"it could not read, are missing): "
                                   f"{first_notes(self.partial_answers, 3, self.n_partial_answers)}",
                        "evidence": evidence})
        if self.one_sided_transfers:
            out.append({"code": "tempo_partial_traces", "severity": "warning",
                        "message": f"{self.one_sided_transfers} transfer(s) read from Tempo have "
                                   f"spans from one side only (kv.rdma without kv.notify, or the "
                                   f"reverse): Tempo may have answered part of the traces (still "
                                   f"ingesting, or the range cuts through them), or these "
                                   f"transfers never completed", "evidence": evidence})
        if self.fleet is not None:
            out += self.fleet.findings()
        return out

    def as_dict(self) -> dict[str, Any]:
        s = self.search
        return {"url": s.url, "query": s.query, "start_s": s.start_s, "end_s": s.end_s,
                "range_from": s.range_from, "limit": s.limit, "requests": s.requests,
                "windows": s.windows, "traces_found": s.n_found,
                "traces_fetched": self.traces_fetched, "spans_read": self.spans_read,
                "one_sided_transfers": self.one_sided_transfers, "cut_short": list(s.cut_short),
                "partial_answers": list(self.partial_answers),
                "partial_answer_count": self.n_partial_answers,
                "failed_windows": list(self.failed_windows), "pages": self.pages,
                "pages_resumed": self.pages_resumed, "cursor": self.cursor,
                "fleet_metrics": None if self.fleet is None else self.fleet.as_dict()}


MAX_NOTES = 20
"""Notes of one kind (cut-short windows, failed pages, partial traces) kept in a read report."""


def first_notes(notes: Sequence[str], limit: int, total: int | None = None) -> str:
    """The first ``limit`` of ``notes`` joined by "; ", then " ..." when there are more (of
    ``total``, when the list holds fewer than were counted)."""
    more = (len(notes) if total is None else total) > limit
    return "; ".join(notes[:limit]) + (" ..." if more else "")


def _iso(unix_s: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


@dataclass(frozen=True)
class TempoSource:
    """A Tempo server and a search: TraceQL ``query``, a range (unix-seconds ``start_s``/``end_s``,
    or the last ``since_s`` seconds; default the last :data:`DEFAULT_SINCE_S`) and the traces per
    request ``limit``. ``timeout_s`` bounds each HTTP request as a whole (connect, headers, body,
    same-origin redirects); ``headers`` (e.g. ``Authorization``) go only to ``base_url``'s origin:
    a redirect elsewhere is refused (``kvtune.traces.http``)."""

    base_url: str
    query: str = DEFAULT_QUERY
    start_s: int | None = None
    end_s: int | None = None
    limit: int = DEFAULT_LIMIT
    api: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    headers: Mapping[str, str] = field(default_factory=dict)
    since_s: int | None = None
    page_s: int = DEFAULT_PAGE_S
    """Seconds of the range read as one page (and recorded as one step of a cursor)."""
    cursor: str | None = None
    """A JSON state file (``kvtune.traces.cursor``): finished pages are kept beside it and a read
    that stopped resumes at the first unfinished page."""
    lookahead_s: int = DEFAULT_LOOKAHEAD_S
    """Seconds after each page also searched for traces that start in it (see the module doc)."""
    skip_failed: bool = False
    """Leave out a page whose search or a fetch fails (the read report says which) instead of
    stopping the read."""
    fleet_metrics: bool = False
    """Also ask Tempo's TraceQL metrics for aggregates over the whole range
    (``kvtune.traces.tempo_metrics``)."""

    def __post_init__(self) -> None:
        where = f"TempoSource({self.base_url!r})"
        if self.api not in API_VERSIONS:
            raise TraceSourceError(f"{where}.api: expected one of {API_VERSIONS}, got {self.api!r}")
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise TraceSourceError(f"TempoSource.base_url: expected http(s)://HOST:PORT, "
                                   f"got {self.base_url!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise TraceSourceError(f"{where}.limit: expected a whole number >= 1, got {self.limit!r}")
        for name in ("start_s", "end_s", "since_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not
                                  0 <= v <= MAX_UNIX_S):
                raise TraceSourceError(f"{where}.{name}: expected whole seconds in [0, {MAX_UNIX_S}],"
                                       f" got {v!r}")
        if self.since_s is not None and self.start_s is not None:
            raise TraceSourceError(f"{where}: give start or since, not both")
        if self.since_s is not None and self.since_s < MIN_WINDOW_S:
            raise TraceSourceError(f"{where}.since_s: expected >= {MIN_WINDOW_S}, got {self.since_s}")
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise TraceSourceError(f"{where}: end ({self.end_s}) must be after start ({self.start_s})")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise TraceSourceError(f"{where}.timeout_s: expected seconds > 0, got {self.timeout_s!r}")
        if (isinstance(self.page_s, bool) or not isinstance(self.page_s, int)
                or not MIN_WINDOW_S <= self.page_s <= MAX_UNIX_S):
            raise TraceSourceError(f"{where}.page_s: expected whole seconds >= {MIN_WINDOW_S}, "
                                   f"got {self.page_s!r}")
        if (isinstance(self.lookahead_s, bool) or not isinstance(self.lookahead_s, int)
                or not 0 <= self.lookahead_s <= MAX_UNIX_S):
            raise TraceSourceError(f"{where}.lookahead_s: expected whole seconds >= 0, "
                                   f"got {self.lookahead_s!r}")
        if self.cursor is not None and (not isinstance(self.cursor, str) or not self.cursor):
            raise TraceSourceError(f"{where}.cursor: expected a file path, got {self.cursor!r}")

    @classmethod
    def from_url(cls, url: str) -> TempoSource:
        """Parses ``tempo+http(s)://HOST:PORT[/prefix]?q=&start=&end=&since=&limit=&api=``."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise TraceSourceError(f"{url}: expected a tempo+http:// or tempo+https:// URL")
        params = urllib.parse.parse_qs(parts.query)
        known = {"q", "start", "end", "since", "limit", "api", "page", "cursor", "skip_failed",
                 "metrics", "lookahead"}
        unknown = set(params) - known
        if unknown:
            _logger.warning("%s: ignoring unknown query parameter(s) %s", url, sorted(unknown))

        def one(name: str) -> str | None:
            vals = params.get(name)
            return vals[-1] if vals else None

        def as_int(name: str, what: str) -> int | None:
            val = one(name)
            if val is None or val == "":
                return None
            try:
                num = float(val)
            except ValueError:
                num = math.nan
            if not math.isfinite(num) or num < 0 or num > MAX_UNIX_S:
                raise TraceSourceError(f"{url}: query parameter {name!r}: expected {what}, "
                                       f"got {val!r}")
            return int(num)

        since = one("since")
        base = urllib.parse.urlunsplit((parts.scheme.split("+", 1)[1], parts.netloc,
                                        parts.path.rstrip("/"), "", ""))
        limit = as_int("limit", "a whole number of traces >= 1")
        if limit is not None and limit < 1:
            raise TraceSourceError(f"{url}: query parameter 'limit': expected a whole number of "
                                   f"traces >= 1, got {one('limit')!r}")
        def flag(name: str) -> bool:
            val = (one(name) or "0").strip().lower()
            if val not in _FLAGS:
                raise TraceSourceError(f"{url}: query parameter {name!r}: expected 1 or 0 "
                                       f"(true/false), got {one(name)!r}")
            return _FLAGS[val]

        page = one("page")
        lookahead = (one("lookahead") or "").strip()
        try:
            return cls(base_url=base, query=one("q") or DEFAULT_QUERY,
                       start_s=as_int("start", "unix seconds"), end_s=as_int("end", "unix seconds"),
                       limit=DEFAULT_LIMIT if limit is None else limit, api=one("api") or "auto",
                       since_s=None if not since else parse_since(since, where=f"{url}: since"),
                       page_s=DEFAULT_PAGE_S if not page else parse_since(page,
                                                                          where=f"{url}: page"),
                       lookahead_s=(DEFAULT_LOOKAHEAD_S if not lookahead else 0
                                    if lookahead in ("0", "0s") else
                                    parse_since(lookahead, where=f"{url}: lookahead")),
                       cursor=one("cursor") or None, skip_failed=flag("skip_failed"),
                       fleet_metrics=flag("metrics"))
        except TraceSourceError as exc:
            msg = str(exc)
            raise TraceSourceError(msg if msg.startswith(url) else f"{url}: {msg}") from None

    @property
    def name(self) -> str:
        return f"tempo {self.base_url} q={self.query}"

    def time_range(self, now_s: float | None = None) -> tuple[int, int, str]:
        """(start, end, where from): the range a read searches (see the module doc)."""
        now = math.ceil(time.time() if now_s is None else now_s) + 1  # +1: Tempo's end is exclusive
        end = self.end_s if self.end_s is not None else now
        if self.start_s is not None:
            start, source = self.start_s, "start/end" if self.end_s is not None else "start..now"
        elif self.since_s is not None:
            start, source = end - self.since_s, f"since={self.since_s}s"
        else:
            start, source = end - DEFAULT_SINCE_S, f"default: last {DEFAULT_SINCE_S} s"
        if end <= start:
            raise TraceSourceError(f"{self.base_url}: empty time range: start {start} >= end {end}")
        return max(start, 0), end, source

    # --- HTTP --------------------------------------------------------------------------------
    def _get(self, path: str, params: Mapping[str, object] | None = None, *,
             max_bytes: int = MAX_TRACE_BODY_BYTES) -> tuple[int, bytes]:
        """(status, body) of one GET: within ``timeout_s`` in all, redirects only to the same
        origin (``kvtune.traces.http``)."""
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        answer = http_get(url, headers={"Accept": "application/json", **self.headers},
                          timeout_s=self.timeout_s, max_bytes=max_bytes)
        return answer.status, answer.body

    def _search_once(self, start: int, end: int, limit: int) -> tuple[int, bytes, str]:
        params = {"q": self.query, "start": start, "end": end, "limit": limit}
        status, body = self._get("/api/search", params, max_bytes=MAX_SEARCH_BODY_BYTES)
        return status, body, f"{self.base_url}/api/search?{urllib.parse.urlencode(params)}"

    def pages(self, start: int, end: int) -> list[tuple[int, int]]:
        """The range ``start .. end`` cut into pages of :attr:`page_s` seconds, in order."""
        return [(lo, min(lo + self.page_s, end)) for lo in range(start, end, self.page_s)]

    def searcher(self) -> PageSearcher:
        """A :class:`PageSearcher` for this source (it keeps the limit and window length learnt
        from the server's answers, and the request count, from one page to the next)."""
        return PageSearcher(self)

    def search(self, *, now_s: float | None = None) -> TempoSearch:
        """Every trace id the query matches in the range, splitting windows that hit the limit."""
        start, end, range_from = self.time_range(now_s)
        searcher = self.searcher()
        found: dict[str, None] = {}
        windows = 0
        cut: list[str] = []
        for lo, hi in self.pages(start, end):
            page = searcher.page(lo, hi, range_start=start, range_end=end)
            windows += page.windows
            cut += page.cut_short
            for tid in page.trace_ids:
                found.setdefault(tid, None)
        return TempoSearch(url=f"{self.base_url}/api/search", query=self.query, start_s=start,
                           end_s=end, range_from=range_from, limit=searcher.limit,
                           trace_ids=tuple(found), requests=searcher.requests, windows=windows,
                           cut_short=tuple(cut))

    def fetch(self, trace_id: str) -> tuple[str, bytes]:
        """(URL, body) of one trace; the body is ``{"batches": ..}`` or ``{"trace": ..}``."""
        url, _, body = self.fetch_answer(trace_id)
        return url, body

    def fetch_answer(self, trace_id: str) -> tuple[str, int, bytes]:
        """(URL, HTTP status, body) of one trace: 200, or 206 when Tempo answered with the part
        of the trace it could read (blocks or queriers that failed)."""
        quoted = urllib.parse.quote(trace_id, safe="")
        paths = {"v1": [f"/api/traces/{quoted}"], "v2": [f"/api/v2/traces/{quoted}"],
                 "auto": [f"/api/v2/traces/{quoted}", f"/api/traces/{quoted}"]}[self.api]
        status, body = 0, b""
        for path in paths:
            status, body = self._get(path)
            if status in (200, HTTP_PARTIAL):
                return self.base_url + path, status, body
            if status != 404:
                break
        raise TraceSourceError(f"{self.base_url}{paths[-1]}: HTTP {status}: {body[:300]!r}")

    def documents(self, found: TempoSearch | None = None) -> Iterator[tuple[str, bytes]]:
        """(URL, body) for every trace the search (``found``, else a new one) finds."""
        for tid in (found or self.search()).trace_ids:
            yield self.fetch(tid)


@dataclass(frozen=True)
class PageSearch:
    """What the search of one page found: the trace ids it owns (their start falls in the page),
    the windows kept, and why it may be cut short."""

    trace_ids: tuple[str, ...]
    windows: int
    cut_short: tuple[str, ...]


class PageSearcher:
    """Searches pages of one read in turn: splits a window at the limit (down to one second) and
    at the server's longest range, lowers the limit to the server's maximum, and stops after
    :data:`MAX_SEARCH_REQUESTS` requests for one page."""

    def __init__(self, source: TempoSource) -> None:
        self.source = source
        self.limit = source.limit
        self.max_window = MAX_WINDOW_S
        self.requests = 0
        self.ahead: dict[str, int] = {}
        """Traces a window found that start in a later page of the range (trace id: start, unix
        s): that page reads them even when its own windows do not find them."""

    def page(self, lo: int, hi: int, *, range_start: int, range_end: int) -> PageSearch:
        """The traces whose start falls in ``lo .. hi`` (a trace starting before ``range_start``
        belongs to the first page; one starting at or after ``range_end`` that the page's own
        windows find, to the last), searched in windows over ``lo .. hi`` and then over the
        source's ``lookahead_s`` after ``hi`` (where only traces that start in the page are
        kept)."""
        src = self.source
        where = f"{src.base_url}/api/search"
        # Nothing has reached Tempo after now: windows stop there (Tempo refuses a window that
        # starts past its clock, its frontend clamping the end to now).
        now = math.ceil(time.time()) + 1  # as a relative range's end (Tempo's end is exclusive)
        top = max(lo, min(hi, now))
        ahead = max(hi, min(hi + src.lookahead_s, now))
        pending = ([(s, min(s + self.max_window, top)) for s in range(lo, top, self.max_window)]
                   + [(s, min(s + self.max_window, ahead))
                      for s in range(hi, ahead, self.max_window)])[::-1]
        found: dict[str, None] = {}
        windows = 0
        cut: list[str] = []
        first_request = self.requests
        while pending:
            if self.requests - first_request >= MAX_SEARCH_REQUESTS:
                cut.append(f"stopped after {self.requests - first_request} search requests for "
                           f"one page with {len(pending)} "
                           f"window(s) unsearched from {_iso(pending[-1][0])}; raise limit= or "
                           f"use shorter pages (page=)")
                break
            wlo, whi = pending.pop()
            status, body, url = src._search_once(wlo, whi, self.limit)
            self.requests += 1
            if status == 400:
                text = body[:2000].decode("utf-8", "replace")
                if _START_NOT_BEFORE_END.search(text) and wlo >= now - CLOCK_SKEW_S:
                    # Tempo's clock is behind ours: nothing there yet
                    _logger.info("%s: %s .. %s is past the server's clock; nothing to read there",
                                 where, _iso(wlo), _iso(whi))
                    windows += 1
                    continue
                too_long = _RANGE_TOO_LONG.search(text)
                too_many = _LIMIT_TOO_HIGH.search(text)
                if too_many and 1 <= int(too_many.group(1)) < self.limit:
                    _logger.info("%s: server's max_result_limit is %s; lowering limit from %d",
                                 where, too_many.group(1), self.limit)
                    self.limit = int(too_many.group(1))
                    pending.append((wlo, whi))
                    continue
                if too_long and whi - wlo > MIN_WINDOW_S:
                    server_max = _go_duration_s(too_long.group(1))
                    mw = min(self.max_window, server_max or (whi - wlo) // 2, (whi - wlo) // 2)
                    self.max_window = max(mw, MIN_WINDOW_S)
                    pending += [(s, min(s + self.max_window, whi))
                                for s in range(wlo, whi, self.max_window)][::-1]
                    continue
            if status not in (200, HTTP_PARTIAL):
                raise TraceSourceError(f"{url}: HTTP {status}: {body[:300]!r}")
            hits, partial_jobs = _search_answer(body, url)
            if len(hits) >= self.limit:
                if whi - wlo > MIN_WINDOW_S:
                    mid = wlo + (whi - wlo) // 2
                    pending += [(mid, whi), (wlo, mid)]
                    continue
                cut.append(f"{len(hits)} traces (the limit) in the one-second window starting "
                           f"{_iso(wlo)}: raise limit=")
            if partial_jobs:
                cut.append(f"{partial_jobs} in {_iso(wlo)} .. {_iso(whi)}")
            if status == HTTP_PARTIAL:
                cut.append(f"Tempo answered HTTP 206 (partial content: some blocks or queriers "
                           f"failed) for {_iso(wlo)} .. {_iso(whi)}")
            windows += 1
            for tid, start_ns in hits:
                if start_ns is not None:
                    t = max(start_ns // 10**9, range_start)
                    if wlo < hi:  # the page's own windows: a trace after the range is the last's
                        t = min(t, range_end - 1)
                    if hi <= t < range_end:
                        self.ahead[tid] = t  # a later page's
                    if not lo <= t < hi:
                        continue  # another page's trace (it started there), or after the range
                elif wlo >= hi:
                    continue  # found only after the page, with no start to place it by
                found.setdefault(tid, None)
        for tid, t in list(self.ahead.items()):
            if t < hi:  # seen by an earlier page's windows: this page's, found or not
                del self.ahead[tid]
                if lo <= t:
                    found.setdefault(tid, None)
        return PageSearch(tuple(found), windows, tuple(cut))


HTTP_PARTIAL = 206
"""Tempo's status for an answer assembled from part of the data (some blocks or queriers failed)."""


def one_sided_transfers(rows: Any, first_row: int = 0) -> int:
    """Transfers among ``rows`` (a ``SpanRows``, from ``first_row`` on) that have a ``kv.rdma``
    span and no ``kv.notify`` span or the reverse (transfers keyed by trace and transfer id)."""
    from kvtune import spans as sc

    idx, values = rows.conv.get(sc.TRANSFER_ID, ((), []))
    rdma, notify = set(), set()
    for row, tid in zip(idx, values):
        if row < first_row:
            continue
        name = rows.name[row]
        if name == sc.SpanName.RDMA.value:
            rdma.add((rows.trace_id[row], tid))
        elif name == sc.SpanName.NOTIFY.value:
            notify.add((rows.trace_id[row], tid))
    return len(rdma ^ notify)


def _search_answer(body: bytes, url: str) -> tuple[list[tuple[str, int | None]], str]:
    """((trace id, start ns or None), a note when Tempo says jobs did not complete) from a
    search answer."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise TraceSourceError(f"{url}: search answer nested too deeply to be Tempo's") from None
    except ValueError as exc:
        raise TraceFormatError(url, "(json)", "a JSON search response", got=str(exc)) from None
    if not isinstance(doc, dict):
        raise TraceFormatError(url, "(json)", "a JSON object {\"traces\": [...]}", got=doc)
    traces = doc.get("traces")
    if traces is None:
        traces = []  # Tempo omits "traces" when nothing matched
    if not isinstance(traces, list):
        raise TraceFormatError(url, "traces", "a list of {\"traceID\": ...}", got=traces)
    ids = []
    for i, t in enumerate(traces):
        tid = t.get("traceID") if isinstance(t, dict) else None
        if not isinstance(tid, str) or not tid:
            raise TraceFormatError(url, f"traces[{i}].traceID", "a trace id string", got=t)
        start = t.get("startTimeUnixNano")
        try:
            start_ns = int(start) if start is not None else None
        except (TypeError, ValueError):
            start_ns = None
        ids.append((tid, start_ns))
    note = ""
    metrics = doc.get("metrics")
    if isinstance(metrics, dict):
        done, total = metrics.get("completedJobs"), metrics.get("totalJobs")
        # Tempo stops its jobs early once it has `limit` traces: only a short answer with
        # unfinished jobs means something was not searched. inspectedBytes below totalBlockBytes
        # says nothing: Tempo reads only the columns a query needs (the recorded complete search
        # of tests/fixtures/traces/tempo_real inspected 126,560 of 177,861 bytes).
        done, total = _as_int(done), _as_int(total)
        if (done is not None and total is not None and done < total
                and len(ids) < _requested_limit(url)):
            note = f"Tempo completed {done} of {total} search jobs"
    return ids, note


def _as_int(v: object) -> int | None:
    """An int from Tempo's protobuf JSON (64-bit counts come as strings)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return None


def _requested_limit(url: str) -> int:
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    try:
        return int(q["limit"][0])
    except (KeyError, ValueError, IndexError):
        return 0
