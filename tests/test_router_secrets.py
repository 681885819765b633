"""Secrets never leave (issue 29): a password planted in the upstream URLs and the Redis DSN is
looked for in everything the router shows: ``/health``, response headers and bodies (502s
included), captured logs, the start-up log, and exported spans (attributes and events)."""
from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import time

import pytest

from kvtune.errors import RouterError
from kvtune.redact import redact_text, redact_url
from kvtune.router import RouterInThread, RouterProcess
from kvtune.router.client import get, post
from kvtune.router.config import InstanceConfig
from kvtune.router.state import RedisConversationStore, open_store
from kvtune.testing.standin import StandInVllmCluster
from _net import free_port
from redis_faults import RedisFaultProxy

pytestmark = pytest.mark.timeout(180)
PLANTED = "pl4nted-S3CRET"


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://kv:{PLANTED}@")


def _spans_text(exporter) -> str:
    out = []
    for s in exporter.get_finished_spans():
        out.append(json.dumps(dict(s.attributes or {}), default=str))
        out.append(str(s.status.description))
        for e in s.events:
            out.append(json.dumps(dict(e.attributes or {}), default=str))
    return "\n".join(out)


def test_redaction_rule():
    assert redact_url(f"http://u:{PLANTED}@h:1/p?q=1") == "http://u:***@h:1/p?q=1"
    assert redact_url(f"redis://:{PLANTED}@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url(f"http://h/p?token={PLANTED}&x=1") == "http://h/p?token=***&x=1"
    assert redact_url("http://h:1/p") == "http://h:1/p"
    assert redact_url(f"http://u:a@b{PLANTED}@h/") == "http://u:***@h/"  # '@' in the password
    text = f"connect to redis://:{PLANTED}@h:1/0 failed; and http://u:{PLANTED}@x/y"
    assert PLANTED not in redact_text(text) and "redis://:***@h:1/0" in redact_text(text)


def test_no_planted_password_in_health_headers_bodies_logs_or_spans(tmp_path, tracer, exporter,
                                                                    caplog):
    caplog.set_level(logging.DEBUG)
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster:
        dead = InstanceConfig(url=_with_password(f"http://127.0.0.1:{free_port()}"))
        config = cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db").replace(
            prefill=(InstanceConfig(url=_with_password(cluster.prefill[0].url)),),
            decode=(InstanceConfig(url=_with_password(cluster.decode[0].url)), dead))
        with RouterInThread(config, tracer=tracer) as router:
            answers = []
            for i in range(4):  # both decodes are chosen in turn: one answers, one is dead
                answers.append(post(router.url + "/v1/completions",
                                    {"model": "m", "prompt": f"p{i}", "max_tokens": 2}))
            cluster.decode[0].fail_status = 500
            for stream in (False, True):
                answers.append(post(router.url + "/v1/completions",
                                    {"model": "m", "prompt": "q", "max_tokens": 2,
                                     "stream": stream}))
            answers.append(get(router.url + "/v1/models"))
            health = get(router.url + "/health")
    statuses = sorted(a.status for a in answers)
    assert 200 in statuses and 502 in statuses  # failures happened, with instances named
    failed = [a for a in answers if a.status == 502]
    assert all("X-Kvtune-Failed-Instance" in a.headers for a in failed)
    assert any("kv:***@127.0.0.1" in a.headers["X-Kvtune-Failed-Instance"] for a in failed)
    shown = [health.body.decode()] + [a.body.decode(errors="replace") for a in answers] + \
        [json.dumps(dict(a.headers)) for a in [*answers, health]] + [caplog.text, _spans_text(exporter)]
    assert "kv:***@" in health.body.decode()
    for text in shown:
        assert PLANTED not in text


def test_no_planted_password_in_the_start_up_log(tmp_path):
    with StandInVllmCluster(1, 1) as cluster:
        config = cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db").replace(
            prefill=(InstanceConfig(url=_with_password(cluster.prefill[0].url)),))
        with RouterProcess(config, workdir=tmp_path / "r") as proc:
            assert post(proc.url + "/v1/completions", {"model": "m", "prompt": "a"}).status == 200
        log = proc.log_path.read_text()
    assert "kv:***@127.0.0.1" in log  # the start-up line names the instance
    assert PLANTED not in log


def test_no_redis_password_in_errors_logs_or_span_events(tmp_path, tracer, exporter, caplog):
    with pytest.raises(RouterError) as err:
        open_store(f"redis://:{PLANTED}@127.0.0.1:{free_port()}/0", params_ttl_s=5)
    assert PLANTED not in str(err.value) and ":***@" in str(err.value)
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary: the store's own failures are not exercised here")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", PLANTED,
                             "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:  # redis-server is up once it accepts a connection
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    proxy = RedisFaultProxy(port)
    try:
        store = RedisConversationStore(f"redis://:{PLANTED}@127.0.0.1:{proxy.port}/0",
                                       params_ttl_s=60)
        caplog.set_level(logging.DEBUG)
        with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
                RouterInThread(cluster.router_config("bidirectional", state=":memory:"),
                               store=store, tracer=tracer) as router:
            proxy.reset()
            proxy.arm("error", 0)  # begin_turn's MULTI answers -ERR: a state error
            answer = post(router.url + "/v1/completions",
                          {"model": "m", "prompt": "a", "conversation_id": "c"})
            health = get(router.url + "/health").json()
        assert answer.status == 200 and proxy.fired
        assert health["state_errors_total"] == 1
        events = [e for s in exporter.get_finished_spans() for e in s.events]
        assert any(":***@" in str(e.attributes.get("exception.message")) for e in events)
        assert PLANTED not in _spans_text(exporter) and PLANTED not in caplog.text
        assert PLANTED not in answer.body.decode()
    finally:
        proxy.close()
        proc.terminate()
        proc.wait(10)
