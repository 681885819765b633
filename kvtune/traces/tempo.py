"""Reading traces from a Grafana Tempo server over its HTTP API.

Search (``GET /api/search?q=<TraceQL>&start=&end=&limit=`` -> ``{"traces": [{"traceID": ..}]}``),
then fetch each trace: ``/api/v2/traces/<id>`` (``{"trace": {"resourceSpans": [...]}}``) or
``/api/traces/<id>`` (``{"batches": [...]}``). With ``api="auto"`` the v2 path is tried first and a
404 falls back to v1. Trace ids may come back hex or base64 (Tempo's protobuf-JSON); the loader
accepts both.

A source URL: ``tempo+http://HOST:PORT[/prefix]?q={}&start=<unix s>&end=<unix s>&limit=<n>``.
"""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kvtune.errors import TraceFormatError, TraceSourceError

_logger = logging.getLogger(__name__)

SCHEMES = ("tempo+http", "tempo+https")
DEFAULT_QUERY = "{}"
DEFAULT_LIMIT = 1000
"""Traces per search when the URL gives no ``limit`` (Tempo's own default is 20)."""
DEFAULT_TIMEOUT_S = 30.0
API_VERSIONS = ("auto", "v1", "v2")


@dataclass(frozen=True)
class TempoSource:
    """A Tempo server and a search (TraceQL ``query``, unix-seconds ``start``/``end``, ``limit``)."""

    base_url: str
    query: str = DEFAULT_QUERY
    start_s: int | None = None
    end_s: int | None = None
    limit: int = DEFAULT_LIMIT
    api: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in API_VERSIONS:
            raise TraceSourceError(f"TempoSource.api: expected one of {API_VERSIONS}, got {self.api!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise TraceSourceError(f"TempoSource.base_url: expected http(s)://HOST:PORT, "
                                   f"got {self.base_url!r}")

    @classmethod
    def from_url(cls, url: str) -> TempoSource:
        """Parses ``tempo+http(s)://HOST:PORT[/prefix]?q=&start=&end=&limit=``."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise TraceSourceError(f"{url}: expected a tempo+http:// or tempo+https:// URL")
        params = urllib.parse.parse_qs(parts.query)
        known = {"q", "start", "end", "limit", "api"}
        unknown = set(params) - known
        if unknown:
            _logger.warning("%s: ignoring unknown query parameter(s) %s", url, sorted(unknown))

        def one(name: str) -> str | None:
            vals = params.get(name)
            return vals[-1] if vals else None

        def as_int(name: str) -> int | None:
            val = one(name)
            if val is None or val == "":
                return None
            try:
                return int(float(val))
            except ValueError:
                raise TraceSourceError(f"{url}: query parameter {name!r}: expected a number, "
                                       f"got {val!r}") from None

        base = urllib.parse.urlunsplit((parts.scheme.split("+", 1)[1], parts.netloc,
                                        parts.path.rstrip("/"), "", ""))
        limit = as_int("limit")
        return cls(base_url=base, query=one("q") or DEFAULT_QUERY, start_s=as_int("start"),
                   end_s=as_int("end"), limit=DEFAULT_LIMIT if limit is None else limit,
                   api=one("api") or "auto")

    @property
    def name(self) -> str:
        return f"tempo {self.base_url} q={self.query}"

    # --- HTTP --------------------------------------------------------------------------------
    def _get(self, path: str, params: Mapping[str, object] | None = None) -> tuple[int, bytes]:
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(url, headers={"Accept": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read() or b""
        except (urllib.error.URLError, OSError) as exc:
            raise TraceSourceError(f"{url}: Tempo unreachable: {exc}") from exc

    def search(self) -> list[str]:
        """Trace ids matching the query and time range."""
        status, body = self._get("/api/search", {"q": self.query, "start": self.start_s,
                                                 "end": self.end_s, "limit": self.limit})
        where = f"{self.base_url}/api/search"
        if status != 200:
            raise TraceSourceError(f"{where}: HTTP {status}: {body[:300]!r}")
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise TraceFormatError(where, "(json)", "a JSON search response", got=str(exc)) from None
        traces = doc.get("traces") if isinstance(doc, dict) else None
        if traces is None:
            traces = []  # Tempo omits "traces" when nothing matched
        if not isinstance(traces, list):
            raise TraceFormatError(where, "traces", "a list of {\"traceID\": ...}", got=traces)
        ids = []
        for i, t in enumerate(traces):
            tid = t.get("traceID") if isinstance(t, dict) else None
            if not isinstance(tid, str) or not tid:
                raise TraceFormatError(where, f"traces[{i}].traceID", "a trace id string", got=t)
            ids.append(tid)
        return ids

    def fetch(self, trace_id: str) -> tuple[str, bytes]:
        """(URL, body) of one trace; the body is ``{"batches": ..}`` or ``{"trace": ..}``."""
        quoted = urllib.parse.quote(trace_id, safe="")
        paths = {"v1": [f"/api/traces/{quoted}"], "v2": [f"/api/v2/traces/{quoted}"],
                 "auto": [f"/api/v2/traces/{quoted}", f"/api/traces/{quoted}"]}[self.api]
        status, body = 0, b""
        for path in paths:
            status, body = self._get(path)
            if status == 200:
                return self.base_url + path, body
            if status != 404:
                break
        raise TraceSourceError(f"{self.base_url}{paths[-1]}: HTTP {status}: {body[:300]!r}")

    def documents(self) -> Iterator[tuple[str, bytes]]:
        """(URL, body) for every trace the search finds."""
        for tid in self.search():
            yield self.fetch(tid)
