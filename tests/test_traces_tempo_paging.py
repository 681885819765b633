"""A long Tempo range read in pages with a resumable cursor (issue 31), against the stand-in that
serves what a real Tempo 2.10.8 answered (``tests/tempo_standin.py``): a paged read with a cursor
gives the spans a one-shot read gives; a read stopped after some pages (a Tempo error, Ctrl-C)
resumes where it stopped with the same multiset of spans; a cursor of another read is refused,
naming the file and the field."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from tempo_standin import Recording, serve

from kvtune import traces
from kvtune.errors import TraceSourceError
from kvtune.traces import cursor as cursor_mod
from kvtune.traces.tempo import TempoSource

Q = "q=%7B%7D"


@pytest.fixture(scope="module")
def rec() -> Recording:
    return Recording.load()


def spans_multiset(df) -> Counter:
    return Counter(zip(df["trace_id"], df["span_id"], df["name"], df["start_ns"]))


def fixed_range(state) -> tuple[int, int]:
    """An hour of whole minutes holding every recorded trace (the stand-in moved them to end a
    minute before it started; they started over 223 s), so that one-minute pages split them."""
    end = (time.time_ns() // 10**9 // 60 + 2) * 60
    return end - 3600, end


def test_a_paged_read_with_a_cursor_gives_the_one_shot_reads_spans(rec, tmp_path):
    with serve(rec) as (host, state):
        start, end = fixed_range(state)
        base = f"tempo+http://{host}?{Q}&start={start}&end={end}"
        one_shot = traces.load(base + "&page=3h", correct_clocks=False)
        cur = tmp_path / "read.cursor.json"
        paged = traces.load(f"{base}&page=1m&cursor={cur}", correct_clocks=False)
    assert len(one_shot) == rec.meta["spans"]
    assert spans_multiset(paged) == spans_multiset(one_shot)
    (read,) = paged.attrs["tempo_reads"]
    assert read.pages == 60 and read.pages_resumed == 0 and not read.partial
    assert read.traces_fetched == rec.meta["traces"] == read.search.n_found
    saved = json.loads(cur.read_text())
    assert sorted(saved["done"]) == list(range(60))
    assert saved["spans_written"] == rec.meta["spans"]
    assert saved["traces_written"] == rec.meta["traces"]
    spool = Path(str(cur) + cursor_mod.SPOOL_SUFFIX)
    assert saved["spool_bytes"] == spool.stat().st_size
    # the spool is itself a span source: the same spans again
    assert spans_multiset(traces.load(str(spool), correct_clocks=False)) == spans_multiset(one_shot)


def test_a_trace_found_by_two_pages_is_read_once(rec, tmp_path):
    """Tempo answers a window with traces that overlap it, so a trace running across a page
    boundary is found by both pages: it is read by the page its start falls in."""
    with serve(rec, match_before_s=120) as (host, state):
        start, end = fixed_range(state)
        base = f"tempo+http://{host}?{Q}&start={start}&end={end}"
        one_shot = traces.load(base, correct_clocks=False)
        paged = traces.load(f"{base}&page=1m&cursor={tmp_path / 'c.json'}", correct_clocks=False)
    assert len(one_shot) == rec.meta["spans"]
    assert spans_multiset(paged) == spans_multiset(one_shot)


def _pages_with_traces(rec: Recording, state, start: int, page_s: int) -> list[int]:
    return sorted({((int(t["startTimeUnixNano"]) + state.shift_ns) // 10**9 - start) // page_s
                   for t in rec.search_range["traces"]})


def test_a_read_stopped_by_a_tempo_error_resumes_without_losing_or_repeating(rec, tmp_path):
    cur = tmp_path / "c.json"
    with serve(rec) as (host, state):
        start, end = fixed_range(state)
        # lookahead=0: page k-1's search must not reach into the failing page k
        url = (f"tempo+http://{host}?{Q}&start={start}&end={end}&page=1m&cursor={cur}"
               f"&lookahead=0")
        whole = traces.load(f"tempo+http://{host}?{Q}&start={start}&end={end}",
                            correct_clocks=False)
        busy = _pages_with_traces(rec, state, start, 60)
        assert len(busy) >= 2, "the recording must span two pages for this test"
        k = busy[1]  # pages before k (one of them with traces) finish; page k fails
        state.fail_search_from_s = start + k * 60
        with pytest.raises(TraceSourceError) as err:
            traces.load(url, correct_clocks=False)
        assert str(cur) in str(err.value) and "resume" in str(err.value)
        assert "HTTP 503" in str(err.value)
        saved = json.loads(cur.read_text())
        assert sorted(saved["done"]) == list(range(k))
        assert 0 < saved["traces_written"] < rec.meta["traces"]
        state.fail_search_from_s = None
        state.requests.clear()
        resumed = traces.load(url, correct_clocks=False)
    assert spans_multiset(resumed) == spans_multiset(whole)
    searched = sorted(int(q["start"][0]) for p, q in state.requests if p == "/api/search")
    assert searched[0] == start + k * 60  # the finished pages were not asked again
    (read,) = resumed.attrs["tempo_reads"]
    assert read.pages_resumed == k and read.traces_fetched == rec.meta["traces"]
    assert "resumed from" in read.summary()


def test_a_read_interrupted_mid_page_resumes_from_that_page(rec, tmp_path, monkeypatch):
    """Ctrl-C while a page's traces are being fetched: the half-written page is cut from the
    spool on resume and read again whole."""
    cur = tmp_path / "c.json"
    real_fetch = TempoSource.fetch_answer
    calls = {"n": 0, "stop": 0}

    def interrupted(self, tid):
        calls["n"] += 1
        if calls["n"] == calls["stop"]:
            raise KeyboardInterrupt
        return real_fetch(self, tid)

    with serve(rec) as (host, state):
        start, end = fixed_range(state)
        per_page = Counter(((int(t["startTimeUnixNano"]) + state.shift_ns) // 10**9 - start) // 60
                           for t in rec.search_range["traces"])
        biggest = max(per_page, key=per_page.get)
        before = sum(n for page, n in per_page.items() if page < biggest)
        calls["stop"] = before + 2  # the second trace of the biggest page
        url = f"tempo+http://{host}?{Q}&start={start}&end={end}&page=1m&cursor={cur}"
        whole = traces.load(f"tempo+http://{host}?{Q}&start={start}&end={end}",
                            correct_clocks=False)
        monkeypatch.setattr(TempoSource, "fetch_answer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            traces.load(url, correct_clocks=False)
        saved = json.loads(cur.read_text())
        spool = Path(str(cur) + cursor_mod.SPOOL_SUFFIX)
        assert spool.stat().st_size > saved["spool_bytes"]  # part of a page was written
        assert saved["traces_written"] == before
        monkeypatch.setattr(TempoSource, "fetch_answer", real_fetch)
        resumed = traces.load(url, correct_clocks=False)
    assert spans_multiset(resumed) == spans_multiset(whole)


def test_a_relative_range_resumes_the_range_the_cursor_was_made_for(rec, tmp_path):
    cur = tmp_path / "c.json"
    with serve(rec) as (host, state):
        url = f"tempo+http://{host}?{Q}&since=2h&page=20m&cursor={cur}"
        first = traces.load(url, correct_clocks=False)
        made = json.loads(cur.read_text())
        time.sleep(1.1)
        state.requests.clear()
        again = traces.load(url, correct_clocks=False)  # every page done: all from the spool
    (read,) = again.attrs["tempo_reads"]
    assert (read.search.start_s, read.search.end_s) == (made["start_s"], made["end_s"])
    assert read.pages_resumed == read.pages == 6
    assert spans_multiset(again) == spans_multiset(first)
    assert state.requests == []


def _make_cursor(host: str, tmp_path: Path, **extra: str) -> tuple[Path, str]:
    cur = tmp_path / "c.json"
    params = "&".join(f"{k}={v}" for k, v in {"start": "1000", "end": "4600", "page": "10m",
                                               **extra}.items())
    url = f"tempo+http://{host}?{Q}&{params}&cursor={cur}"
    traces.load(url, correct_clocks=False)  # nothing in that range: a cursor with 6 pages done
    return cur, url


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(version=99), "'version'"),
    (lambda d: d.update(kind="something else"), "'kind'"),
    (lambda d: d.update(url="http://other:3200"), "'url'"),
    (lambda d: d.update(query="{ name = \"x\" }"), "'query'"),
    (lambda d: d.update(start_s=1600), "'start_s'"),
    (lambda d: d.update(done=[0, 0]), "'done'"),
    (lambda d: d.update(spans_written=-1), "'spans_written'"),
    (lambda d: d.update(spool_bytes=10**6), "'spool_bytes'"),
    (lambda d: d.pop("page_s"), "'page_s'"),
])
def test_a_cursor_of_another_read_is_refused_naming_file_and_field(rec, tmp_path, change, field):
    with serve(rec) as (host, _):
        cur, url = _make_cursor(host, tmp_path)
        doc = json.loads(cur.read_text())
        change(doc)
        cur.write_text(json.dumps(doc))
        with pytest.raises(TraceSourceError) as err:
            traces.load(url, correct_clocks=False)
    assert str(cur) in str(err.value) and field in str(err.value)


def test_a_cursor_is_refused_for_another_source(rec, tmp_path):
    with serve(rec) as (host, _):
        cur, url = _make_cursor(host, tmp_path)
        for other, field in ((url.replace("end=4600", "end=8200"), "'end_s'"),
                             (url.replace("page=10m", "page=5m"), "'page_s'"),
                             (url.replace(Q, "q=%7B%20name%20%3D%20%22kv.rdma%22%20%7D"),
                              "'query'")):
            with pytest.raises(TraceSourceError) as err:
                traces.load(other, correct_clocks=False)
            assert str(cur) in str(err.value) and field in str(err.value), other


@pytest.mark.parametrize("content, words", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b" " * (cursor_mod.MAX_CURSOR_BYTES + 1), "over the"),
])
def test_a_malformed_or_oversized_cursor_is_refused(rec, tmp_path, content, words):
    with serve(rec) as (host, state):
        cur, url = _make_cursor(host, tmp_path)
        cur.write_bytes(content)
        state.requests.clear()
        with pytest.raises(TraceSourceError) as err:
            traces.load(url, correct_clocks=False)
        assert state.requests == []  # refused before anything is asked
    assert str(cur) in str(err.value) and words in str(err.value)


def test_pages_and_cursor_parameters_are_parsed_and_checked():
    src = TempoSource.from_url("tempo+http://h:1?since=1d&page=30m&cursor=/tmp/c.json"
                               "&skip_failed=1&metrics=true")
    assert (src.page_s, src.cursor, src.skip_failed, src.fleet_metrics) == (
        1800, "/tmp/c.json", True, True)
    assert src.pages(0, 4000) == [(0, 1800), (1800, 3600), (3600, 4000)]
    for bad, field in (("page=0", "page"), ("page=soon", "page"), ("skip_failed=maybe",
                                                                   "skip_failed")):
        with pytest.raises(TraceSourceError, match=field):
            TempoSource.from_url(f"tempo+http://h:1?{bad}")


def test_the_progress_bar_counts_pages_on_stderr_only_when_asked(rec, capsys):
    with serve(rec) as (host, _):
        traces.load(f"tempo+http://{host}?{Q}&since=2h&page=30m", progress=True,
                    correct_clocks=False)
        shown = capsys.readouterr()
        traces.load(f"tempo+http://{host}?{Q}&since=2h&page=30m", progress=False,
                    correct_clocks=False)
        quiet = capsys.readouterr()
    assert "tempo pages" in shown.err and "/4" in shown.err and "tempo pages" not in shown.out
    assert "tempo pages" not in quiet.err


def test_a_page_over_the_request_cap_is_cut_short_and_the_next_page_is_read(rec, monkeypatch):
    from kvtune.traces import tempo as tempo_mod

    monkeypatch.setattr(tempo_mod, "MAX_SEARCH_REQUESTS", 3)
    with serve(rec) as (host, state):
        start, end = fixed_range(state)
        busy = _pages_with_traces(rec, state, start, 60)
        # limit=1: a page with a trace needs more than 3 requests to reach one-second windows
        df = traces.load(f"tempo+http://{host}?{Q}&start={start}&end={end}&page=1m&limit=1"
                         f"&lookahead=0", correct_clocks=False)
    (read,) = df.attrs["tempo_reads"]
    assert not read.search.complete
    capped = [c for c in read.search.cut_short if "3 search requests for one page" in c]
    # the cap ends one page's search, not the read: every page with traces was searched (and
    # capped), not only the first
    assert len(capped) == len(busy) >= 2


def test_the_cursor_holds_no_password(rec, tmp_path):
    cur = tmp_path / "c.json"
    with serve(rec) as (host, _):
        url = f"tempo+http://kv:s3cret-pw@{host}?{Q}&start=1000&end=4600&cursor={cur}"
        traces.load(url, correct_clocks=False)
        traces.load(url, correct_clocks=False)  # and the same source resumes it
    assert "s3cret-pw" not in cur.read_text() and "kv:***@" in cur.read_text()


def test_a_page_reads_its_traces_that_reached_tempo_after_it(rec):
    """Tempo finds a trace that arrived late only in a window reaching its arrival (measured on
    2.10.8 and 3.0.3): one-minute pages without the lookahead miss the traces of the recording,
    with it (the default, 5 min) they read every one."""
    # traces overlap the ten minutes after they start (Tempo matches a window by overlap)
    # (30 s: every trace has arrived by now; one still on its way cannot be read)
    with serve(rec, arrival_delay_s=30, match_before_s=600) as (host, state):
        start, end = fixed_range(state)
        base = f"tempo+http://{host}?{Q}&start={start}&end={end}&page=1m"
        without = traces.load(f"{base}&lookahead=0", correct_clocks=False)
        default = traces.load(base, correct_clocks=False)
    assert without["trace_id"].nunique() < rec.meta["traces"]
    assert default["trace_id"].nunique() == rec.meta["traces"] and len(default) == rec.meta["spans"]


def test_a_range_past_now_reads_every_trace_and_no_window_past_tempos_clock(rec):
    """A range (and its pages' lookahead) that reaches into the future: no window starts past
    now, and one Tempo refuses for starting past its clock (about a minute behind ours here) reads
    as empty, not as an error (real Tempo 2.10.8 and 3.0.3 answered HTTP 400 "start must be
    before end")."""
    with serve(rec) as (host, state):
        newest = max(int(t["startTimeUnixNano"]) for t in rec.search_range["traces"])
        behind = (newest + state.shift_ns) // 10**9 + 1  # Tempo's clock: after the last trace
        state.refuse_from_s = behind
        start, _ = fixed_range(state)
        end = int(time.time()) + 900
        df = traces.load(f"tempo+http://{host}?{Q}&start={start}&end={end}&page=1m",
                         correct_clocks=False)
        starts = [int(q["start"][0]) for path, q in state.requests
                  if path == "/api/search" and "start" in q]
    assert df["trace_id"].nunique() == rec.meta["traces"] and len(df) == rec.meta["spans"]
    assert max(starts) <= int(time.time()) + 1  # nothing asked of the future
    assert any(s >= behind for s in starts)  # one window was refused, and read as empty
