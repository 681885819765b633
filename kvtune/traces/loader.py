"""``load(source)``: spans from OTLP-JSON lines files, Collector file-exporter output or Tempo."""
from __future__ import annotations

import fnmatch
import gc
import glob
import gzip
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Union

import msgspec
import pandas as pd
from tqdm import tqdm

from kvtune.errors import TraceFormatError, TraceSourceError
from kvtune.traces import otlp_json
from kvtune.traces.columns import Skipped, SpanRows
from kvtune.traces.cursor import Cursor, open_cursor
from kvtune.traces.http import redact
from kvtune.traces.tempo import (HTTP_PARTIAL, MAX_NOTES, MAX_TRACE_BODY_BYTES, SCHEMES, TempoRead,
                                 TempoSearch, TempoSource, _iso, one_sided_transfers)

_logger = logging.getLogger(__name__)

Source = Union[str, os.PathLike, TempoSource]
SourceArg = Union[Source, Sequence[Source]]

FILE_PATTERNS = ("*.jsonl*", "*.json*")
"""Files a directory source contributes (searched recursively): JSON lines or JSON, plain or
gzip (detected by content), including rotated names such as ``spans.jsonl.1``."""
_GLOB_CHARS = set("*?[")
_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK_BYTES = 1 << 16
MAX_RECORD_BYTES = 64 * 2**20
"""Longest line of a JSON-lines file, and largest whole ``.json`` document, read (64 MiB, plain or
after gzip; an SDK batch of 512 spans is about 0.4 MB, Tempo's largest trace 5 MB by default). A
longer record is refused, naming the file, the line and this limit, before it is held: a 1 MB
``.jsonl.gz`` of zeros inflates to a 1 GB "line" (it took the loader to 2.2 GB), a 2 GB file
without a newline to 4.3 GB. A ``.json`` file over the limit is read as JSON lines."""


def resolve(source: SourceArg) -> list[Path | TempoSource]:
    """The files and Tempo sources ``source`` names, in order (globs sorted, directories recursed).

    A file reached under several names (symbolic links, a glob through a link loop, the same file
    listed twice) is read once, under the first name it was found by.
    """
    items: Iterable[Source]
    if isinstance(source, (str, os.PathLike, TempoSource)):
        items = [source]
    else:
        items = source
    out: list[Path | TempoSource] = []
    seen: set[tuple[int, int]] = set()

    def add_file(p: Path) -> None:
        try:
            st = p.stat()
        except OSError:  # vanished or a dangling link: nothing to read
            return
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            out.append(p)

    for item in items:
        if isinstance(item, TempoSource):
            out.append(item)
            continue
        text = os.fspath(item)
        if isinstance(item, str) and item.split("://", 1)[0] in SCHEMES and "://" in item:
            out.append(TempoSource.from_url(item))
            continue
        if isinstance(item, str) and "://" in item:
            raise TraceSourceError(f"{item}: unknown source scheme; expected a path, a glob or "
                                   f"{' / '.join(s + '://HOST:PORT' for s in SCHEMES)}")
        path = Path(text).expanduser()
        if path.is_dir():
            found = sorted({p for pat in FILE_PATTERNS for p in path.rglob(pat) if p.is_file()})
            if not found:
                raise TraceSourceError(f"{path}: directory holds no {', '.join(FILE_PATTERNS)} files")
            for p in found:
                add_file(p)
        elif path.is_file():
            add_file(path)
        elif _GLOB_CHARS & set(text):
            found = sorted(Path(p) for p in _glob_files(os.path.expanduser(text)))
            if not found:
                raise TraceSourceError(f"{text}: glob matches no files")
            for p in found:
                add_file(p)
        else:
            raise TraceSourceError(f"{text}: no such file or directory")
    return out


def _glob_files(pattern: str) -> list[str]:
    """Files matching ``pattern`` (``glob`` syntax, ``**`` for any number of directories).

    ``glob.glob`` follows directory links under ``**`` without noticing loops (a link to ``..``
    repeats every file ~40 times; two such links make the walk exponential), so ``**`` patterns
    are matched here over a walk that enters each real directory once.
    """
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return [p for p in glob.glob(pattern) if os.path.isfile(p)]
    first_glob = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    base = os.sep.join(parts[:first_glob]) or (os.sep if pattern.startswith(os.sep) else "")
    rest = parts[first_glob:]
    found: list[str] = []
    seen_dirs: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(base or os.curdir, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen_dirs:
            dirnames[:] = []
            continue
        seen_dirs.add((st.st_dev, st.st_ino))
        rel = os.path.relpath(dirpath, base or os.curdir)
        rel_parts = [] if rel == os.curdir else rel.split(os.sep)
        for name in filenames:
            if _glob_match(rest, [*rel_parts, name]):
                found.append(os.path.join(dirpath, name) if base else
                             os.path.join(*rel_parts, name))
    return found


def _glob_match(pattern: list[str], parts: list[str]) -> bool:
    """Whether path components ``parts`` match glob components ``pattern`` (as ``glob`` does:
    wildcards do not match a leading ``.``; ``**`` matches zero or more directories)."""
    if not pattern:
        return not parts
    head = pattern[0]
    if head == "**":
        for k in range(len(parts)):
            if _glob_match(pattern[1:], parts[k:]):
                return True
            if parts[k].startswith("."):
                return False
        return _glob_match(pattern[1:], [])
    if not parts:
        return False
    name = parts[0]
    if name.startswith(".") and not head.startswith(".") and _GLOB_CHARS & set(head):
        return False
    return fnmatch.fnmatchcase(name, head) and _glob_match(pattern[1:], parts[1:])


class _Reader:
    """Decodes documents into a :class:`SpanRows`, raising or recording bad records.

    With ``flush`` the rows are handed over whenever they hold ``flush_spans`` spans or more (a
    new :class:`SpanRows` sharing the sources and skipped lists takes their place): a streamed
    read holds one chunk at a time (``kvtune.traces.reduce``)."""

    def __init__(self, rows: SpanRows, skip_bad: bool, *,
                 flush: Callable[[SpanRows], None] | None = None, flush_spans: int = 0,
                 progress: bool | None = None) -> None:
        self.rows, self.skip_bad, self.progress = rows, skip_bad, progress
        self.flush, self.flush_spans = flush, flush_spans
        self.flushed_spans = 0
        """Spans handed to ``flush`` so far."""

    def maybe_flush(self, *, force: bool = False) -> None:
        if self.flush is None or not len(self.rows) or (
                not force and len(self.rows) < self.flush_spans):
            return
        old = self.rows
        self.flushed_spans += len(old)
        self.rows = SpanRows()
        self.rows.sources, self.rows.skipped, self.rows.tempo_reads = (
            old.sources, old.skipped, old.tempo_reads)
        self.flush(old)

    def document(self, data: bytes, source: str, src_idx: int, line: int | None) -> None:
        try:
            doc = otlp_json.decode(data)
        except msgspec.MsgspecError as exc:
            field, expected, got = otlp_json.describe_error(exc)
            if not self.skip_bad:
                raise TraceFormatError(source, field, expected, line=line, got=got or None) from None
            doc = self._salvage(data, source, line, _reason(field, expected, got))
            if doc is None:
                return
        try:
            self.rows.add_document(doc, src_idx, line)
        except TraceFormatError as exc:
            if not self.skip_bad:
                raise
            self.rows.skipped.append(Skipped(source, line, str(exc)))
        self.maybe_flush()

    def _salvage(self, data: bytes, source: str, line: int | None,
                 reason: str) -> otlp_json.TraceDocument | None:
        """Keeps the good spans of a document with bad ones; records what was dropped."""
        try:
            raw = otlp_json.decode_untyped(data)
        except msgspec.DecodeError:
            self.rows.skipped.append(Skipped(source, line, reason))
            return None
        dropped = 0
        first_reason = reason
        if isinstance(raw, dict):
            for rs in _resource_spans(raw):
                for ss in _scope_spans(rs):
                    spans_list = ss.get("spans") if isinstance(ss, dict) else None
                    if not isinstance(spans_list, list):
                        continue
                    good = []
                    for i, sp in enumerate(spans_list):
                        try:
                            msgspec.convert(sp, otlp_json.Span, strict=False)
                            good.append(sp)
                        except (msgspec.ValidationError, RecursionError) as exc:
                            if not dropped:
                                field, expected, got = (
                                    otlp_json.describe_error(exc)
                                    if isinstance(exc, msgspec.ValidationError)
                                    else ("$", otlp_json.NESTING_EXPECTED, "deeper"))
                                first_reason = f"span {i}: {_reason(field, expected, got)}"
                            dropped += 1
                    ss["spans"] = good
        try:
            doc = msgspec.convert(raw, otlp_json.TraceDocument, strict=False)
        except (msgspec.ValidationError, RecursionError):
            self.rows.skipped.append(Skipped(source, line, reason))
            return None
        if dropped:
            self.rows.skipped.append(Skipped(source, line, f"{dropped} span(s) dropped; {first_reason}"))
        return doc

    def file(self, path: Path, bar: tqdm) -> None:
        source = str(path)
        src_idx = self.rows.source_index(source)
        name = path.name.lower()
        whole_doc = name.endswith((".json", ".json.gz"))
        try:
            raw = open(path, "rb")  # closed below
        except OSError as exc:
            raise TraceSourceError(f"{path}: cannot open: {exc}") from exc
        with raw:
            try:
                magic = raw.read(2)
                raw.seek(0)
            except OSError as exc:
                raise TraceSourceError(f"{path}: cannot read: {exc}") from exc
            gz = magic == _GZIP_MAGIC
            stream: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            if whole_doc:
                data, cut = _read_all(stream, path, gz)
                if cut is None and len(data) > MAX_RECORD_BYTES:
                    # too large for one document: JSON lines, each line capped, read from the start
                    del data
                    raw.seek(0)
                    stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
                    self._lines(stream, raw, path, gz, bar, src_idx)
                    return
                bar.update(raw.tell())
                if cut is None:
                    self._json_file(data, source, src_idx)
                    return
                # JSON lines before the cut are whole and kept; one cut document is lost.
                lines = data.splitlines(keepends=True) if _is_json_lines(data) else []
                if lines and not lines[-1].endswith(b"\n"):
                    lines.pop()  # the line the cut went through
                for lineno, line in enumerate(lines, 1):
                    if line.strip():
                        self.document(line, source, src_idx, lineno)
                self._truncated(source, len(lines) + 1, cut)
                return
            self._lines(stream, raw, path, gz, bar, src_idx)

    def _lines(self, stream: IO[bytes], raw: IO[bytes], path: Path, gz: bool, bar: tqdm,
               src_idx: int) -> None:
        """Every line of ``stream``, each at most :data:`MAX_RECORD_BYTES`; a longer one is
        refused (``skip_bad``: skipped to its end)."""
        source = str(path)
        lineno = 0
        last = raw.tell()
        try:
            while True:
                line = stream.readline(MAX_RECORD_BYTES + 1)  # a cut stream raises here
                if not line:
                    break
                lineno += 1
                if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                    self._too_long(stream, source, lineno)
                elif line.strip():
                    self.document(line, source, src_idx, lineno)
                pos = raw.tell()
                if pos != last:
                    bar.update(pos - last)
                    last = pos
        except _GZIP_ERRORS as exc:
            if not gz:
                raise TraceSourceError(f"{path}: cannot read: {exc}") from exc
            self._truncated(source, lineno + 1, exc)

    def _too_long(self, stream: IO[bytes], source: str, lineno: int) -> None:
        """A line over :data:`MAX_RECORD_BYTES`: raise, or (``skip_bad``) read past its end
        without holding it and record it as skipped."""
        expected = (f"a line of at most {MAX_RECORD_BYTES} bytes (kvtune.traces.loader."
                    f"MAX_RECORD_BYTES; an OTLP-JSON batch of 512 spans is about 0.4 MB)")
        if not self.skip_bad:
            raise TraceFormatError(source, "(line)", expected, line=lineno,
                                   got=f"over {MAX_RECORD_BYTES} bytes without a newline")
        skipped = MAX_RECORD_BYTES
        while True:
            rest = stream.readline(_READ_CHUNK_BYTES * 16)
            skipped += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
        self.rows.skipped.append(Skipped(source, lineno, f"line of {skipped} bytes skipped: "
                                                        f"expected {expected}"))

    def _truncated(self, source: str, line: int, cut: BaseException) -> None:
        """Records a gzip file that ends early (a rotation cut short, a copy in progress): the
        whole lines before the cut were read; line ``line`` and anything after it are lost."""
        reason = (f"gzip stream ends early or is corrupt ({type(cut).__name__}: {cut}); "
                  f"lines before {line} kept, the rest lost")
        _logger.warning("%s:%d: %s", source, line, reason)
        self.rows.skipped.append(Skipped(source, line, reason))

    def _json_file(self, data: bytes, source: str, src_idx: int) -> None:
        """A ``.json`` file: one (possibly pretty-printed) document, else JSON lines."""
        try:
            doc = otlp_json.decode(data)
        except msgspec.ValidationError:
            if not _is_json_lines(data):  # one document with a shape error: report it
                self.document(data, source, src_idx, None)
                return
            doc = None
        except msgspec.DecodeError:
            doc = None
        if doc is None:
            for lineno, line in enumerate(data.splitlines(), 1):
                if line.strip():
                    self.document(line, source, src_idx, lineno)
            return
        try:
            self.rows.add_document(doc, src_idx, None)
        except TraceFormatError as exc:
            if not self.skip_bad:
                raise
            self.rows.skipped.append(Skipped(source, None, str(exc)))

    def tempo(self, src: TempoSource, bar: tqdm) -> None:
        """Reads a Tempo source page by page (``kvtune.traces.tempo``): each page searched, its
        traces fetched and decoded; with a cursor, each finished page spooled and recorded, and
        the pages a cursor already finished read back from its spool."""
        start, end, range_from = src.time_range()
        cur: Cursor | None = None
        if src.cursor is not None:
            cur = open_cursor(src.cursor, url=redact(src.base_url), query=src.query, start_s=start,
                              end_s=end, page_s=src.page_s, range_from=range_from,
                              fixed_range=src.start_s is not None and src.end_s is not None)
            start, end = cur.start_s, cur.end_s
        pages = src.pages(start, end)
        searcher = src.searcher()
        first_row, first_flushed = len(self.rows), self.flushed_spans
        fetched = found = windows = 0
        cut: list[str] = []
        partial: list[str] = []
        n_partial = 0
        failed: list[str] = []
        done: set[int] = set()
        prior_requests = 0
        if cur is not None and cur.done:
            prior_requests = cur.requests
            done = set(cur.done)
            self._spool(cur)
            fetched = found = cur.traces_written
            windows, cut = cur.windows, list(cur.cut_short)
            partial, n_partial = list(cur.partial_answers), cur.partial_answer_count
        spool = open(cur.spool, "ab") if cur is not None else None  # closed below
        try:
            with tqdm(total=len(pages), initial=len(done), unit="page", desc="tempo pages",
                      disable=None if self.progress is None else not self.progress,
                      leave=False) as pages_bar:
                for i, (lo, hi) in enumerate(pages):
                    if i in done:
                        continue
                    spans_before = self.flushed_spans + len(self.rows)
                    requests_before = searcher.requests
                    page_partial: list[str] = []
                    traces = 0
                    try:
                        page = searcher.page(lo, hi, range_start=start, range_end=end)
                        for tid in page.trace_ids:
                            url, status, body = src.fetch_answer(tid)
                            self._tempo_answer(url, body)
                            traces += 1
                            bar.update(len(body))
                            note = otlp_json.tempo_partial(body)
                            if status == HTTP_PARTIAL:
                                note = "; ".join(x for x in (note, "HTTP 206 (partial content: "
                                                             "blocks Tempo could not read)") if x)
                            if note is not None:
                                page_partial.append(f"{url}: {note}"[:500])
                            if spool is not None:
                                spool.write(_one_line(body) + b"\n")
                    except TraceSourceError as exc:
                        if spool is not None and cur is not None:
                            spool.flush()
                            spool.truncate(cur.spool_bytes)
                            spool.seek(cur.spool_bytes)
                        if not src.skip_failed:
                            if cur is None:
                                raise
                            raise TraceSourceError(
                                f"{exc} [{len(cur.done)} of {len(pages)} page(s) finished and "
                                f"kept by the cursor {cur.path}: read the same source again to "
                                f"resume from {_iso(lo)}]") from exc
                        failed.append(f"{_iso(lo)} .. {_iso(hi)}: {exc}"[:500])
                        _logger.warning("page %s .. %s left out: %s", _iso(lo), _iso(hi), exc)
                        pages_bar.update(1)
                        continue
                    fetched += traces
                    found += len(page.trace_ids)
                    windows += page.windows
                    cut += page.cut_short
                    partial += page_partial[:MAX_NOTES]
                    n_partial += len(page_partial)
                    if spool is not None and cur is not None:
                        spool.flush()
                        os.fsync(spool.fileno())
                        cur = cur.page_done(
                            i, spans=self.flushed_spans + len(self.rows) - spans_before,
                            traces=traces, spool_bytes=spool.tell(),
                            requests=searcher.requests - requests_before, windows=page.windows,
                            cut_short=page.cut_short, partial_answers=tuple(page_partial))
                        cur.save()
                    pages_bar.update(1)
                    pages_bar.set_postfix(traces=fetched, refresh=False)
        finally:
            if spool is not None:
                spool.close()
        # a streamed read (chunks flushed) counts one-sided transfers in the store instead
        flushed = self.flushed_spans - first_flushed
        search = TempoSearch(url=f"{src.base_url}/api/search", query=src.query, start_s=start,
                             end_s=end, range_from=range_from if cur is None or not done
                             else f"{range_from} (from the cursor)", limit=searcher.limit,
                             trace_ids=(), requests=searcher.requests + prior_requests,
                             windows=windows, cut_short=tuple(cut), traces_found=found)
        fleet = None
        if src.fleet_metrics:
            from kvtune.traces.tempo_metrics import fleet_metrics, short_of_read

            fleet = fleet_metrics(src, start, end)
            if not flushed:  # the read's rows are all here: compare what Tempo counted
                fleet = short_of_read(fleet, _reuse_outcomes(self.rows, first_row, start, end),
                                      _rdma_counts(self.rows, first_row, start, end))
        read = TempoRead(search, traces_fetched=fetched,
                         spans_read=flushed + len(self.rows) - (0 if flushed else first_row),
                         one_sided_transfers=one_sided_transfers(self.rows, 0 if flushed
                                                                 else first_row),
                         partial_answers=tuple(partial[:MAX_NOTES]),
                         partial_answer_count=n_partial, failed_windows=tuple(failed),
                         pages=len(pages), pages_resumed=len(done),
                         cursor=None if cur is None else cur.path, fleet=fleet)
        self.rows.tempo_reads.append(read)
        _logger.info("%s", read.summary())
        for f in read.findings()[1:]:
            if f["severity"] == "warning":
                _logger.warning("%s", f["message"])

    def _tempo_answer(self, url: str, body: bytes) -> None:
        """One trace answer from Tempo (or a cursor's spool) decoded into the rows."""
        src_idx = self.rows.source_index(url)
        try:
            self.document(body, url, src_idx, None)
        except RecursionError:
            if not self.skip_bad:
                raise TraceSourceError(f"{url}: Tempo's answer is nested too deeply to be a "
                                       f"trace") from None
            self.rows.skipped.append(Skipped(url, None, "answer nested too deeply"))
        except TraceFormatError as exc:
            # the file reader's depth cap (a TraceFormatError naming the field) is, for a
            # Tempo answer, an answer that cannot be Tempo's: name the URL
            if "nest" not in str(exc):
                raise
            raise TraceSourceError(f"{url}: Tempo's answer is nested too deeply to be a "
                                   f"trace ({exc})") from None

    def _spool(self, cur: Cursor) -> None:
        """The traces of the pages ``cur`` finished, read back from its spool."""
        source = str(cur.spool)
        src_idx = self.rows.source_index(source)
        with open(cur.spool, "rb") as f:
            lineno = 0
            while f.tell() < cur.spool_bytes:
                line = f.readline(min(MAX_TRACE_BODY_BYTES, cur.spool_bytes - f.tell()) + 1)
                lineno += 1
                if not line.endswith(b"\n"):
                    raise TraceSourceError(f"{source}:{lineno}: the cursor's spool ends inside "
                                           f"a line; remove {cur.path} to start over")
                if line.strip():
                    self.document(line, source, src_idx, lineno)


_GZIP_ERRORS = (OSError, EOFError, zlib.error)
"""What reading a cut or corrupt gzip stream raises (``gzip.BadGzipFile`` is an ``OSError``)."""


def _read_all(stream: IO[bytes], path: Path, gz: bool) -> tuple[bytes, BaseException | None]:
    """What ``stream`` yields, up to just over :data:`MAX_RECORD_BYTES` (the caller tells a longer
    file by the length), and the error that cut a gzip stream short (None if whole)."""
    chunks: list[bytes] = []
    held = 0
    try:
        # read1: a cut stream loses at most the one piece being decompressed when it fails
        while held <= MAX_RECORD_BYTES and (chunk := stream.read1(_READ_CHUNK_BYTES)):
            chunks.append(chunk)
            held += len(chunk)
    except _GZIP_ERRORS as exc:
        if not gz:
            raise TraceSourceError(f"{path}: cannot read: {exc}") from exc
        return b"".join(chunks), exc
    return b"".join(chunks), None


def _reuse_outcomes(rows: SpanRows, first_row: int, start_s: int, end_s: int) -> dict[str, int]:
    """``kv.reuse_decision`` spans per ``kv.reuse.outcome`` among ``rows`` (from ``first_row``)
    that start in ``start_s .. end_s``."""
    from kvtune import spans as sc

    idx, values = rows.conv.get(sc.REUSE_OUTCOME, ((), []))
    out: dict[str, int] = {}
    for row, outcome in zip(idx, values):
        if (row >= first_row and rows.name[row] == sc.SpanName.REUSE_DECISION.value
                and start_s * 10**9 <= rows.start[row] < end_s * 10**9):
            out[str(outcome)] = out.get(str(outcome), 0) + 1
    return out


def _rdma_counts(rows: SpanRows, first_row: int, start_s: int, end_s: int
                 ) -> dict[tuple[str, str, int], int]:
    """``kv.rdma`` spans per ``(kv.mode, kv.direction, kv.bytes)`` among ``rows`` (from
    ``first_row``) that start in ``start_s .. end_s`` (spans lacking one of them left out)."""
    from kvtune import spans as sc

    mode, direction, size = ({r: v for r, v in zip(*rows.conv.get(a, ((), []))) if r >= first_row}
                             for a in (sc.MODE, sc.DIRECTION, sc.BYTES))
    out: dict[tuple[str, str, int], int] = {}
    for row, b in size.items():
        if (rows.name[row] == sc.SpanName.RDMA.value and row in mode and row in direction
                and start_s * 10**9 <= rows.start[row] < end_s * 10**9):
            try:
                key = (str(mode[row]), str(direction[row]), int(b))
            except (TypeError, ValueError):
                continue
            out[key] = out.get(key, 0) + 1
    return out


def _one_line(body: bytes) -> bytes:
    """A Tempo answer as one JSON line (re-encoded only when it spans several)."""
    if b"\n" not in body and b"\r" not in body:
        return body
    return msgspec.json.encode(msgspec.json.decode(body))


def _reason(field: str, expected: str, got: str) -> str:
    return f"field {field!r}: expected {expected}" + (f", got {got}" if got else "")


def _is_json_lines(data: bytes) -> bool:
    """Whether ``data`` has several lines and its first line is a JSON document on its own."""
    stripped = data.strip()
    if b"\n" not in stripped:
        return False
    first = stripped.split(b"\n", 1)[0]
    try:
        otlp_json.decode_untyped(first)
    except msgspec.DecodeError:
        return False
    return True


def _resource_spans(raw: dict) -> Iterator[dict]:
    for key in ("resourceSpans", "batches"):
        if isinstance(raw.get(key), list):
            yield from (x for x in raw[key] if isinstance(x, dict))
    trace = raw.get("trace")
    if isinstance(trace, dict):
        yield from _resource_spans(trace)


def _scope_spans(rs: dict) -> Iterator[dict]:
    for key in ("scopeSpans", "instrumentationLibrarySpans"):
        if isinstance(rs.get(key), list):
            yield from (x for x in rs[key] if isinstance(x, dict))


def read_spans(source: SourceArg, *, skip_bad: bool = False, progress: bool | None = None,
               flush: Callable[[SpanRows], None] | None = None,
               flush_spans: int = 0) -> SpanRows:
    """Decodes every record of ``source`` into a :class:`SpanRows` (no frame, no clock correction).

    With ``flush``, chunks of at least ``flush_spans`` spans are handed to it as they fill, and
    the last (possibly empty) chunk is returned."""
    resolved = resolve(source)
    rows = SpanRows()
    reader = _Reader(rows, skip_bad, flush=flush, flush_spans=flush_spans, progress=progress)
    total = sum(p.stat().st_size for p in resolved if isinstance(p, Path))
    only_files = all(isinstance(p, Path) for p in resolved)
    with tqdm(total=total if only_files else None, unit="B", unit_scale=True, desc="loading spans",
              disable=None if progress is None else not progress, leave=False) as bar:
        for item in resolved:
            if isinstance(item, TempoSource):
                reader.tempo(item, bar)
            else:
                reader.file(item, bar)
    return reader.rows


def load(source: SourceArg, *, skip_bad: bool = False, correct_clocks: bool = True,
         progress: bool | None = None) -> pd.DataFrame:
    """Spans from files (``.jsonl``/``.json``, gzip, globs, directories) or Tempo as a DataFrame.

    Columns per ``docs/contracts.md``: :data:`kvtune.traces.SPAN_COLUMNS` then one typed column per
    convention attribute. ``skip_bad`` skips malformed records instead of raising
    :class:`~kvtune.errors.TraceFormatError`, listing them in ``df.attrs["skipped"]`` as
    (source, line, reason). With ``correct_clocks`` each host's clock offset is estimated from
    causal pairs and subtracted (``df.attrs["clock_offsets_ns"]``). ``progress``: tqdm bar on
    stderr (None: only on a terminal).
    """
    from kvtune.traces.clocks import apply_offsets, estimate_offsets

    # Decoding makes millions of small acyclic objects; the cyclic GC would rescan them over and
    # over (measured: about a third of the load time), so it is paused while the frame is built.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        rows = read_spans(source, skip_bad=skip_bad, progress=progress)
        df = rows.frame(skip_bad=skip_bad)
        skipped, sources = rows.skipped, rows.sources
        tempo_reads = list(rows.tempo_reads)
        del rows
    finally:
        if gc_was_enabled:
            gc.enable()
    offsets: dict[str, int] = {}
    if correct_clocks and len(df):
        est = estimate_offsets(df)
        offsets = dict(est.offsets_ns)
        df = apply_offsets(df, offsets)
    df.attrs["clock_offsets_ns"] = offsets
    df.attrs["skipped"] = [s.as_tuple() for s in skipped]
    df.attrs["sources"] = list(sources)
    if tempo_reads:
        df.attrs["tempo_reads"] = tempo_reads
    if skipped:
        _logger.warning("skipped %d bad record(s) from %d source(s); first: %s:%s: %s",
                        len(skipped), len({s.source for s in skipped}),
                        skipped[0].source, skipped[0].line, skipped[0].reason)
    return df
