"""A recursive-descent parser for the TraceQL subset kvtune's dashboards use.

Grammar (whitespace between tokens is free)::

    query       := spanset_expr ( "|" stage )*
    spanset_expr:= spanset_term ( ("&&" | "||") spanset_term )*
    spanset_term:= "{" [ field_expr ] "}" | "(" spanset_expr ")"
    stage       := spanset_term                      -- a further filter
                 | "select" "(" field ( "," field )* ")"
                 | metrics_fn "(" [ args ] ")" [ "by" "(" field ( "," field )* ")" ]
    field_expr  := unary ( ("&&" | "||") unary )*    -- one precedence level, left to right (Tempo's)
    unary       := "!" ( "(" field_expr ")" | "!" ... | field | true | false )
                 | "(" field_expr ")" | operand [ cmp_op operand ]
    operand     := field | static
    field       := intrinsic | "span:" intrinsic | attribute
    intrinsic   := name | duration | status | kind
    attribute   := ( "span." | "resource." | "." ) attribute_name | scope '."' quoted '"'
    static      := string | number | duration_literal | true | false | nil
                 | ok | error | unset | unspecified | internal | server | client | producer | consumer
    cmp_op      := "=" | "!=" | "<" | "<=" | ">" | ">=" | "=~" | "!~"
    metrics_fn  := rate | count_over_time | sum_over_time | avg_over_time | min_over_time
                 | max_over_time | quantile_over_time

Strings are double-quoted with Go escapes (what Tempo's ``strconv.Unquote`` accepts) or
back-quoted raw strings. Durations are a number with a unit (``500ms``, ``1.5s``, ``1h30m``).

Beyond syntax, the parser checks what Tempo would reject: intrinsics compared with values of the
wrong type (``duration = "x"``, ``status = 1``), regex operators without a string, a metrics function
that is not the last stage, wrong arguments to a metrics function (``rate(1)``,
``quantile_over_time(duration)``, a quantile outside [0, 1]). Every error names its position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Union

from kvtune.errors import KvtuneError

# --- Errors -------------------------------------------------------------------------------------


class TraceQLSyntaxError(KvtuneError):
    """A TraceQL query is malformed: says where (0-based character offset) and what was expected."""

    def __init__(self, query: str, position: int, message: str) -> None:
        self.query, self.position, self.detail = query, position, message
        caret = " " * position + "^"
        super().__init__(f"TraceQL query at position {position}: {message}\n  {query}\n  {caret}")


# --- Tokens -------------------------------------------------------------------------------------

DURATION_UNITS_NS: Final[dict[str, float]] = {
    "ns": 1.0, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9,
}
"""Duration literal units, in nanoseconds per unit (Go's ``time.ParseDuration`` units)."""

INTRINSICS: Final = frozenset({"name", "duration", "status", "kind", "statusMessage"})
"""Span intrinsics the subset knows."""
STATUS_VALUES: Final = frozenset({"ok", "error", "unset"})
KIND_VALUES: Final = frozenset({"unspecified", "internal", "server", "client", "producer", "consumer"})
METRICS_FUNCTIONS: Final = frozenset({
    "rate", "count_over_time", "sum_over_time", "avg_over_time", "min_over_time", "max_over_time",
    "quantile_over_time",
})
COMPARISON_OPS: Final = ("=", "!=", "<", "<=", ">", ">=", "=~", "!~")
REGEX_OPS: Final = frozenset({"=~", "!~"})
ATTRIBUTE_SCOPES: Final = ("span", "resource", "parent")

# Characters that end an attribute name (besides whitespace); mirrors what TraceQL allows inside
# attribute names: dots, dashes, slashes and colons are part of the name.
_ATTRIBUTE_STOP: Final = frozenset("(){}=~!<>&|^,\"`")
_PUNCT: Final = ("&&", "||", "!=", "=~", "!~", "<=", ">=", "{", "}", "(", ")", ",", "|", "!", "=",
                 "<", ">", "-")
_GO_ESCAPES: Final = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                      "\\": "\\", '"': '"'}


@dataclass(frozen=True)
class Token:
    kind: str
    """``punct``, ``ident``, ``string``, ``number``, ``duration``, ``attribute``, ``eof``."""
    text: str
    pos: int
    value: object = None


def tokenize(query: str) -> list[Token]:
    """Split a query into tokens; raise :class:`TraceQLSyntaxError` on an unknown character."""
    tokens: list[Token] = []
    i, n = 0, len(query)
    while i < n:
        c = query[i]
        if c.isspace():
            i += 1
            continue
        if c == '"':
            value, j = _scan_string(query, i)
            tokens.append(Token("string", query[i:j], i, value))
            i = j
            continue
        if c == "`":
            j = query.find("`", i + 1)
            if j < 0:
                raise TraceQLSyntaxError(query, i, "unterminated raw string")
            tokens.append(Token("string", query[i:j + 1], i, query[i + 1:j]))
            i = j + 1
            continue
        if c.isdigit() or (c == "." and i + 1 < n and query[i + 1].isdigit()):
            tok, i = _scan_number(query, i)
            tokens.append(tok)
            continue
        if c == ".":  # unscoped attribute
            name, j = _scan_attribute_name(query, i + 1)
            tokens.append(Token("attribute", query[i:j], i, ("", name)))
            i = j
            continue
        if c.isalpha() or c == "_":
            j = i
            while j < n and (query[j].isalnum() or query[j] == "_"):
                j += 1
            word = query[i:j]
            if word in ATTRIBUTE_SCOPES and j < n and query[j] == ".":
                name, k = _scan_attribute_name(query, j + 1)
                tokens.append(Token("attribute", query[i:k], i, (word, name)))
                i = k
                continue
            if word in ("span", "trace") and j < n and query[j] == ":":
                k = j + 1
                while k < n and (query[k].isalnum() or query[k] == "_"):
                    k += 1
                intrinsic = query[j + 1:k]
                if not intrinsic:
                    raise TraceQLSyntaxError(query, j + 1, f"expected an intrinsic after '{word}:'")
                tokens.append(Token("ident", query[i:k], i, (word, intrinsic)))
                i = k
                continue
            tokens.append(Token("ident", word, i, (None, word)))
            i = j
            continue
        for p in _PUNCT:
            if query.startswith(p, i):
                tokens.append(Token("punct", p, i))
                i += len(p)
                break
        else:
            raise TraceQLSyntaxError(query, i, f"unexpected character {c!r}")
    tokens.append(Token("eof", "", n))
    return tokens


def _scan_string(query: str, start: int) -> tuple[str, int]:
    out: list[str] = []
    i = start + 1
    while i < len(query):
        c = query[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\n":
            break
        if c == "\\":
            if i + 1 >= len(query):
                break
            e = query[i + 1]
            if e in _GO_ESCAPES:
                out.append(_GO_ESCAPES[e])
                i += 2
                continue
            if e in "xuU":
                width = {"x": 2, "u": 4, "U": 8}[e]
                digits = query[i + 2:i + 2 + width]
                if len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
                    out.append(chr(int(digits, 16)))
                    i += 2 + width
                    continue
            raise TraceQLSyntaxError(query, i, f"invalid escape '\\{e}' in string "
                                               "(TraceQL strings take Go escapes; use a `raw` string)")
        out.append(c)
        i += 1
    raise TraceQLSyntaxError(query, start, "unterminated string")


def _scan_number(query: str, start: int) -> tuple[Token, int]:
    i, n = start, len(query)
    total_ns = 0.0
    is_duration = False
    while True:
        j = i
        while j < n and query[j].isdigit():
            j += 1
        if j < n and query[j] == ".":
            j += 1
            while j < n and query[j].isdigit():
                j += 1
        number_text = query[i:j]
        if number_text in ("", "."):
            raise TraceQLSyntaxError(query, i, "expected a number")
        unit = None
        for u in sorted(DURATION_UNITS_NS, key=len, reverse=True):
            if query.startswith(u, j) and not (j + len(u) < n and query[j + len(u)].isalpha()):
                unit = u
                break
        if unit is None:
            if is_duration:
                raise TraceQLSyntaxError(query, j, "expected a duration unit (ns, us, ms, s, m, h)")
            if j < n and (query[j].isalpha() or query[j] == "_"):
                raise TraceQLSyntaxError(query, j, f"unknown unit or junk after number {number_text!r}")
            value: float | int = float(number_text) if "." in number_text else int(number_text)
            return Token("number", query[start:j], start, value), j
        is_duration = True
        total_ns += float(number_text) * DURATION_UNITS_NS[unit]
        i = j + len(unit)
        if not (i < n and (query[i].isdigit() or query[i] == ".")):
            return Token("duration", query[start:i], start, total_ns), i


def _scan_attribute_name(query: str, start: int) -> tuple[str, int]:
    if start < len(query) and query[start] == '"':
        value, j = _scan_string(query, start)
        if not value:
            raise TraceQLSyntaxError(query, start, "empty attribute name")
        return value, j
    j = start
    while j < len(query) and not query[j].isspace() and query[j] not in _ATTRIBUTE_STOP:
        j += 1
    name = query[start:j]
    if not name:
        raise TraceQLSyntaxError(query, start, "expected an attribute name")
    if name.endswith("."):
        raise TraceQLSyntaxError(query, j - 1, f"attribute name {name!r} ends with '.'")
    return name, j


# --- AST ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Static:
    """A literal: ``type`` is string, int, float, duration (value in ns), bool, nil, status or kind."""
    type: str
    value: object
    pos: int


@dataclass(frozen=True)
class Attribute:
    """``span.x`` (scope ``span``), ``resource.x`` (``resource``), ``.x`` (scope ``""``)."""
    scope: str
    name: str
    pos: int

    def __str__(self) -> str:
        return f"{self.scope}.{self.name}" if self.scope else f".{self.name}"


@dataclass(frozen=True)
class Intrinsic:
    """``name``, ``duration``, ``status``, ``kind``, ``statusMessage`` (optionally ``span:``-scoped)."""
    name: str
    pos: int

    def __str__(self) -> str:
        return self.name


Field = Union[Attribute, Intrinsic]
Operand = Union[Attribute, Intrinsic, Static]


@dataclass(frozen=True)
class Comparison:
    op: str
    left: Operand
    right: Operand
    pos: int


@dataclass(frozen=True)
class Truthy:
    """A lone field or boolean literal inside a spanset: ``{ span.kv.stream }``, ``{ true }``."""
    operand: Operand
    pos: int


@dataclass(frozen=True)
class BoolOp:
    op: str  # "&&" or "||"
    left: "FieldExpr"
    right: "FieldExpr"


@dataclass(frozen=True)
class Not:
    operand: "FieldExpr"


FieldExpr = Union[Comparison, Truthy, BoolOp, Not]


@dataclass(frozen=True)
class SpansetFilter:
    """``{ expr }``; ``expr`` None means ``{ }`` (every span)."""
    expr: FieldExpr | None
    pos: int


@dataclass(frozen=True)
class SpansetOp:
    """Spanset-level ``&&`` (traces with both) and ``||`` (either)."""
    op: str
    left: "SpansetExpr"
    right: "SpansetExpr"


SpansetExpr = Union[SpansetFilter, SpansetOp]


@dataclass(frozen=True)
class Select:
    fields: tuple[Field, ...]
    pos: int


@dataclass(frozen=True)
class MetricsAggregate:
    """``fn(args) by (fields)``; for quantile_over_time ``args`` is (field, q1, q2, ...)."""
    function: str
    field: Field | None
    quantiles: tuple[float, ...]
    by: tuple[Field, ...]
    pos: int


Stage = Union[SpansetExpr, Select, MetricsAggregate]


@dataclass(frozen=True)
class Query:
    text: str
    spanset: SpansetExpr
    stages: tuple[Stage, ...] = ()

    @property
    def metrics(self) -> MetricsAggregate | None:
        """The metrics stage, when this is a TraceQL metrics query."""
        last = self.stages[-1] if self.stages else None
        return last if isinstance(last, MetricsAggregate) else None

    def fields(self) -> list[Field]:
        """Every field the query mentions (filters, select, metrics argument and by-labels)."""
        out: list[Field] = []
        for node in _walk(self):
            if isinstance(node, (Attribute, Intrinsic)):
                out.append(node)
        return out

    def attributes(self) -> set[str]:
        """Names of the attributes the query reads (scope stripped)."""
        return {f.name for f in self.fields() if isinstance(f, Attribute)}

    def span_names(self) -> set[str]:
        """String literals the query compares the ``name`` intrinsic with (``=``/``!=``)."""
        names: set[str] = set()
        for node in _walk(self):
            if isinstance(node, Comparison) and node.op in ("=", "!="):
                for a, b in ((node.left, node.right), (node.right, node.left)):
                    if isinstance(a, Intrinsic) and a.name == "name" and isinstance(b, Static):
                        names.add(str(b.value))
        return names


def _walk(node: object):
    yield node
    if isinstance(node, Query):
        yield from _walk(node.spanset)
        for s in node.stages:
            yield from _walk(s)
    elif isinstance(node, (SpansetOp, BoolOp)):
        yield from _walk(node.left)
        yield from _walk(node.right)
    elif isinstance(node, SpansetFilter):
        if node.expr is not None:
            yield from _walk(node.expr)
    elif isinstance(node, Comparison):
        yield from _walk(node.left)
        yield from _walk(node.right)
    elif isinstance(node, (Truthy, Not)):
        yield from _walk(node.operand)
    elif isinstance(node, Select):
        for f in node.fields:
            yield f
    elif isinstance(node, MetricsAggregate):
        if node.field is not None:
            yield node.field
        for f in node.by:
            yield f


# --- Parser -------------------------------------------------------------------------------------

_STATIC_KEYWORDS: Final = {"true": ("bool", True), "false": ("bool", False), "nil": ("nil", None),
                           **{s: ("status", s) for s in STATUS_VALUES},
                           **{k: ("kind", k) for k in KIND_VALUES}}
_INTRINSIC_TYPES: Final = {"name": "string", "statusMessage": "string", "duration": "duration",
                           "status": "status", "kind": "kind"}


class _Parser:
    def __init__(self, query: str) -> None:
        self.query = query
        self.tokens = tokenize(query)
        self.i = 0

    # helpers
    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def error(self, expected: str, tok: Token | None = None) -> TraceQLSyntaxError:
        tok = tok or self.tok
        got = "end of query" if tok.kind == "eof" else repr(tok.text)
        return TraceQLSyntaxError(self.query, tok.pos, f"expected {expected}, got {got}")

    def at(self, text: str) -> bool:
        return self.tok.kind in ("punct", "ident") and self.tok.text == text

    def expect(self, text: str) -> Token:
        if not self.at(text):
            raise self.error(repr(text))
        tok = self.tok
        self.i += 1
        return tok

    # grammar
    def parse(self) -> Query:
        if self.tok.kind == "eof":
            raise self.error("a spanset filter '{ ... }'")
        spanset = self.spanset_expr()
        stages: list[Stage] = []
        while self.at("|"):
            pipe = self.expect("|")
            if stages and isinstance(stages[-1], MetricsAggregate):
                raise TraceQLSyntaxError(self.query, pipe.pos,
                                         "a metrics function must be the last stage of a query")
            stages.append(self.stage())
        if self.tok.kind != "eof":
            raise self.error("'|' or end of query")
        return Query(self.query, spanset, tuple(stages))

    def spanset_expr(self) -> SpansetExpr:
        left = self.spanset_term()
        while self.at("&&") or self.at("||"):
            op = self.tok.text
            self.i += 1
            left = SpansetOp(op, left, self.spanset_term())
        return left

    def spanset_term(self) -> SpansetExpr:
        if self.at("("):
            self.i += 1
            inner = self.spanset_expr()
            self.expect(")")
            return inner
        open_tok = self.expect("{") if self.at("{") else None
        if open_tok is None:
            raise self.error("'{'")
        if self.at("}"):
            self.i += 1
            return SpansetFilter(None, open_tok.pos)
        expr = self.field_expr()
        if not self.at("}"):
            raise self.error("'}', '&&' or '||'")
        self.i += 1
        return SpansetFilter(expr, open_tok.pos)

    def stage(self) -> Stage:
        tok = self.tok
        if self.at("{") or self.at("("):
            return self.spanset_expr()
        if tok.kind == "ident" and tok.text == "select":
            self.i += 1
            self.expect("(")
            fields = self.field_list()
            self.expect(")")
            return Select(tuple(fields), tok.pos)
        if tok.kind == "ident" and tok.text in METRICS_FUNCTIONS:
            return self.metrics()
        raise self.error("a spanset filter, 'select(...)' or a metrics function ("
                         + ", ".join(sorted(METRICS_FUNCTIONS)) + ")")

    def metrics(self) -> MetricsAggregate:
        tok = self.tok
        fn = tok.text
        self.i += 1
        self.expect("(")
        field: Field | None = None
        quantiles: list[float] = []
        if fn in ("rate", "count_over_time"):
            if not self.at(")"):
                raise self.error(f"')' ({fn}() takes no arguments)")
        else:
            field = self.field()
            if isinstance(field, Intrinsic) and field.name != "duration":
                raise TraceQLSyntaxError(self.query, field.pos,
                                         f"{fn}() needs a numeric field (duration or an attribute), "
                                         f"got intrinsic {field.name!r}")
            if fn == "quantile_over_time":
                if not self.at(","):
                    raise self.error("',' and at least one quantile")
                while self.at(","):
                    self.i += 1
                    qtok = self.tok
                    if qtok.kind != "number":
                        raise self.error("a quantile (a number in [0, 1])")
                    q = float(qtok.value)  # type: ignore[arg-type]
                    if not 0.0 <= q <= 1.0:
                        raise TraceQLSyntaxError(self.query, qtok.pos,
                                                 f"quantile must be in [0, 1], got {qtok.text}")
                    quantiles.append(q)
                    self.i += 1
        self.expect(")")
        by: list[Field] = []
        if self.at("by"):
            self.i += 1
            self.expect("(")
            by = self.field_list()
            self.expect(")")
        return MetricsAggregate(fn, field, tuple(quantiles), tuple(by), tok.pos)

    def field_list(self) -> list[Field]:
        fields = [self.field()]
        while self.at(","):
            self.i += 1
            fields.append(self.field())
        return fields

    def field(self) -> Field:
        tok = self.tok
        if tok.kind == "attribute":
            self.i += 1
            scope, name = tok.value  # type: ignore[misc]
            return Attribute(scope, name, tok.pos)
        if tok.kind == "ident":
            scope, name = tok.value  # type: ignore[misc]
            if scope == "trace":
                raise TraceQLSyntaxError(self.query, tok.pos,
                                         f"trace-level intrinsic {tok.text!r} is outside kvtune's subset")
            if name in INTRINSICS:
                self.i += 1
                return Intrinsic(name, tok.pos)
        raise self.error("a field (name, duration, status, kind, span.x, resource.x or .x)")

    def field_expr(self) -> FieldExpr:
        # Tempo gives && and || the same precedence, left-associative: a || b && c is (a || b) && c.
        left = self.unary()
        while self.at("&&") or self.at("||"):
            op = self.tok.text
            self.i += 1
            left = BoolOp(op, left, self.unary())
        return left

    def unary(self) -> FieldExpr:
        if self.at("!"):
            bang = self.tok
            self.i += 1
            if self.at("(") or self.at("!"):
                return Not(self.unary())
            start = self.tok
            operand = self.operand()
            if self.tok.kind == "punct" and self.tok.text in COMPARISON_OPS:
                raise TraceQLSyntaxError(self.query, bang.pos,
                                         "'!' binds tighter than a comparison: write !(a = b)")
            if not (isinstance(operand, Attribute) or (isinstance(operand, Static) and operand.type == "bool")):
                raise TraceQLSyntaxError(self.query, start.pos, "'!' needs a boolean field or value")
            return Not(Truthy(operand, start.pos))
        if self.at("("):
            self.i += 1
            inner = self.field_expr()
            self.expect(")")
            return inner
        start = self.tok
        left = self.operand()
        if self.tok.kind == "punct" and self.tok.text in COMPARISON_OPS:
            op_tok = self.tok
            self.i += 1
            right = self.operand()
            return self.check_comparison(Comparison(op_tok.text, left, right, op_tok.pos))
        if isinstance(left, Attribute) or (isinstance(left, Static) and left.type == "bool"):
            return Truthy(left, start.pos)
        raise self.error("a comparison operator (" + " ".join(COMPARISON_OPS) + ")")

    def operand(self) -> Operand:
        tok = self.tok
        if tok.kind == "attribute" or (tok.kind == "ident" and tok.value[1] in INTRINSICS):  # type: ignore[index]
            return self.field()
        if tok.kind == "string":
            self.i += 1
            return Static("string", tok.value, tok.pos)
        if tok.kind == "duration":
            self.i += 1
            return Static("duration", tok.value, tok.pos)
        if tok.kind == "number":
            self.i += 1
            return Static("float" if isinstance(tok.value, float) else "int", tok.value, tok.pos)
        if self.at("-"):
            self.i += 1
            num = self.tok
            if num.kind not in ("number", "duration"):
                raise self.error("a number after '-'")
            self.i += 1
            typ = "duration" if num.kind == "duration" else ("float" if isinstance(num.value, float) else "int")
            return Static(typ, -num.value, tok.pos)  # type: ignore[operator]
        if tok.kind == "ident" and tok.text in _STATIC_KEYWORDS:
            self.i += 1
            typ, value = _STATIC_KEYWORDS[tok.text]
            return Static(typ, value, tok.pos)
        raise self.error("a field or a value")

    def check_comparison(self, c: Comparison) -> Comparison:
        fields = [o for o in (c.left, c.right) if not isinstance(o, Static)]
        statics = [o for o in (c.left, c.right) if isinstance(o, Static)]
        if not fields:
            raise TraceQLSyntaxError(self.query, c.pos, "a comparison needs a field on one side")
        if c.op in REGEX_OPS and not (isinstance(c.right, Static) and c.right.type == "string"):
            raise TraceQLSyntaxError(self.query, c.pos, f"{c.op} needs a string (regex) on its right")
        for f in fields:
            if isinstance(f, Intrinsic) and statics:
                want = _INTRINSIC_TYPES[f.name]
                got = statics[0].type
                if got not in (want, "nil"):
                    raise TraceQLSyntaxError(self.query, statics[0].pos,
                                             f"{f.name} compares with a {want} value, got a {got}")
                if want in ("status", "kind") and c.op not in ("=", "!="):
                    raise TraceQLSyntaxError(self.query, c.pos, f"{f.name} takes only = and !=")
        return c


def parse(query: str) -> Query:
    """Parse one TraceQL query of kvtune's subset; raise :class:`TraceQLSyntaxError` if malformed."""
    if not isinstance(query, str):
        raise TypeError(f"query must be str, got {type(query).__name__}")
    return _Parser(query).parse()
