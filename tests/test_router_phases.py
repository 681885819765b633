"""The router's phase spans (kv.route, kv.prefill_leg, kv.handoff, kv.decode_leg): children of
kv.request that abut, with the legs' connection reuse and bytes; telemetry never breaks routing."""
from __future__ import annotations

import pytest
from opentelemetry.trace import StatusCode

from kvtune import spans
from kvtune.router import RouterInThread
from kvtune.router import tracing as router_tracing
from kvtune.router.client import post
from kvtune.testing.standin import StandInVllmCluster
from kvtune.vllm_pd import MODES

pytestmark = pytest.mark.timeout(120)
N = spans.SpanName


def _body(prompt: str, stream: bool) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", MODES)
def test_phases_abut_under_kv_request_with_reuse_and_bytes(mode, stream, tmp_path, tracer,
                                                           exporter):
    with StandInVllmCluster(1, 1, bidirectional=mode == "bidirectional") as cluster, \
            RouterInThread(cluster.router_config(mode, state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        for i in range(2):
            assert post(router.url + "/v1/completions", _body(f"a b c {i}", stream)).status == 200
    finished = exporter.get_finished_spans()
    requests = sorted((s for s in finished if s.name == N.REQUEST.value),
                      key=lambda s: s.start_time)
    assert len(requests) == 2
    for turn, req in enumerate(requests):
        kids = {s.name: s for s in finished if s.parent is not None
                and s.parent.span_id == req.context.span_id}
        want = {p.value for p in spans.ROUTER_PHASES}
        if mode == spans.Mode.PUSH.value:
            want.discard(N.HANDOFF.value)
        assert set(kids) == want
        # every phase carries the request's mode (the dashboards filter on it)
        assert {k.attributes[spans.MODE] for k in kids.values()} == {mode}
        route, p_leg, d_leg = kids[N.ROUTE.value], kids[N.PREFILL_LEG.value], kids[N.DECODE_LEG.value]
        assert route.start_time == req.start_time
        assert route.end_time == min(p_leg.start_time, d_leg.start_time)
        if mode != spans.Mode.PUSH.value:
            hand = kids[N.HANDOFF.value]
            assert (hand.start_time, hand.end_time) == (p_leg.end_time, d_leg.start_time)
        for leg in (p_leg, d_leg):
            assert req.start_time <= leg.start_time <= leg.end_time <= req.end_time
            assert leg.attributes[spans.HTTP_REQUEST_BYTES] > 0
            if leg is p_leg or not stream:
                assert leg.attributes[spans.HTTP_RESPONSE_BYTES] > 0
            else:  # a relayed stream is not counted
                assert spans.HTTP_RESPONSE_BYTES not in leg.attributes
            # the first request opens the connections; the second finds them kept alive
            assert leg.attributes[spans.HTTP_CONNECTION_REUSED] is (turn == 1)
            assert leg.status.status_code != StatusCode.ERROR


def test_a_failing_leg_is_an_error_span(tmp_path, tracer, exporter):
    from kvtune.router.config import InstanceConfig
    with StandInVllmCluster(1, 1) as cluster:
        config = cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db", connect_timeout_s=5)
        config = config.replace(decode=(InstanceConfig("http://127.0.0.1:9"),))
        with RouterInThread(config, tracer=tracer) as router:
            assert post(router.url + "/v1/completions", _body("a b", False)).status == 502
    (leg,) = [s for s in exporter.get_finished_spans() if s.name == N.DECODE_LEG.value]
    assert leg.status.status_code == StatusCode.ERROR
    assert leg.attributes[spans.ERROR_TYPE] == router_tracing.LEG_ERROR_TYPE


def test_a_raising_phase_emitter_never_fails_the_request(tmp_path, tracer, exporter, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("exporter bug")
    monkeypatch.setattr(router_tracing, "_span", boom)
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        assert post(router.url + "/v1/completions", _body("a b", False)).status == 200
    names = {s.name for s in exporter.get_finished_spans()}
    assert N.REQUEST.value in names and N.PREFILL_LEG.value not in names


def test_nothing_is_recorded_when_kv_request_does_not_record(tmp_path):
    from opentelemetry.trace import NoOpTracer
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=NoOpTracer()) as router:
        assert post(router.url + "/v1/completions", _body("a b", False)).status == 200
    assert router_tracing._PHASES.get() is None
