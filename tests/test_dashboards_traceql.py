"""The TraceQL parser: what it accepts, what it rejects and where it says the error is."""
from __future__ import annotations

import pytest

from kvtune.dashboards.traceql import (
    Attribute, BoolOp, Comparison, Intrinsic, MetricsAggregate, Not, Select, SpansetFilter, SpansetOp,
    Static, TraceQLSyntaxError, Truthy, parse, tokenize,
)
from kvtune.errors import KvtuneError


def test_spanset_with_and_or_and_scoped_attributes():
    q = parse('{ name = "kv.rdma" && (span.kv.bytes > 1024 || resource.service.name =~ "kvtune-.*") }')
    assert isinstance(q.spanset, SpansetFilter)
    expr = q.spanset.expr
    assert isinstance(expr, BoolOp) and expr.op == "&&"
    assert isinstance(expr.right, BoolOp) and expr.right.op == "||"
    left = expr.left
    assert isinstance(left, Comparison) and left.op == "="
    assert left.left == Intrinsic("name", 2) and left.right == Static("string", "kv.rdma", 9)
    assert q.attributes() == {"kv.bytes", "service.name"}
    assert q.span_names() == {"kv.rdma"}
    scopes = {str(f) for f in q.fields() if isinstance(f, Attribute)}
    assert scopes == {"span.kv.bytes", "resource.service.name"}
    assert q.metrics is None


def test_and_and_or_share_one_precedence_left_to_right_as_in_tempo():
    expr = parse("{ .a = 1 || .b = 2 && .c = 3 }").spanset.expr
    assert isinstance(expr, BoolOp) and expr.op == "&&"
    assert isinstance(expr.left, BoolOp) and expr.left.op == "||"
    expr = parse("{ .a = 1 || (.b = 2 && .c = 3) }").spanset.expr
    assert expr.op == "||" and expr.right.op == "&&"


def test_unscoped_attribute_number_and_leading_dot_number():
    expr = parse("{ .kv.turn >= 2 && .x < .5 }").spanset.expr
    assert expr.left.left == Attribute("", "kv.turn", 2)
    assert expr.right.right == Static("float", 0.5, 24)


@pytest.mark.parametrize("text,ns", [("500ms", 500e6), ("1.5s", 1.5e9), ("250us", 250e3), ("10ns", 10.0),
                                     ("1h30m", 5400e9), ("2m", 120e9), ("3µs", 3e3)])
def test_duration_literals(text, ns):
    c = parse(f"{{ duration > {text} }}").spanset.expr
    assert c.right == Static("duration", ns, 13)


def test_intrinsics_status_kind_and_keywords():
    expr = parse("{ status = error && kind != server && !(span.kv.stream) && true }").spanset.expr
    flat = []

    def walk(e):
        if isinstance(e, BoolOp):
            walk(e.left), walk(e.right)
        else:
            flat.append(e)
    walk(expr)
    assert flat[0].right == Static("status", "error", 11)
    assert flat[1].right.type == "kind"
    assert isinstance(flat[2], Not) and isinstance(flat[2].operand, Truthy)
    assert isinstance(flat[3], Truthy) and flat[3].operand == Static("bool", True, 59)


def test_strings_go_escapes_raw_strings_and_quoted_attribute_names():
    expr = parse(r'{ .a = "say \"hi\"\n" && span."odd key" = `raw\.re` }').spanset.expr
    assert expr.left.right.value == 'say "hi"\n'
    assert expr.right.left == Attribute("span", "odd key", 25)
    assert expr.right.right.value == r"raw\.re"


def test_pipelines_select_and_every_metrics_function():
    q = parse("{ } | select(span.kv.bytes, duration) ")
    assert isinstance(q.stages[0], Select) and [str(f) for f in q.stages[0].fields] == ["span.kv.bytes", "duration"]
    for fn in ("rate", "count_over_time"):
        m = parse(f"{{ }} | {fn}() by (span.kv.mode, name)").metrics
        assert isinstance(m, MetricsAggregate) and m.function == fn and m.field is None
        assert [str(f) for f in m.by] == ["span.kv.mode", "name"]
    for fn in ("sum_over_time", "avg_over_time", "min_over_time", "max_over_time"):
        m = parse(f"{{ }} | {fn}(span.kv.bytes)").metrics
        assert m.function == fn and m.field == Attribute("span", "kv.bytes", len(fn) + 7) and m.by == ()
    m = parse("{ name = \"kv.rdma\" } | quantile_over_time(duration, .5, .9, .99) by (name, span.kv.mode)").metrics
    assert m.quantiles == (0.5, 0.9, 0.99) and m.field == Intrinsic("duration", 42)


def test_spanset_operators_and_filter_stage():
    q = parse('{ name = "a" } && { name = "b" } | { duration > 1ms } | count_over_time()')
    assert isinstance(q.spanset, SpansetOp) and q.spanset.op == "&&"
    assert isinstance(q.stages[0], SpansetFilter)
    assert q.span_names() == {"a", "b"}


def test_tokenizer_positions():
    toks = tokenize('{ span.kv.mode =~ "p.*" }')
    assert [(t.kind, t.pos) for t in toks] == [("punct", 0), ("attribute", 2), ("punct", 15),
                                                 ("string", 18), ("punct", 24), ("eof", 25)]


@pytest.mark.parametrize("query,position,fragment", [
    ("", 0, "spanset filter"),
    ('{ name = "kv.rdma" ', 19, "'}'"),
    ('name = "kv.rdma"', 0, "'{'"),
    ('{ name = "x" } extra', 15, "'|' or end of query"),
    ("{ .a = }", 7, "a field or a value"),
    ("{ .a 5 }", 5, "'}', '&&' or '||'"),
    ("{ name }", 7, "comparison operator"),
    ('{ duration = "slow" }', 13, "duration compares with a duration"),
    ("{ status = 2 }", 11, "status compares with a status"),
    ("{ kind = error }", 9, "kind compares with a kind"),
    ("{ status > ok }", 9, "only = and !="),
    ("{ name =~ 5 }", 7, "needs a string"),
    ('{ "a" = "b" }', 6, "needs a field"),
    ("{ duration > 5min }", 14, "unknown unit"),
    ('{ .a = "x\\.y" }', 9, "invalid escape"),
    ('{ .a = "open }', 7, "unterminated string"),
    ("{ .a = 1 } |", 12, "metrics function"),
    ("{ } | rate(1)", 11, "takes no arguments"),
    ("{ } | sum_over_time()", 20, "a field"),
    ("{ } | avg_over_time(name)", 20, "numeric field"),
    ("{ } | quantile_over_time(duration)", 33, "at least one quantile"),
    ("{ } | quantile_over_time(duration, 1.5)", 35, "[0, 1]"),
    ("{ } | rate() by ()", 17, "a field"),
    ("{ } | rate() | select(.a)", 13, "last stage"),
    ("{ } | select()", 13, "a field"),
    ("{ } | topk(5)", 6, "metrics function"),
    ("{ span. = 1 }", 7, "attribute name"),
    ("{ .a = 1 ; }", 9, "unexpected character"),
    ("{ trace:duration > 1s }", 2, "outside kvtune's subset"),
    ("{ !.a = 1 }", 2, "binds tighter"),
    ('{ !"x" }', 3, "boolean field"),
])
def test_malformed_queries_are_rejected_with_a_position(query, position, fragment):
    with pytest.raises(TraceQLSyntaxError) as info:
        parse(query)
    err = info.value
    assert isinstance(err, KvtuneError)
    assert err.position == position, str(err)
    assert fragment in err.detail, str(err)
    assert err.query == query
    # the message shows the query with a caret under the position
    lines = str(err).splitlines()
    assert lines[-1].index("^") - 2 == position


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError):
        parse(None)  # type: ignore[arg-type]
