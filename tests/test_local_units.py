"""Fast checks of the local test bed without vLLM: arguments, the kv-transfer configs each mode
produces, /metrics parsing, process handling (real subprocesses standing in for vLLM servers) and
the HTTP client (against a real loopback HTTP server standing in for vLLM's)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtune.connectors.progress import EXTRA_CONFIG_KEY as PROGRESS_KEY
from kvtune.connectors.idle import EXTRA_CONFIG_KEY as IDLE_WAIT_KEY
from kvtune.connectors.progress import RECOMMENDED_DELAY_US, THREAD_KEY
from kvtune import vllm_pd as pd
from kvtune.errors import KvtuneError
from kvtune.local import client
from kvtune.local.errors import LocalPairError
from kvtune.local.metrics import (
    PROMPT_TOKENS_BY_SOURCE, PromptTokenSources, parse_prometheus, prompt_token_sources_from_text,
)
from kvtune.local.layout import PINNED, QUIET
from kvtune.local.pair import KV_LEASE_DURATION_S, LocalPair
from kvtune.local.server import VllmServer, free_ports, wait_healthy
from kvtune.vllm_pd import REMOTE_BLOCK_IDS


# --- arguments and configuration -------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "pushpull"}, "mode"),
    ({"mode": "pull", "connector": "lmcache"}, "connector"),
    ({"mode": "bidirectional", "ttl_s": 0}, "ttl_s"),
    ({"mode": "bidirectional", "recompute_threshold": -1}, "recompute_threshold"),
    ({"mode": "push", "ttl_s": 10}, "bidirectional"),
    ({"mode": "pull", "prefill_engine_id": "x", "decode_engine_id": "x"}, "engine_id"),
])
def test_bad_pair_arguments_raise_a_kvtune_error(tmp_path, kwargs, match):
    mode = kwargs.pop("mode")
    with pytest.raises(LocalPairError, match=match) as err:
        LocalPair(mode, workdir=tmp_path, **kwargs)
    assert isinstance(err.value, KvtuneError)


@pytest.mark.parametrize("connector", ["kvtune", "vllm"])
@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_kv_transfer_config_per_mode_and_connector(tmp_path, mode, connector):
    """The pinned layout: what the pair ran before the quiet one, with vLLM's own connectors given
    the same NIXL agent setting as kvtune's (pull: a sleeping progress thread)."""
    kwargs = {"ttl_s": 30, "recompute_threshold": 8} if mode == "bidirectional" else {}
    pair = LocalPair(mode, connector=connector, workdir=tmp_path, layout="pinned",
                     kv_extra_config={pd.NUM_THREADS: 2}, **kwargs)
    assert pair.layout is PINNED
    p, d = pair.kv_transfer_config("prefill"), pair.kv_transfer_config("decode")
    plain = connector == "vllm" and mode == "pull"
    expected = pd.CONNECTOR_CLASSES[("plain" if plain else connector, mode)]
    assert p[pd.KV_CONNECTOR] == d[pd.KV_CONNECTOR] == expected
    if connector == "kvtune":
        assert p[pd.KV_CONNECTOR_MODULE_PATH] == d[pd.KV_CONNECTOR_MODULE_PATH] \
            == pd.KVTUNE_CONNECTOR_MODULE
        assert p[pd.KV_CONNECTOR].startswith("KvtuneNixl")
    elif plain:
        assert p[pd.KV_CONNECTOR_MODULE_PATH] == d[pd.KV_CONNECTOR_MODULE_PATH] \
            == pd.PLAIN_CONNECTOR_MODULE
    else:
        assert pd.KV_CONNECTOR_MODULE_PATH not in p
    assert (p[pd.KV_ROLE], d[pd.KV_ROLE]) == (pd.KV_PRODUCER, pd.KV_CONSUMER)
    assert p["kv_buffer_device"] == d["kv_buffer_device"] == "cpu"
    assert p["engine_id"] == pair.prefill_engine_id != d["engine_id"] == pair.decode_engine_id
    for cfg in (p, d):
        extra = cfg[pd.KV_CONNECTOR_EXTRA_CONFIG]
        assert extra[pd.KV_LEASE_DURATION] == KV_LEASE_DURATION_S
        assert extra[pd.NUM_THREADS] == 2
        assert THREAD_KEY not in extra and IDLE_WAIT_KEY not in extra
        if mode == "bidirectional":
            assert extra[pd.BIDIRECTIONAL_KV_XFER] is True
            assert extra[pd.DECODER_KV_BLOCKS_TTL] == 30
            assert extra[pd.KV_RECOMPUTE_THRESHOLD] == 8
        else:
            assert pd.BIDIRECTIONAL_KV_XFER not in extra
    # NIXL's progress thread sleeps in pull mode only (push and bidirectional transfers were
    # measured to hang with it), for both connectors.
    delay_p = p[pd.KV_CONNECTOR_EXTRA_CONFIG].get(PROGRESS_KEY)
    delay_d = d[pd.KV_CONNECTOR_EXTRA_CONFIG].get(PROGRESS_KEY)
    if mode == "pull":
        assert delay_p == delay_d == RECOMMENDED_DELAY_US
    else:
        assert delay_p is None and delay_d is None
    env = pair.layout.env(0)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and "OMP_NUM_THREADS" not in env


@pytest.mark.parametrize("connector", ["kvtune", "vllm"])
@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_quiet_layout_config(tmp_path, mode, connector):
    """Quiet layout (the default): the model in the engine's process, no core binding, NIXL agents
    without a progress thread, bounded idle stepping; vLLM's own connectors get exactly the same
    settings (kvtune.connectors.plain)."""
    pair = LocalPair(mode, connector=connector, workdir=tmp_path)
    assert pair.layout is QUIET
    assert LocalPair(mode, connector=connector, workdir=tmp_path, layout="quiet").layout is QUIET
    for role in ("prefill", "decode"):
        cfg = pair.kv_transfer_config(role)
        extra = cfg[pd.KV_CONNECTOR_EXTRA_CONFIG]
        assert extra[THREAD_KEY] is False and extra[pd.NUM_THREADS] == 0
        assert extra[IDLE_WAIT_KEY] == QUIET.idle_wait_ms
        assert PROGRESS_KEY not in extra
        if connector == "vllm":
            assert cfg[pd.KV_CONNECTOR] == pd.CONNECTOR_CLASSES[("plain", mode)]
            assert cfg[pd.KV_CONNECTOR_MODULE_PATH] == pd.PLAIN_CONNECTOR_MODULE
    assert QUIET.env(1) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in PINNED.env(1)
    with pytest.raises(LocalPairError, match="layout"):
        LocalPair(mode, workdir=tmp_path, layout="crowded")


def test_plain_connector_names_exist_in_their_module():
    pytest.importorskip("vllm")
    import importlib

    module = importlib.import_module(pd.PLAIN_CONNECTOR_MODULE)
    for name in {c for (family, _), c in pd.CONNECTOR_CLASSES.items() if family == "plain"}:
        assert hasattr(module, name)


def test_progress_delay_can_be_turned_off_or_overridden(tmp_path):
    spinning = dataclasses.replace(PINNED, name="spinning", pull_progress_delay_us=None)
    off = LocalPair("pull", workdir=tmp_path, layout=spinning)
    assert PROGRESS_KEY not in off.kv_transfer_config("decode")[pd.KV_CONNECTOR_EXTRA_CONFIG]
    per_role = LocalPair("push", workdir=tmp_path, layout=PINNED,
                         role_kv_extra_config={"decode": {PROGRESS_KEY: 5000}})
    assert per_role.kv_transfer_config("decode")[pd.KV_CONNECTOR_EXTRA_CONFIG][PROGRESS_KEY] == 5000
    assert PROGRESS_KEY not in per_role.kv_transfer_config("prefill")[pd.KV_CONNECTOR_EXTRA_CONFIG]
    with pytest.raises(LocalPairError, match="role_kv_extra_config"):
        LocalPair("pull", workdir=tmp_path, role_kv_extra_config={"router": {}})


def test_requests_need_a_started_pair_and_valid_inputs(tmp_path):
    pull = LocalPair("pull", workdir=tmp_path)
    with pytest.raises(LocalPairError, match="not running"):
        pull.complete([1, 2, 3], 4)
    with pytest.raises(LocalPairError, match="not running"):
        _ = pull.prefill_url
    for prompt in ([], "", [1, -2], [1, True], [1.5]):
        with pytest.raises(LocalPairError, match="prompt"):
            pull.complete(prompt, 4)
    for max_tokens in (0, -1, 2.0, True):
        with pytest.raises(LocalPairError, match="max_tokens"):
            pull.complete([1, 2], max_tokens)
    with pytest.raises(LocalPairError, match="bidirectional"):
        pull.complete([1, 2], 4, conversation="c")


# --- /metrics --------------------------------------------------------------------------------
EXPOSITION = textwrap.dedent(f"""\
    # HELP {PROMPT_TOKENS_BY_SOURCE} Number of prompt tokens by source.
    # TYPE {PROMPT_TOKENS_BY_SOURCE} counter
    {PROMPT_TOKENS_BY_SOURCE}{{engine="0",model_name="m",source="local_compute"}} 41.0
    {PROMPT_TOKENS_BY_SOURCE}{{engine="0",model_name="m",source="local_cache_hit"}} 128.0
    {PROMPT_TOKENS_BY_SOURCE}{{engine="0",model_name="m",source="external_kv_transfer"}} 95.0
    {PROMPT_TOKENS_BY_SOURCE}{{engine="1",model_name="m",source="external_kv_transfer"}} 5.0
    vllm:prompt_tokens_total{{engine="0",model_name="m"}} 264.0
    vllm:weird{{label="a \\"quoted\\" value"}} 1e3
    """)


def test_prompt_token_sources_sum_engines_per_source():
    s = prompt_token_sources_from_text(EXPOSITION)
    assert s == PromptTokenSources(local_compute_tokens=41, local_cache_hit_tokens=128,
                                   external_kv_transfer_tokens=100)
    assert s.total_tokens == 269
    assert s - PromptTokenSources(40, 128, 0) == PromptTokenSources(1, 0, 100)


def test_parse_prometheus_reads_labels_and_values():
    samples = parse_prometheus(EXPOSITION)
    assert ("vllm:prompt_tokens_total", {"engine": "0", "model_name": "m"}, 264.0) in samples
    assert any(name == "vllm:weird" and value == 1000.0 for name, _, value in samples)


def test_missing_counter_is_a_clear_error():
    with pytest.raises(LocalPairError, match=PROMPT_TOKENS_BY_SOURCE):
        prompt_token_sources_from_text("vllm:prompt_tokens_total 3\n")


# --- processes ---------------------------------------------------------------------------------
class StandInServer(VllmServer):
    """A real subprocess running ``script`` instead of vLLM (same start/wait/stop machinery)."""

    def __init__(self, tmp_path, script: str, name: str = "standin") -> None:
        (port,) = free_ports(1)
        super().__init__(name, model_dir=tmp_path, workdir=tmp_path, port=port, cpu_core=0)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_kills_the_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn server: needs the SIGKILL
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(600)
    """)
    srv = StandInServer(tmp_path, script)
    srv.start()
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.1)
        parent, child = map(int, pids.read_text().split())
        assert _alive(parent) and _alive(child)
    finally:
        srv.stop(grace_s=1.0)
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(parent) and not _alive(child)
    assert srv.exited() is None and srv.proc is None  # stopped; stop() is idempotent
    srv.stop()


def test_wait_healthy_fails_fast_with_the_log_when_a_server_exits(tmp_path):
    ok = StandInServer(tmp_path, "import time; time.sleep(600)", name="sleeper")
    bad = StandInServer(tmp_path, "print('boom: no CPU KV cache'); raise SystemExit(3)",
                        name="crasher")
    for s in (ok, bad):
        s.start()
    try:
        with pytest.raises(LocalPairError) as err:
            wait_healthy([ok, bad], timeout_s=120)
    finally:
        ok.stop()
        bad.stop()
    msg = str(err.value)
    assert "crasher" in msg and "code 3" in msg and "boom: no CPU KV cache" in msg
    assert "last 60 lines of sleeper log" in msg


def test_wait_healthy_times_out_naming_the_server(tmp_path):
    srv = StandInServer(tmp_path, "import time; time.sleep(600)", name="silent")
    srv.start()
    try:
        with pytest.raises(LocalPairError, match="silent: /health not ready within 1 s"):
            wait_healthy([srv], timeout_s=1)
    finally:
        srv.stop()


def test_wait_healthy_returns_once_health_answers(tmp_path):
    script = textwrap.dedent("""
        import sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """)
    srv = StandInServer(tmp_path, script)
    srv.start()
    try:
        wait_healthy([srv], timeout_s=120)
        assert srv.healthy()
    finally:
        srv.stop()
    assert not srv.healthy()


def test_free_ports_are_distinct():
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1024 <= p < 65536 for p in ports)


# --- HTTP client ---------------------------------------------------------------------------------
class StandInCompletions(BaseHTTPRequestHandler):
    """A loopback stand-in for vLLM's /v1/completions: echoes the prompt's first tokens."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((dict(self.headers), body))
        if body.get("max_tokens") == 99:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "boom"}')
            return
        out = list(body["prompt"][: body["max_tokens"]])
        if not body.get("stream"):
            data = {"choices": [{"text": "x" * len(out), "token_ids": out}],
                    pd.KV_TRANSFER_PARAMS: {REMOTE_BLOCK_IDS: [[1]]}}
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"text": "", "prompt_token_ids": [1]}]}\n\n')
        for t in out:
            chunk = {"choices": [{"text": "x", "token_ids": [t]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture()
def standin_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandInCompletions)
    httpd.seen = []
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.seen
    httpd.shutdown()
    httpd.server_close()


def test_client_reads_plain_and_streamed_completions(standin_url):
    url, seen = standin_url
    plain = client.complete(url, {"prompt": [5, 6, 7], "max_tokens": 2},
                            headers={"X-Request-Id": "r1"}, timeout_s=30)
    assert plain.token_ids == (5, 6) and plain.text == "xx"
    assert plain.kv_transfer_params == {REMOTE_BLOCK_IDS: [[1]]}
    assert plain.first_token_ms is None and plain.elapsed_ms > 0
    streamed = client.complete(url, {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True},
                               timeout_s=30)
    assert streamed.token_ids == (5, 6, 7) and streamed.text == "xxx"
    assert 0 < streamed.first_token_ms <= streamed.elapsed_ms
    assert seen[0][0]["X-Request-Id"] == "r1"


def test_client_reports_http_errors_with_status_and_body(standin_url):
    url, _ = standin_url
    with pytest.raises(client.HttpError) as err:
        client.complete(url, {"prompt": [1], "max_tokens": 99}, timeout_s=30)
    assert err.value.status == 500 and "boom" in err.value.body
    with pytest.raises(client.HttpError) as err:
        client.get("http://127.0.0.1:1", "/health", timeout_s=5)
    assert err.value.status is None


# --- CLI -----------------------------------------------------------------------------------------
LOCAL_CLI = (("local", "kvtune.local.cli"),)


def test_cli_run_parses_and_calls_the_session_function(monkeypatch, tmp_path, capsys):
    from kvtune import cli
    from kvtune.local import session

    calls = []

    def fake_session(mode, **kwargs):
        calls.append((mode, kwargs))
        summary = session.SessionSummary(mode, kwargs["connector"], 4, 0, 10.0, 5.0, None, None)
        return summary, []

    monkeypatch.setattr(session, "run_local_session", fake_session)
    rc = cli.main(["local", "run", "--mode", "bidirectional", "--connector", "vllm",
                   "--workdir", str(tmp_path), "--conversations", "3", "--seed", "5",
                   "--time-scale", "0", "--ttl-s", "60", "--recompute-threshold", "16"],
                  modules=LOCAL_CLI)
    assert rc == 0
    (mode, kwargs), = calls
    assert mode == "bidirectional" and kwargs["connector"] == "vllm"
    assert kwargs["config"].n_conversations == 3 and kwargs["config"].seed == 5
    assert kwargs["time_scale"] == 0.0 and kwargs["ttl_s"] == 60.0
    assert kwargs["recompute_threshold"] == 16
    assert json.loads(capsys.readouterr().out)["n_requests"] == 4


def test_cli_rejects_an_unknown_mode(capsys):
    from kvtune import cli
    with pytest.raises(SystemExit):
        cli.main(["local", "run", "--mode", "sideways", "--workdir", "x"], modules=LOCAL_CLI)
    assert "sideways" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_kv_both_pair_config_differs_only_in_kv_role(tmp_path, mode):
    both = LocalPair(mode, workdir=tmp_path, kv_both=True)
    pair = LocalPair(mode, workdir=tmp_path)
    for role in ("prefill", "decode"):
        cfg = both.kv_transfer_config(role)
        assert cfg[pd.KV_ROLE] == pd.KV_BOTH
        assert {**cfg, pd.KV_ROLE: None} == {**pair.kv_transfer_config(role), pd.KV_ROLE: None}
