"""Dashboards as code: builds kvtune's Grafana dashboards (Tempo datasource) as plain dicts.

Plain dicts rather than ``grafana-foundation-sdk``: the dashboards need the Tempo query fields
(``queryType``, ``metricsQueryType``, ``tableType``, ``spss``) and a trace panel driven by a
variable, which are easy to state exactly as JSON, and the toolkit gains no dependency. Every span
and attribute name comes from :mod:`kvtune.spans`; the datasource is the variable ``${DS_TEMPO}``,
never a uid. ``scripts/make_dashboards.py`` writes the result to ``dashboards/``; a test asserts the
committed JSON equals what this module produces.
"""
from __future__ import annotations

import json
from typing import Any, Final

from kvtune import spans
from kvtune.spans import SpanName

DS_VARIABLE: Final = "DS_TEMPO"
"""Name of the datasource variable every panel and query uses."""
DATASOURCE: Final = {"type": "tempo", "uid": "${" + DS_VARIABLE + "}"}
SCHEMA_VERSION: Final = 39
"""Dashboard schema version (Grafana 10.4/11); newer Grafana migrates it on load. TraceQL metrics
need Grafana >= 10.4."""
ALL_REGEX: Final = ".*"
"""Custom "All" value of the multi-value variables: they are used as regexes (``=~``)."""
SLOWEST_LIMIT: Final = 50
"""Rows of the slowest-transfers table (Tempo returns the most recent matches, the table sorts)."""
SLOWEST_SPANS_PER_TRACE: Final = 16
"""``spss`` of the slowest-transfers table: one request has one RDMA span per rank and direction,
so 16 shows every transfer of a request up to TP 8 with both directions (Tempo's default is 3)."""
DEFAULT_MIN_DURATION: Final = "0ms"
"""Default of the ``min_duration`` variable: show every transfer until the user raises it."""
QUANTILES: Final = "0.5, 0.9, 0.99"
"""The phase panels' quantiles, as written in the queries (``0.5`` rather than ``.5``: Tempo
accepts both, Grafana's editor grammar only the former)."""

KV_TRANSFER_UID: Final = "kvtune-kv-transfer"
KV_TRANSFER_FILE: Final = "kv-transfer.json"

PHASE_TITLES: Final = {
    SpanName.REGISTRATION: "Registration (decode → prefill, push)",
    SpanName.RENDEZVOUS: "Rendezvous (registration vs prefill done, push)",
    SpanName.DESCRIPTOR_SETUP: "Descriptor setup",
    SpanName.RDMA: "RDMA (post → completion)",
    SpanName.NOTIFY: "Notify (completion seen by target)",
    SpanName.DECODE_START: "Decode start (KV ready → first decode step)",
}

# --- query fragments (names from kvtune.spans only) ---------------------------------------------


def span_attr(name: str) -> str:
    """A span-scoped attribute reference: ``span.<name>``."""
    return f"span.{name}"


def resource_attr(name: str) -> str:
    """A resource-scoped attribute reference: ``resource.<name>``."""
    return f"resource.{name}"


def _q(s: str) -> str:
    """A TraceQL string literal."""
    return json.dumps(s)


def _raw(s: str) -> str:
    """A TraceQL raw (back-quoted) string: regex escapes from Grafana's ``regex`` format pass as-is."""
    return f"`{s}`"


SERVICE_FILTER: Final = f"{resource_attr(spans.SERVICE_NAME)} =~ {_raw('${service:regex}')}"
MODE_FILTER: Final = f"{span_attr(spans.MODE)} =~ {_raw('${mode:regex}')}"
CONVERSATION_FILTER: Final = f"{span_attr(spans.CONVERSATION_ID)} =~ {_raw('$conversation')}"


def _name_is(name: SpanName) -> str:
    return f"name = {_q(name.value)}"


def spanset(*conditions: str) -> str:
    return "{ " + " && ".join(conditions) + " }"


def phase_latency_query(phase: SpanName) -> str:
    """p50/p90/p99 of one phase's duration by span name and mode."""
    return (spanset(_name_is(phase), SERVICE_FILTER, MODE_FILTER)
            + f" | quantile_over_time(duration, {QUANTILES}) by (name, {span_attr(spans.MODE)})")


def phases_overview_query() -> str:
    """p90 of every phase by span name: the "where does the time go" overview."""
    any_phase = "(" + " || ".join(_name_is(p) for p in spans.PHASES) + ")"
    return spanset(any_phase, SERVICE_FILTER, MODE_FILTER) + " | quantile_over_time(duration, 0.9) by (name)"


def _by_mode_direction() -> str:
    return f"by ({span_attr(spans.MODE)}, {span_attr(spans.DIRECTION)})"


def transfer_rate_query() -> str:
    return spanset(_name_is(SpanName.RDMA), SERVICE_FILTER, MODE_FILTER) + f" | rate() {_by_mode_direction()}"


def transfer_bytes_query() -> str:
    return (spanset(_name_is(SpanName.RDMA), SERVICE_FILTER, MODE_FILTER)
            + f" | sum_over_time({span_attr(spans.BYTES)}) {_by_mode_direction()}")


def reuse_decisions_query() -> str:
    return (spanset(_name_is(SpanName.REUSE_DECISION), SERVICE_FILTER, CONVERSATION_FILTER)
            + f" | count_over_time() by ({span_attr(spans.REUSE_OUTCOME)})")


def retention_outcomes_query() -> str:
    return (spanset(_name_is(SpanName.RETENTION), SERVICE_FILTER, CONVERSATION_FILTER)
            + f" | count_over_time() by ({span_attr(spans.RETENTION_OUTCOME)})")


SLOWEST_SELECT: Final = (spans.TRANSFER_ID, spans.MODE, spans.DIRECTION, spans.BYTES, spans.DESCRIPTORS,
                         spans.NIXL_OP, spans.CONVERSATION_ID, spans.REQUEST_ID)


def slowest_transfers_query() -> str:
    return (spanset(_name_is(SpanName.RDMA), SERVICE_FILTER, MODE_FILTER, "duration >= $min_duration")
            + " | select(" + ", ".join(span_attr(a) for a in SLOWEST_SELECT) + ")")


def conversation_transfers_query() -> str:
    any_phase = "(" + " || ".join(_name_is(p) for p in spans.PHASES) + ")"
    return (spanset(any_phase, CONVERSATION_FILTER, SERVICE_FILTER)
            + " | select(" + ", ".join(span_attr(a) for a in (spans.TRANSFER_ID, spans.TURN, spans.MODE,
                                                               spans.DIRECTION, spans.BYTES)) + ")")


TRACE_QUERY: Final = "${traceID}"
"""The trace panel's query: a bare trace id makes Grafana's Tempo datasource fetch that trace."""

# --- dashboard building blocks ------------------------------------------------------------------


class _Layout:
    """Assigns panel ids and grid positions top to bottom (Grafana's grid is 24 wide)."""

    def __init__(self) -> None:
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.newline()
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0

    def take_id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i


def _target(query: str, *, ref: str = "A", metrics: bool = False, table_type: str | None = None,
            limit: int | None = None, spss: int | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": dict(DATASOURCE), "refId": ref, "queryType": "traceql",
                         "query": query, "filters": []}
    if metrics:
        t["metricsQueryType"] = "range"
    if table_type is not None:
        t["tableType"] = table_type
    if limit is not None:
        t["limit"] = limit
    if spss is not None:
        t["spss"] = spss
    return t


def _row(layout: _Layout, title: str) -> dict[str, Any]:
    layout.newline()
    panel = {"type": "row", "id": layout.take_id(), "title": title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": layout.y}}
    layout.y += 1
    return panel


def _timeseries(layout: _Layout, title: str, description: str, query: str, *, unit: str,
                w: int = 8, h: int = 8, bars: bool = False) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
                              "fillOpacity": 80 if bars else 10, "showPoints": "auto",
                              "spanNulls": False}
    if bars:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries", "id": layout.take_id(), "title": title, "description": description,
        "datasource": dict(DATASOURCE), "gridPos": layout.place(w, h),
        "targets": [_target(query, metrics=True)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _trace_link() -> dict[str, Any]:
    url = ("/d/${__dashboard.uid}?${__url_time_range}&${DS_TEMPO:queryparam}&${service:queryparam}"
           "&${mode:queryparam}&var-traceID=${__data.fields.traceIdHidden}")
    return {"title": "Show this trace below", "url": url, "targetBlank": False}


def _variables() -> list[dict[str, Any]]:
    all_current = {"selected": True, "text": ["All"], "value": ["$__all"]}
    modes = [m.value for m in spans.Mode]
    return [
        {"name": DS_VARIABLE, "label": "Tempo", "type": "datasource", "query": "tempo", "regex": "",
         "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
         "skipUrlSync": False},
        {"name": "service", "label": "Service", "type": "query", "datasource": dict(DATASOURCE),
         "definition": resource_attr(spans.SERVICE_NAME),
         "query": {"type": 1, "label": resource_attr(spans.SERVICE_NAME),
                   "refId": "TempoDatasourceVariableQueryEditor-VariableQuery"},
         "includeAll": True, "allValue": ALL_REGEX, "multi": True, "current": dict(all_current),
         "options": [], "refresh": 2, "regex": "", "sort": 1, "hide": 0, "skipUrlSync": False},
        {"name": "mode", "label": "Mode", "type": "custom", "query": ",".join(modes),
         "includeAll": True, "allValue": ALL_REGEX, "multi": True, "current": dict(all_current),
         "options": [{"selected": True, "text": "All", "value": "$__all"}]
         + [{"selected": False, "text": m, "value": m} for m in modes],
         "hide": 0, "skipUrlSync": False},
        {"name": "conversation", "label": "Conversation id (regex)", "type": "textbox",
         "query": ALL_REGEX, "current": {"text": ALL_REGEX, "value": ALL_REGEX},
         "options": [{"selected": True, "text": ALL_REGEX, "value": ALL_REGEX}], "hide": 0,
         "description": "Applies to the reuse/retention panels and the conversation table; spans "
                        "without a conversation id (probe) never match it.", "skipUrlSync": False},
        {"name": "min_duration", "label": "Slowest: at least", "type": "textbox",
         "query": DEFAULT_MIN_DURATION,
         "current": {"text": DEFAULT_MIN_DURATION, "value": DEFAULT_MIN_DURATION},
         "options": [{"selected": True, "text": DEFAULT_MIN_DURATION, "value": DEFAULT_MIN_DURATION}],
         "hide": 0, "description": "TraceQL duration (e.g. 5ms): RDMA spans at least this long.",
         "skipUrlSync": False},
        {"name": "traceID", "label": "Trace id", "type": "textbox", "query": "",
         "current": {"text": "", "value": ""}, "options": [], "hide": 0,
         "description": "Set by clicking a row of the slowest-transfers table.", "skipUrlSync": False},
    ]


DEFAULT_VARIABLE_VALUES: Final[dict[str, str]] = {
    "service": ALL_REGEX, "mode": ALL_REGEX, "conversation": ALL_REGEX,
    "min_duration": DEFAULT_MIN_DURATION, "traceID": "",
}
"""What the dashboard's variables hold when it opens (the "All" values and defaults)."""
ALL_VALUES: Final[dict[str, str]] = {"service": ALL_REGEX, "mode": ALL_REGEX}
"""Custom "All" values (inserted unformatted, as Grafana does)."""


def kv_transfer_dashboard() -> dict[str, Any]:
    """The "kvtune — KV transfer" dashboard: where each transfer's time goes."""
    L = _Layout()
    panels: list[dict[str, Any]] = []
    panels.append(_row(L, "Where the time goes (per phase)"))
    panels.append(_timeseries(
        L, "p90 per phase", "p90 duration of each phase of a KV transfer, side by side.",
        phases_overview_query(), unit="s", w=24, h=8))
    L.newline()
    for phase in spans.PHASES:
        panels.append(_timeseries(
            L, PHASE_TITLES[phase],
            f"p50/p90/p99 of `{phase.value}` spans by span name and mode.",
            phase_latency_query(phase), unit="s"))
    panels.append(_row(L, "Volume"))
    panels.append(_timeseries(
        L, "Transfers per second by mode and direction",
        f"Rate of `{SpanName.RDMA.value}` spans (one per KV movement per rank).",
        transfer_rate_query(), unit="ops", w=12))
    panels.append(_timeseries(
        L, "Bytes moved by mode and direction",
        f"Sum of `{spans.BYTES}` over `{SpanName.RDMA.value}` spans per interval.",
        transfer_bytes_query(), unit="bytes", w=12, bars=True))
    panels.append(_row(L, "Reuse and retention (bidirectional)"))
    panels.append(_timeseries(
        L, "Reuse decisions", f"`{SpanName.REUSE_DECISION.value}` by `{spans.REUSE_OUTCOME}`: "
                              + ", ".join(o.value for o in spans.ReuseOutcome) + ".",
        reuse_decisions_query(), unit="short", w=12, bars=True))
    panels.append(_timeseries(
        L, "Retention outcomes", f"`{SpanName.RETENTION.value}` by `{spans.RETENTION_OUTCOME}`: "
                                 + ", ".join(o.value for o in spans.RetentionOutcome) + ".",
        retention_outcomes_query(), unit="short", w=12, bars=True))
    panels.append(_row(L, "Transfers"))
    panels.append({
        "type": "table", "id": L.take_id(), "title": "Slowest transfers",
        "description": f"`{SpanName.RDMA.value}` spans at least $min_duration long, slowest first. "
                       "Click a row to show its trace below.",
        "datasource": dict(DATASOURCE), "gridPos": L.place(24, 10),
        "targets": [_target(slowest_transfers_query(), table_type="spans", limit=SLOWEST_LIMIT,
                            spss=SLOWEST_SPANS_PER_TRACE)],
        "fieldConfig": {"defaults": {"links": [_trace_link()], "custom": {"align": "auto"}},
                        "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": "Duration", "desc": True}],
                    "footer": {"show": False, "reducer": ["sum"], "fields": ""}},
    })
    panels.append({
        "type": "traces", "id": L.take_id(), "title": "Trace ${traceID}",
        "description": "The trace picked in the table above (variable traceID).",
        "datasource": dict(DATASOURCE), "gridPos": L.place(24, 16),
        "targets": [_target(TRACE_QUERY)],
    })
    panels.append(_row(L, "Conversation"))
    panels.append({
        "type": "table", "id": L.take_id(), "title": "Transfer phases of conversation $conversation",
        "description": "Phase spans carrying a conversation id matching the variable.",
        "datasource": dict(DATASOURCE), "gridPos": L.place(24, 10),
        "targets": [_target(conversation_transfers_query(), table_type="spans", limit=SLOWEST_LIMIT,
                            spss=len(spans.PHASES))],
        "fieldConfig": {"defaults": {"links": [_trace_link()]}, "overrides": []},
        "options": {"showHeader": True},
    })
    return {
        "uid": KV_TRANSFER_UID,
        "title": "kvtune — KV transfer",
        "description": "Where each KV transfer's time goes, from kvtune's spans in Tempo "
                       f"(span convention {spans.CONVENTION_VERSION}).",
        "tags": ["kvtune", "kv-cache", "tempo"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": _variables()},
        "panels": panels,
    }


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard kvtune ships, by file name."""
    return {KV_TRANSFER_FILE: kv_transfer_dashboard()}


def render(dashboard: dict[str, Any]) -> str:
    """The JSON text written to disk (stable: 2-space indent, trailing newline)."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"
