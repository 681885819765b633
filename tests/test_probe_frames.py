"""The probe side channel's frame decoder and command checks against hostile input (no NIXL):
regression tests for the issue's examples and hypothesis properties (500 examples each)."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import numpy as np
import pytest
from fuzz_settings import PROPERTY
from hypothesis import given
from hypothesis import strategies as st

from kvtune.errors import ProbeError
from kvtune.probe import commands
from kvtune.probe.channel import (
    HEADER,
    MAX_BLOB_BYTES,
    MAX_JSON_BYTES,
    BadMessage,
    Channel,
    ChannelClosed,
    decode_message,
)

NBYTES = 1 << 16


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, "a"), Channel(b, "b")


def _frame(msg_bytes: bytes, blob: bytes = b"") -> bytes:
    return HEADER.pack(len(msg_bytes), len(blob)) + msg_bytes + blob


# --- regressions: the examples -------------------------------------------------------------
def test_deeply_nested_frame_is_a_bad_message_not_a_recursion_error():
    raw = b'{"type":"hello","x":' + b"[" * 20_000 + b"]" * 20_000 + b"}"  # fits a socket buffer
    with pytest.raises(BadMessage, match="nested too deeply"):
        decode_message(raw, "peer")
    a, b = _pair()
    a.sock.sendall(_frame(raw))
    with pytest.raises(BadMessage):
        b.recv(5)
    a.send({"type": "ping"})  # the stream is still in step: the next frame reads fine
    assert b.recv(5).msg == {"type": "ping"}


@pytest.mark.parametrize("raw", [
    b'{"type":"stats","timeout_s":Infinity}', b'{"type":"stats","timeout_s":NaN}',
    b'{"type":"fill","seed":' + b"9" * 5000 + b"}",  # past Python's int digit limit
    b'\xff\xfe{"type":"x"}', b"[1,2]", b'{"type":' + b'"' + b"t" * 65 + b'"}', b"",
])
def test_non_messages_are_bad_messages(raw):
    with pytest.raises(BadMessage, match="side channel from peer"):
        decode_message(raw, "peer")


@pytest.mark.parametrize(("msg", "field"), [
    ({"type": "fill", "seed": "x", "ranges": [[0, 8]]}, "'seed'"),
    ({"type": "fill", "seed": True, "ranges": [[0, 8]]}, "'seed'"),
    ({"type": "fill", "seed": 2**200, "ranges": [[0, 8]]}, "'seed'"),
    ({"type": "fill", "ranges": [[1]]}, "ranges[0]"),
    ({"type": "fill", "ranges": [[0, 8, 9]]}, "ranges[0]"),
    ({"type": "fill", "ranges": [0, 8]}, "ranges[0]"),
    ({"type": "digest", "ranges": [["0", 8]]}, "ranges[0]"),
    ({"type": "digest", "ranges": 5}, "'ranges'"),
    ({"type": "digest", "ranges": {"0": 8}}, "'ranges'"),
    # wraps to a negative end in int64 (2**62 + 2**62 = 2**63): refused with Python integers
    ({"type": "fill", "ranges": [[2**62, 2**62]]}, "ranges[0]"),
    ({"type": "fill", "ranges": [[2**63 - 1, 2**63 - 1]]}, "ranges[0]"),
    ({"type": "digest", "ranges": [[0, 2**64]]}, "ranges[0]"),
    ({"type": "digest", "ranges": [[-1, 8]]}, "ranges[0]"),
    ({"type": "digest", "ranges": [[0, NBYTES]] * 2}, "at most"),  # every byte twice
    ({"type": "stats", "expect": -1}, "'expect'"),
    ({"type": "stats", "expect": 2**70}, "'expect'"),
    ({"type": "stats", "expect": 1, "timeout_s": 1e308}, "'timeout_s'"),
    ({"type": "stats", "expect": 1, "timeout_s": 10**400}, "'timeout_s'"),
    ({"type": "stats", "expect": 1, "timeout_s": "5"}, "'timeout_s'"),
    ({"type": "rm -rf"}, "unknown command"),
])
def test_bad_commands_name_the_field(msg, field):
    with pytest.raises(ProbeError) as info:
        commands.parse_command(msg, NBYTES)
    assert field in str(info.value) and msg["type"] in str(info.value)


@pytest.mark.parametrize("msg", [
    {"type": "hello", "version": True, "nbytes": 8},
    {"type": "hello", "version": 1, "nbytes": 2**64 + 8},
    {"type": "hello", "version": 1, "nbytes": True},
    {"type": "hello", "version": 1, "nbytes": -8},
    {"type": "hello", "version": 1, "nbytes": "8"},
    {"type": "hello", "version": 1, "nbytes": 8, "fabric": ["x"]},
    {"type": "hello", "version": 1, "nbytes": 8, "fabric": "x" * 1000},
    {"type": "ping"},
])
def test_bad_hellos_are_refused(msg):
    with pytest.raises(ProbeError, match="hello"):
        commands.parse_hello(msg, 1, NBYTES)


def test_good_commands_pass_through():
    c = commands.parse_command({"type": "fill", "seed": -5, "ranges": [[0, 8], [16, 8]]}, NBYTES)
    assert c.seed == -5 and c.ranges.tolist() == [[0, 8], [16, 8]] and c.ranges.dtype == np.int64
    c = commands.parse_command({"type": "stats", "expect": 3, "timeout_s": 10}, NBYTES)
    assert (c.expect, c.timeout_s) == (3, 10.0)
    assert commands.parse_hello({"type": "hello", "version": 1, "nbytes": 8}, 1, NBYTES) == \
        commands.Hello(8, "")


def test_a_frame_trickled_byte_by_byte_misses_its_deadline():
    """The deadline covers the whole frame: a byte every 0.05 s keeps every single recv() within
    0.5 s (the old per-recv timeout accepted it after 3 s), but the frame as a whole is late."""
    a, b = _pair()
    data = _frame(json.dumps({"type": "ping", "pad": "x" * 40}).encode())
    stop = threading.Event()

    def trickle():
        for byte in data:
            if stop.is_set():
                return
            try:
                a.sock.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        with pytest.raises(ProbeError, match="no reply within 0.5 s"):
            b.recv(0.5)
    finally:
        stop.set()
        t.join()


def test_session_deadline_bounds_a_frame_with_a_longer_timeout():
    a, b = _pair()
    with pytest.raises(ProbeError, match="before the session's end"):
        b.recv(60, deadline=time.monotonic() + 0.2)


# --- properties -----------------------------------------------------------------------------------
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(2**62, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@PROPERTY
@given(st.binary(max_size=2048))
def test_property_decoder_takes_any_bytes(raw):
    try:
        msg = decode_message(raw, "peer")
    except BadMessage as exc:
        assert "side channel from peer" in str(exc)
    else:
        assert isinstance(msg, dict) and isinstance(msg["type"], str)


@PROPERTY
@given(json_values, st.integers(0, 3))
def test_property_decoder_takes_any_json(value, cut):
    raw = json.dumps(value).encode()
    raw = raw[:len(raw) - cut] if cut else raw  # cut JSON too
    try:
        msg = decode_message(raw, "peer")
    except BadMessage:
        assert not (cut == 0 and isinstance(value, dict) and isinstance(value.get("type"), str)
                    and len(value["type"]) <= 64)
    else:
        assert msg == json.loads(raw)


@PROPERTY
@given(st.integers(0, 2**32 - 1) | st.integers(0, 64), st.integers(0, 2**32 - 1) | st.integers(0, 64),
       st.binary(max_size=512), st.booleans())
def test_property_channel_frames_either_decode_or_raise_probe_errors(json_len, blob_len, body, close):
    a, b = _pair()
    try:
        a.sock.sendall(struct.pack("!II", json_len, blob_len) + body)
        if close:
            a.sock.shutdown(socket.SHUT_WR)
        try:
            frame = b.recv(0.01)
        except ProbeError as exc:  # ChannelClosed and BadMessage are ProbeErrors
            if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
                assert "announces" in str(exc)
            elif json_len + blob_len > len(body):
                assert isinstance(exc, ChannelClosed) or "no reply within" in str(exc)
        else:
            assert json_len + blob_len <= len(body) and frame.blob == body[json_len:json_len + blob_len]
    finally:
        a.close()
        b.close()


field_values = (json_scalars | st.lists(st.lists(st.integers(-2**64, 2**64) | json_scalars,
                                                  max_size=3), max_size=4))


@PROPERTY
@given(st.sampled_from(commands.COMMANDS + ("hello", "x")),
       st.dictionaries(st.sampled_from(["seed", "ranges", "expect", "timeout_s"]), field_values))
def test_property_commands_are_checked_or_refused(kind, fields):
    try:
        cmd = commands.parse_command({"type": kind, **fields}, NBYTES)
    except ProbeError as exc:
        assert str(exc)
        return
    if cmd.ranges is not None:
        r = cmd.ranges.astype(object)  # Python integers: no wrap-around in the check itself
        assert all(o >= 0 and n >= 0 and o + n <= NBYTES for o, n in r) and sum(r[:, 1]) <= NBYTES
    assert -(2**64) < cmd.seed < 2**64 and 0 <= cmd.expect <= commands.MAX_EXPECT
    assert 0 <= cmd.timeout_s <= commands.MAX_STATS_WAIT_S


@PROPERTY
@given(st.lists(st.tuples(st.integers(0, NBYTES), st.integers(0, NBYTES)), max_size=8))
def test_property_ranges_inside_the_buffer_are_accepted_exactly(pairs):
    raw = [[o, n] for o, n in pairs]
    fits = all(o + n <= NBYTES for o, n in pairs) and sum(n for _, n in pairs) <= NBYTES
    try:
        arr = commands.parse_ranges(raw, NBYTES, "fill")
    except ProbeError:
        assert not fits
    else:
        assert fits and arr.tolist() == raw
