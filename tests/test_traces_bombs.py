"""Decompression and line-length bombs against the trace loader (issue 29): each is refused with an
error naming the file, the line and the limit, and the loader's peak memory stays under
:data:`PEAK_LIMIT_MIB`, measured in a fresh subprocess (its ``VmHWM``) so that nothing this test
process holds counts.
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvtune.traces.loader import MAX_RECORD_BYTES

ROOT = Path(__file__).resolve().parent.parent
PEAK_LIMIT_MIB = 300
GOOD_LINE = (json.dumps({"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{
    "spans": [{"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "1", "name": "kv.rdma",
               "startTimeUnixNano": "1", "endTimeUnixNano": "2"}]}]}]}) + "\n").encode()

CHILD = r"""
import json, sys
from kvtune.errors import KvtuneError
from kvtune.traces import load
try:
    df = load(sys.argv[1], skip_bad=sys.argv[2] == "skip", progress=False, correct_clocks=False)
    out = {"spans": len(df), "skipped": df.attrs["skipped"]}
except KvtuneError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
# VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's across exec)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
out["peak_mib"] = int(hwm.split()[1]) / 1024
print(json.dumps(out))
"""


def load_in_child(path: Path, skip: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), "skip" if skip else "raise"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gzip_of_zeros(path: Path, inflated: int, tail: bytes = b"") -> Path:
    """A gzip file that inflates to ``inflated`` NUL bytes (about 1 MB per GB), then ``tail``."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    with open(path, "wb") as f:
        for _ in range(inflated >> 20):
            f.write(comp.compress(block))
        f.write(comp.compress(tail))
        f.write(comp.flush())
    return path


@pytest.mark.parametrize("skip", [False, True], ids=["raise", "skip_bad"])
def test_a_gzip_of_zeros_is_refused_in_bounded_memory(tmp_path, skip):
    bomb = gzip_of_zeros(tmp_path / "zeros.jsonl.gz", 1 << 30, tail=b"\n" + GOOD_LINE)
    assert bomb.stat().st_size < 2 * 2**20
    out = load_in_child(bomb, skip)
    assert out["peak_mib"] < PEAK_LIMIT_MIB, out
    if skip:  # the bomb line is skipped whole; the good line after it is read
        assert out["spans"] == 1
        (where,) = out["skipped"]
        assert where[0] == str(bomb) and where[1] == 1 and str(MAX_RECORD_BYTES) in where[2]
    else:
        assert out["error"] == "TraceFormatError"
        assert f"{bomb}:1" in out["message"] and str(MAX_RECORD_BYTES) in out["message"]


def test_a_2gb_file_without_a_newline_is_refused_in_bounded_memory(tmp_path):
    big = tmp_path / "spans.jsonl"
    with open(big, "wb") as f:  # sparse: 2 GiB of zeros without using the disk
        f.truncate(2 * 2**30)
    out = load_in_child(big, skip=False)
    assert out["peak_mib"] < PEAK_LIMIT_MIB, out
    assert out["error"] == "TraceFormatError" and f"{big}:1" in out["message"]
    assert "MAX_RECORD_BYTES" in out["message"]


def test_a_json_document_over_the_limit_is_read_as_capped_lines(tmp_path):
    bomb = gzip_of_zeros(tmp_path / "trace.json.gz", 1 << 30)
    out = load_in_child(bomb, skip=False)
    assert out["peak_mib"] < PEAK_LIMIT_MIB, out
    assert out["error"] == "TraceFormatError" and f"{bomb}:1" in out["message"]


def test_lines_within_the_limit_still_load(tmp_path):
    f = tmp_path / "ok.jsonl.gz"
    with gzip.open(f, "wb") as g:
        g.write(GOOD_LINE * 3)
    from kvtune.traces import load
    assert len(load(str(f), correct_clocks=False)) == 3
