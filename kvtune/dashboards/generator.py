"""Dashboards as code: builds kvtune's Grafana dashboards (Tempo datasource) with Grafana's own
``grafana-foundation-sdk`` (its Grafana 11.6 schema: ``TempoQuery`` with ``queryType``,
``metricsQueryType``, ``tableType`` and ``spss``), returned as the JSON dicts Grafana loads. Every
span and attribute name comes from :mod:`kvtune.spans`; the datasource is the variable
``${DS_TEMPO}``, never a uid. ``scripts/make_dashboards.py`` writes the result to ``dashboards/``; a test asserts the
committed JSON equals what this module produces.
"""
from __future__ import annotations

import json
from typing import Any, Final

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as sdk_dashboard
from grafana_foundation_sdk.builders import table, timeseries
from grafana_foundation_sdk.builders import tempo as tempo_builders
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import tempo as tempo_models
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync, DataSourceRef, DynamicConfigValue, VariableOption, VariableRefresh,
    VariableSort,
)

from kvtune import spans
from kvtune.spans import SpanName

DS_VARIABLE: Final = "DS_TEMPO"
"""Name of the datasource variable every panel and query uses."""
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
    SpanName.NOTIFY: "Notify (completions seen by the target, per interval)",
    SpanName.DECODE_START: "Decode start (KV ready → first decode step)",
}
INSTANT_PHASES: Final = (SpanName.NOTIFY,)
"""Phases the connectors record as instants (start = end: the moment the target sees the
completion). Tempo's ``quantile_over_time(duration)`` skips spans shorter than 2 ns (its log2
histogram has no bucket for them), so a latency panel would stay empty: these panels count the
spans instead. The delay itself is kvtune's ``notify_ms`` (target's notify - initiator's RDMA end)."""
TIMED_PHASES: Final = tuple(p for p in spans.PHASES if p not in INSTANT_PHASES)
"""Phases with an extent: their panels show duration quantiles."""

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


def phase_count_query(phase: SpanName) -> str:
    """Spans of an instant phase per interval, by mode and status (errors show apart)."""
    return (spanset(_name_is(phase), SERVICE_FILTER, MODE_FILTER)
            + f" | count_over_time() by ({span_attr(spans.MODE)}, status)")


def phases_overview_query() -> str:
    """p90 of every timed phase by span name: the "where does the time go" overview."""
    any_phase = "(" + " || ".join(_name_is(p) for p in TIMED_PHASES) + ")"
    return spanset(any_phase, SERVICE_FILTER, MODE_FILTER) + " | quantile_over_time(duration, 0.9) by (name)"


SHARE_SPANS: Final = tuple(n for n in spans.TTFT_STEP_SPANS if n not in INSTANT_PHASES)
"""The spans of the per-phase share panel: every step of a request's TTFT that has an extent (the
router's phases and the engines' spans; not the request itself, nor retention between turns).
``kvtune.analysis.attribution.summed_span_shares`` computes the panel's shares offline."""


def phase_shares_query() -> str:
    """Time summed per span name per interval: the panel stacks it to 100%, each name's share."""
    any_step = "(" + " || ".join(_name_is(n) for n in SHARE_SPANS) + ")"
    return (spanset(any_step, SERVICE_FILTER, MODE_FILTER)
            + " | sum_over_time(duration) by (name)")


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


def retention_held_query() -> str:
    """Seconds each retained history was held (``kv.retention``'s duration), summed per interval by
    outcome. Not weighted by the history's size: Tempo's metrics functions (2.10, 3.0) take one
    attribute, so ``duration x kv.tokens`` cannot be summed in TraceQL (see
    :func:`retention_tokens_query`)."""
    return (spanset(_name_is(SpanName.RETENTION), SERVICE_FILTER, CONVERSATION_FILTER)
            + f" | sum_over_time(duration) by ({span_attr(spans.RETENTION_OUTCOME)})")


def retention_tokens_query() -> str:
    """Tokens of the retained histories (``kv.tokens`` of ``kv.retention``), summed per interval
    by outcome: with :func:`retention_held_query`, how much KV the decode held and for how long."""
    return (spanset(_name_is(SpanName.RETENTION), SERVICE_FILTER, CONVERSATION_FILTER)
            + f" | sum_over_time({span_attr(spans.TOKENS)}) by ({span_attr(spans.RETENTION_OUTCOME)})")


def retention_renewals_query() -> str:
    """Retained histories per interval by how many times the router renewed their lease; histories
    held under vLLM's fixed TTL carry no renewal count and group under ``nil``."""
    return (spanset(_name_is(SpanName.RETENTION), SERVICE_FILTER, CONVERSATION_FILTER)
            + f" | count_over_time() by ({span_attr(spans.RETENTION_RENEWALS)})")


RETENTION_COLORS: Final[dict[spans.RetentionOutcome, str]] = {
    spans.RetentionOutcome.REUSED: "green",
    spans.RetentionOutcome.ENDED: "blue",
    spans.RetentionOutcome.EXPIRED: "orange",
    spans.RetentionOutcome.LAPSED: "red",
    spans.RetentionOutcome.EVICTED: "purple",
    spans.RetentionOutcome.RELEASED: "text",
}
"""Fixed series colours of the retention panels: a lapse (the lease ran out unrenewed: the router
stopped renewing, or is gone) is red, whatever else the interval holds."""


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

# --- dashboard building blocks (grafana-foundation-sdk) -----------------------------------------


def _ds() -> DataSourceRef:
    return DataSourceRef(type_val="tempo", uid="${" + DS_VARIABLE + "}")


def _target(query: str, *, ref: str = "A", metrics: bool = False,
            table_type: tempo_models.SearchTableType | None = None, limit: int | None = None,
            spss: int | None = None) -> tempo_builders.TempoQuery:
    t = (tempo_builders.TempoQuery().datasource(_ds()).ref_id(ref)
         .query_type(tempo_models.TempoQueryType.TRACEQL.value).query(query))
    if metrics:
        t = t.metrics_query_type(tempo_models.MetricsQueryType.RANGE)
    if table_type is not None:
        t = t.table_type(table_type)
    if limit is not None:
        t = t.limit(limit)
    if spss is not None:
        t = t.spss(spss)
    return t


class _Ids:
    """Panel ids in the order panels are added."""

    def __init__(self) -> None:
        self.next_id = 0

    def __call__(self) -> int:
        self.next_id += 1
        return self.next_id


def _row(ids: _Ids, title: str) -> sdk_dashboard.Row:
    return sdk_dashboard.Row(title).id(ids()).collapsed(False)


def _timeseries(ids: _Ids, title: str, description: str, query: str, *, unit: str,
                w: int = 8, h: int = 8, bars: bool = False,
                percent: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().id(ids()).title(title).description(description).datasource(_ds())
             .span(w).height(h).with_target(_target(query, metrics=True)).unit(unit)
             .draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
             .line_width(1).fill_opacity(80 if bars else 10)
             .show_points(common.VisibilityMode.AUTO).span_nulls(False)
             .legend(common_builders.VizLegendOptions()
                     .display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True)
                     .calcs(["lastNotNull", "max"]))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if bars:
        panel = panel.stacking(common_builders.StackingConfig().mode(
            common.StackingMode.PERCENT if percent else common.StackingMode.NORMAL).group("A"))
    return panel


def _outcome_colors(panel: timeseries.Panel) -> timeseries.Panel:
    """Fix each retention outcome's colour (series named by their label value, with or without
    the label's name around it)."""
    for outcome, color in RETENTION_COLORS.items():
        panel = panel.override_by_regexp(
            f'^(.*"{outcome.value}".*|{outcome.value})$',
            [DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color})])
    return panel


def _trace_link() -> sdk_dashboard.DashboardLink:
    url = ("/d/${__dashboard.uid}?${__url_time_range}&${DS_TEMPO:queryparam}&${service:queryparam}"
           "&${mode:queryparam}&var-traceID=${__data.fields.traceIdHidden}")
    return sdk_dashboard.DashboardLink("Show this trace below").url(url).target_blank(False)


def _all_current() -> VariableOption:
    return VariableOption(selected=True, text=["All"], value=["$__all"])


def _textbox(name: str, label: str, default: str, description: str) -> sdk_dashboard.TextBoxVariable:
    option = VariableOption(selected=True, text=default, value=default)
    v = (sdk_dashboard.TextBoxVariable(name).label(label).default_value(default)
         .current(VariableOption(text=default, value=default))
         .options([option] if default else []))
    return v.description(description) if description else v


def _variables() -> list[Any]:
    modes = [m.value for m in spans.Mode]
    return [
        sdk_dashboard.DatasourceVariable(DS_VARIABLE).label("Tempo").type("tempo").regex("")
        .multi(False).include_all(False),
        sdk_dashboard.QueryVariable("service").label("Service").datasource(_ds())
        .query({"type": 1, "label": resource_attr(spans.SERVICE_NAME),
                "refId": "TempoDatasourceVariableQueryEditor-VariableQuery"})
        .include_all(True).all_value(ALL_REGEX).multi(True).current(_all_current())
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).regex("")
        .sort(VariableSort.ALPHABETICAL_ASC),
        sdk_dashboard.CustomVariable("mode").label("Mode").values(",".join(modes))
        .include_all(True).all_value(ALL_REGEX).multi(True).current(_all_current())
        .options([VariableOption(selected=True, text="All", value="$__all")]
                 + [VariableOption(selected=False, text=m, value=m) for m in modes]),
        _textbox("conversation", "Conversation id (regex)", ALL_REGEX,
                 "Applies to the reuse/retention panels and the conversation table; spans without "
                 "a conversation id (probe) never match it."),
        _textbox("min_duration", "Slowest: at least", DEFAULT_MIN_DURATION,
                 "TraceQL duration (e.g. 5ms): RDMA spans at least this long."),
        _textbox("traceID", "Trace id", "", "Set by clicking a row of the slowest-transfers table."),
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
    ids = _Ids()
    d = (sdk_dashboard.Dashboard("kvtune — KV transfer").uid(KV_TRANSFER_UID)
         .description("Where each KV transfer's time goes, from kvtune's spans in Tempo "
                      f"(span convention {spans.CONVENTION_VERSION}).")
         .tags(["kvtune", "kv-cache", "tempo"]).version(1).editable()
         .tooltip(DashboardCursorSync.CROSSHAIR).timezone("browser").time("now-1h", "now")
         .refresh("").variables(_variables()))
    d = d.with_row(_row(ids, "Where the time goes (per phase)"))
    d = d.with_panel(_timeseries(
        ids, "p90 per phase", "p90 duration of each timed phase of a KV transfer, side by side "
                              "(notify is an instant: see its own panel).",
        phases_overview_query(), unit="s", w=24, h=8))
    d = d.with_panel(_timeseries(
        ids, "Share of time per phase (router legs and engine spans)",
        "Each span's summed duration per interval, stacked to 100%: the router's phases "
        f"({', '.join(p.value for p in spans.ROUTER_PHASES)}) and the engines' spans. Spans that "
        "nest (an engine's inside the router's leg) or run side by side are each counted in full "
        "here; the exact share of TTFT per phase, each instant given to one span, is "
        "`bench/attribution.py` and the waterfalls of the report (kvtune.analysis.attribution).",
        phase_shares_query(), unit="s", w=24, bars=True, percent=True))
    for phase in spans.PHASES:
        if phase in INSTANT_PHASES:
            d = d.with_panel(_timeseries(
                ids, PHASE_TITLES[phase],
                f"`{phase.value}` spans per interval by mode and status. They are instants (the "
                f"moment the target sees the completion), so they have no duration to plot; the "
                f"delay after the initiator's RDMA is kvtune's `notify_ms` (`kvtune analyze`).",
                phase_count_query(phase), unit="short", bars=True))
            continue
        d = d.with_panel(_timeseries(
            ids, PHASE_TITLES[phase], f"p50/p90/p99 of `{phase.value}` spans by span name and mode.",
            phase_latency_query(phase), unit="s"))
    d = d.with_row(_row(ids, "Volume"))
    d = d.with_panel(_timeseries(
        ids, "Transfers per second by mode and direction",
        f"Rate of `{SpanName.RDMA.value}` spans (one per KV movement per rank).",
        transfer_rate_query(), unit="ops", w=12))
    d = d.with_panel(_timeseries(
        ids, "Bytes moved by mode and direction",
        f"Sum of `{spans.BYTES}` over `{SpanName.RDMA.value}` spans per interval.",
        transfer_bytes_query(), unit="bytes", w=12, bars=True))
    d = d.with_row(_row(ids, "Reuse and retention (bidirectional)"))
    d = d.with_panel(_timeseries(
        ids, "Reuse decisions", f"`{SpanName.REUSE_DECISION.value}` by `{spans.REUSE_OUTCOME}`: "
                                + ", ".join(o.value for o in spans.ReuseOutcome) + ".",
        reuse_decisions_query(), unit="short", w=12, bars=True))
    d = d.with_panel(_outcome_colors(_timeseries(
        ids, "Retention outcomes", f"`{SpanName.RETENTION.value}` by `{spans.RETENTION_OUTCOME}`: "
        + ", ".join(o.value for o in spans.RetentionOutcome) + ". With the renewable decode lease, "
        f"`{spans.RetentionOutcome.ENDED.value}` is the router releasing a finished conversation's "
        f"blocks and `{spans.RetentionOutcome.LAPSED.value}` (red) a lease that ran out unrenewed "
        "(the router stopped renewing, or is gone).",
        retention_outcomes_query(), unit="short", w=12, bars=True)))
    d = d.with_panel(_outcome_colors(_timeseries(
        ids, "Decode KV held: seconds by outcome",
        f"Seconds the decode held retained histories: the duration of each `{SpanName.RETENTION.value}` "
        "span (from the turn's end to its blocks' reuse or release), summed by the interval its hold "
        f"began in, by `{spans.RETENTION_OUTCOME}`. History-seconds, not token- or block-seconds: "
        "TraceQL metrics (Tempo 2.10, 3.0) sum one attribute and cannot multiply a span's duration "
        f"by its `{spans.TOKENS}`; the panel beside it shows those tokens. Block-seconds per policy "
        "are in `recommendation.json` (`retention`).",
        retention_held_query(), unit="s", w=12, bars=True)))
    d = d.with_panel(_outcome_colors(_timeseries(
        ids, "Decode KV held: tokens by outcome",
        f"`{spans.TOKENS}` of the retained histories (`{SpanName.RETENTION.value}`), summed by the "
        f"interval their hold began in, by `{spans.RETENTION_OUTCOME}`: how much KV was kept, "
        "beside how long (the panel before). Tokens lapsed or expired were held for nothing.",
        retention_tokens_query(), unit="short", w=12, bars=True)))
    d = d.with_panel(_timeseries(
        ids, "Renewals per retained history",
        f"Retained histories (`{SpanName.RETENTION.value}`) per interval by "
        f"`{spans.RETENTION_RENEWALS}`: how many times the router renewed each one's decode lease "
        "before its blocks went. `nil`: held under vLLM's fixed TTL (no renewable lease).",
        retention_renewals_query(), unit="short", w=24, bars=True))
    d = d.with_row(_row(ids, "Transfers"))
    d = d.with_panel(
        table.Panel().id(ids()).title("Slowest transfers")
        .description(f"`{SpanName.RDMA.value}` spans at least $min_duration long, slowest first. "
                     "Click a row to show its trace below.")
        .datasource(_ds()).span(24).height(10)
        .with_target(_target(slowest_transfers_query(), table_type=tempo_models.SearchTableType.SPANS,
                             limit=SLOWEST_LIMIT, spss=SLOWEST_SPANS_PER_TRACE))
        .data_links([_trace_link()]).show_header(True)
        .sort_by([common_builders.TableSortByFieldState().display_name("Duration").desc(True)])
        .footer(common_builders.TableFooterOptions().show(False).reducer(["sum"]).fields([])))
    d = d.with_panel(
        sdk_dashboard.Panel().type("traces").id(ids()).title("Trace ${traceID}")
        .description("The trace picked in the table above (variable traceID).")
        .datasource(_ds()).span(24).height(16).with_target(_target(TRACE_QUERY)))
    d = d.with_row(_row(ids, "Conversation"))
    d = d.with_panel(
        table.Panel().id(ids()).title("Transfer phases of conversation $conversation")
        .description("Phase spans carrying a conversation id matching the variable.")
        .datasource(_ds()).span(24).height(10)
        .with_target(_target(conversation_transfers_query(),
                             table_type=tempo_models.SearchTableType.SPANS, limit=SLOWEST_LIMIT,
                             spss=len(spans.PHASES)))
        .data_links([_trace_link()]).show_header(True))
    return json.loads(JSONEncoder(sort_keys=True).encode(d.build()))


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard kvtune ships, by file name."""
    return {KV_TRANSFER_FILE: kv_transfer_dashboard()}


def render(dashboard: dict[str, Any]) -> str:
    """The JSON text written to disk (stable: 2-space indent, trailing newline)."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"
