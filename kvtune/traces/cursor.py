"""A resumable read of a Tempo range: a small JSON state file and a spool of finished pages.

A Tempo source with ``cursor=FILE`` (``kvtune.traces.tempo``) reads its range page by page. After
each page the page's trace answers are on disk in the *spool* (``FILE`` + :data:`SPOOL_SUFFIX`, one
Tempo answer per line: a file any kvtune command reads as a span source) and ``FILE`` records the
page as done, with the spool's length, the spans and traces written and what the page's search
said. ``FILE`` is replaced atomically (written beside it, then renamed), after the spool is synced,
so a read stopped at any moment (Ctrl-C, a Tempo error, a killed process) finds a cursor that
names only pages whose traces are whole in the spool. Resuming cuts the spool back to the recorded
length (dropping the part of the page that was being read), reads the spool's traces back, and
reads the pages not yet done from Tempo: no trace twice, none lost (a trace belongs to the page its
start time falls in).

A cursor belongs to one read: the same server, query, page length and range. A relative range
(``since=``, or the default last hour) is fixed when the cursor is made; resuming the same source
reads that range again, not the one ending now. Anything else in the file (another server or
range, a version this code does not know, malformed JSON, a file over :data:`MAX_CURSOR_BYTES`, a
spool shorter than recorded) is refused with an error naming the file and the field.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtune.errors import TraceSourceError

CURSOR_VERSION = 1
"""Version of the state file's layout; a file of another version is refused."""
CURSOR_KIND = "kvtune.tempo.cursor"
MAX_CURSOR_BYTES = 4 * 2**20
"""Largest state file read (4 MiB; a day in one-minute pages records 1,440 page numbers)."""
MAX_CURSOR_NOTES = 100
"""Notes of one kind (cut-short windows, partial traces) a state file keeps."""
SPOOL_SUFFIX = ".spans.jsonl"


@dataclass(frozen=True)
class Cursor:
    """The state of one resumable read (what the file holds, plus where it is)."""

    path: str
    url: str
    query: str
    start_s: int
    end_s: int
    page_s: int
    range_from: str
    pages: int
    done: tuple[int, ...] = ()
    """Pages finished, in the order they finished (index into the range's pages)."""
    spans_written: int = 0
    traces_written: int = 0
    spool_bytes: int = 0
    """Length of the spool after the last finished page: what a resumed read keeps."""
    requests: int = 0
    """Search requests the finished pages took."""
    windows: int = 0
    cut_short: tuple[str, ...] = ()
    partial_answers: tuple[str, ...] = ()
    partial_answer_count: int = 0

    @property
    def spool(self) -> Path:
        return Path(self.path + SPOOL_SUFFIX)

    def page_done(self, page: int, *, spans: int, traces: int, spool_bytes: int, requests: int,
                  windows: int, cut_short: tuple[str, ...], partial_answers: tuple[str, ...]
                  ) -> Cursor:
        """This cursor with ``page`` finished (its spans and traces in the spool up to
        ``spool_bytes``)."""
        return replace(self, done=(*self.done, page), spans_written=self.spans_written + spans,
                       traces_written=self.traces_written + traces, spool_bytes=spool_bytes,
                       requests=self.requests + requests, windows=self.windows + windows,
                       cut_short=(*self.cut_short, *cut_short)[:MAX_CURSOR_NOTES],
                       partial_answers=(*self.partial_answers, *partial_answers)[:MAX_CURSOR_NOTES],
                       partial_answer_count=self.partial_answer_count + len(partial_answers))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["path"]
        return {"kind": CURSOR_KIND, "version": CURSOR_VERSION, **d,
                "spool": self.spool.name}

    def save(self) -> None:
        """Writes the state file atomically (a temporary file beside it, synced, renamed)."""
        target = Path(self.path)
        data = json.dumps(self.as_dict(), indent=1).encode()
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp",
                                   dir=target.parent or Path("."))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_INT_FIELDS = ("start_s", "end_s", "page_s", "pages", "spans_written", "traces_written",
               "spool_bytes", "requests", "windows", "partial_answer_count")
_STR_FIELDS = ("url", "query", "range_from", "spool")
_LIST_FIELDS = ("done", "cut_short", "partial_answers")


def open_cursor(path: str | os.PathLike[str], *, url: str, query: str, start_s: int, end_s: int,
                page_s: int, range_from: str, fixed_range: bool) -> Cursor:
    """The cursor at ``path`` for this read, made (with an empty spool) when the file does not
    exist. ``fixed_range``: the source names its start (and end), which must then be the
    cursor's; otherwise the cursor's range is kept if it came from the same ``range_from``.
    Raises :class:`TraceSourceError` naming the file and the field when the file is not a
    cursor of this read."""
    p = Path(path).expanduser()
    where = str(p)
    pages = len(range(start_s, end_s, page_s))
    if not p.exists():
        if not p.parent.is_dir():
            raise TraceSourceError(f"{where}: cursor's directory does not exist")
        cur = Cursor(str(p), url, query, start_s, end_s, page_s, range_from, pages)
        cur.spool.write_bytes(b"")
        cur.save()
        return cur
    try:
        size = p.stat().st_size
        if size > MAX_CURSOR_BYTES:
            raise TraceSourceError(f"{where}: cursor file of {size} bytes, over the "
                                   f"{MAX_CURSOR_BYTES} a cursor may hold (kvtune.traces.cursor."
                                   f"MAX_CURSOR_BYTES); not a kvtune cursor?")
        raw = p.read_bytes()
    except OSError as exc:
        raise TraceSourceError(f"{where}: cannot read the cursor: {exc}") from exc
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TraceSourceError(f"{where}: cursor is not JSON ({exc}); remove it to start the "
                               f"read over") from None
    if not isinstance(doc, dict):
        raise TraceSourceError(f"{where}: cursor: expected a JSON object, got "
                               f"{type(doc).__name__}")

    def bad(field: str, expected: str) -> TraceSourceError:
        return TraceSourceError(f"{where}: cursor field {field!r}: expected {expected}, got "
                                f"{doc.get(field)!r}"[:600])

    if doc.get("kind") != CURSOR_KIND:
        raise bad("kind", repr(CURSOR_KIND))
    if doc.get("version") != CURSOR_VERSION:
        raise bad("version", f"{CURSOR_VERSION} (this kvtune's cursor layout)")
    for f in _INT_FIELDS:
        v = doc.get(f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f, "a whole number >= 0")
    for f in _STR_FIELDS:
        if not isinstance(doc.get(f), str):
            raise bad(f, "a string")
    for f in _LIST_FIELDS:
        if not isinstance(doc.get(f), list):
            raise bad(f, "a list")
    if doc["url"] != url:
        raise bad("url", f"{url!r} (the source read now; a cursor belongs to one server)")
    if doc["query"] != query:
        raise bad("query", f"{query!r} (the source's q=)")
    if doc["page_s"] != page_s:
        raise bad("page_s", f"{page_s} (the source's page=)")
    if fixed_range:
        if doc["start_s"] != start_s:
            raise bad("start_s", f"{start_s} (the source's start=)")
        if doc["end_s"] != end_s:
            raise bad("end_s", f"{end_s} (the source's end=)")
    elif doc["range_from"] != range_from:
        raise bad("range_from", f"{range_from!r} (the source's range; a cursor made for a "
                                f"relative range keeps the range it was made for)")
    if doc["end_s"] <= doc["start_s"] or doc["pages"] != len(
            range(doc["start_s"], doc["end_s"], page_s)):
        raise bad("pages", "the number of pages of start_s .. end_s")
    done = doc["done"]
    if (not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < doc["pages"]
                for i in done) or len(set(done)) != len(done)):
        raise bad("done", f"distinct page numbers in [0, {doc['pages']})")
    for f in ("cut_short", "partial_answers"):
        if not all(isinstance(x, str) for x in doc[f]):
            raise bad(f, "a list of strings")
    if doc["spool"] != p.name + SPOOL_SUFFIX:
        raise bad("spool", repr(p.name + SPOOL_SUFFIX))
    cur = Cursor(str(p), doc["url"], doc["query"], doc["start_s"], doc["end_s"], doc["page_s"],
                 doc["range_from"], doc["pages"], tuple(done), doc["spans_written"],
                 doc["traces_written"], doc["spool_bytes"], doc["requests"], doc["windows"],
                 tuple(doc["cut_short"]), tuple(doc["partial_answers"]),
                 doc["partial_answer_count"])
    try:
        spool_size = cur.spool.stat().st_size
    except OSError as exc:
        raise TraceSourceError(f"{where}: the cursor's spool {cur.spool} cannot be read ({exc}); "
                               f"remove the cursor to start the read over") from None
    if spool_size < cur.spool_bytes:
        raise TraceSourceError(f"{where}: cursor field 'spool_bytes': the spool {cur.spool} holds "
                               f"{spool_size} bytes, fewer than the {cur.spool_bytes} recorded: "
                               f"finished pages were lost; remove the cursor to start over")
    if spool_size > cur.spool_bytes:  # a page that was being read when the read stopped
        with open(cur.spool, "r+b") as f:
            f.truncate(cur.spool_bytes)
    return cur
