"""The compose stack and the configs it mounts: they parse, pin versions, bind 127.0.0.1 and wire
OTLP 4317/4318 from the Collector through to Tempo, whose local-blocks processor is on."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
STACK = ROOT / "dashboards"
OTLP_GRPC, OTLP_HTTP = 4317, 4318


def load(name: str) -> dict:
    return yaml.safe_load((STACK / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("compose.yaml")


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to dashboards/) for bind mounts and named volumes."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = parts[0]
    return out


def test_images_are_pinned(compose):
    images = {name: s["image"] for name, s in compose["services"].items()}
    assert {"tempo", "grafana", "otel-collector"} <= set(images)
    for name, image in images.items():
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"^\d+\.\d+\.\d+", tag), f"{name}: unpinned {image}"
    assert images["tempo"].startswith("grafana/tempo:")
    assert images["grafana"].startswith("grafana/grafana:")
    # the file exporter ships in the contrib distribution only
    assert images["otel-collector"].startswith("otel/opentelemetry-collector-contrib:")


def test_every_published_port_binds_loopback(compose):
    published = []
    for name, s in compose["services"].items():
        for p in s.get("ports", []):
            assert isinstance(p, str), f"{name}: use the 'IP:HOST:CONTAINER' string form, got {p!r}"
            assert p.startswith("127.0.0.1:"), f"{name}: port {p} is not bound to 127.0.0.1"
            published.append(int(p.split(":")[1]))
        assert "network_mode" not in s, f"{name}: host networking would bypass the loopback binding"
    assert len(published) == len(set(published))
    assert {OTLP_GRPC, OTLP_HTTP, 3000, 3200} <= set(published)


def test_mounted_files_exist(compose):
    for name, s in compose["services"].items():
        for container, host in _mounts(s).items():
            if host.startswith("./"):
                path = STACK / host[2:]
                if container.startswith("/var/lib/kvtune-otel"):
                    assert path.is_dir() and (path / ".gitignore").is_file()  # output dir kept in git
                else:
                    assert path.exists(), f"{name}: mounts missing {host}"
            else:
                assert host in compose.get("volumes", {}), f"{name}: undeclared volume {host}"


def test_collector_receives_otlp_and_exports_to_tempo_and_a_json_file(compose):
    col = load("otel-collector.yaml")
    protocols = col["receivers"]["otlp"]["protocols"]
    assert _port_of(protocols["grpc"]["endpoint"]) == OTLP_GRPC
    assert _port_of(protocols["http"]["endpoint"]) == OTLP_HTTP
    service = compose["services"]["otel-collector"]
    assert {f"127.0.0.1:{OTLP_GRPC}:{OTLP_GRPC}", f"127.0.0.1:{OTLP_HTTP}:{OTLP_HTTP}"} <= set(service["ports"])
    assert _mounts(service)["/etc/otelcol/config.yaml"] == "./otel-collector.yaml"
    assert "--config=/etc/otelcol/config.yaml" in service["command"]
    pipeline = col["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    for p in pipeline["processors"]:
        assert p in col["processors"]
    exporters = {e: col["exporters"][e] for e in pipeline["exporters"]}
    to_tempo = [e for e in exporters if e.split("/")[0] == "otlp"]
    assert len(to_tempo) == 1
    host, port = exporters[to_tempo[0]]["endpoint"].rsplit(":", 1)
    assert host == "tempo" and "tempo" in compose["services"]
    tempo = load("tempo.yaml")
    tempo_grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert int(port) == _port_of(tempo_grpc) == OTLP_GRPC
    assert exporters[to_tempo[0]]["tls"]["insecure"] is True
    files = [e for e in exporters if e.split("/")[0] == "file"]
    assert len(files) == 1
    path = exporters[files[0]]["path"]
    assert exporters[files[0]].get("format", "json") == "json"  # OTLP-JSON lines: kvtune.traces.load reads them
    assert any(path.startswith(c + "/") for c in _mounts(service))


def test_tempo_enables_local_blocks_for_traceql_metrics(compose):
    tempo = load("tempo.yaml")
    assert "local-blocks" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]
    local = tempo["metrics_generator"]["processor"]["local_blocks"]
    assert local["filter_server_spans"] is False  # kvtune's phase spans are not SERVER spans
    assert local["flush_to_storage"] is True
    assert tempo["metrics_generator"]["traces_storage"]["path"].startswith("/var/tempo/")
    service = compose["services"]["tempo"]
    mounts = _mounts(service)
    assert mounts["/etc/tempo/tempo.yaml"] == "./tempo.yaml"
    assert "-config.file=/etc/tempo/tempo.yaml" in service["command"]
    assert "/var/tempo" in mounts  # wal, blocks and generator storage persist
    http = tempo["server"]["http_listen_port"]
    assert f"127.0.0.1:{http}:{http}" in service["ports"]
    for proto in ("grpc", "http"):
        assert tempo["distributor"]["receivers"]["otlp"]["protocols"][proto]["endpoint"]


def test_grafana_provisioning_datasource_and_dashboards(compose):
    ds = load("provisioning/datasources/tempo.yaml")
    assert ds["apiVersion"] == 1
    (tempo_ds,) = [d for d in ds["datasources"] if d["type"] == "tempo"]
    tempo = load("tempo.yaml")
    assert tempo_ds["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    assert tempo_ds["isDefault"] is True  # what ${DS_TEMPO} resolves to when nothing is chosen
    prov = load("provisioning/dashboards/kvtune.yaml")
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./provisioning"
    mounted_json = {Path(c).name: h for c, h in mounts.items()
                    if Path(c).parent == Path(provider["options"]["path"])}
    shipped = {p.name for p in STACK.glob("*.json")}
    assert shipped and set(mounted_json) == shipped, "every dashboard JSON must be mounted for the provider"
    assert all(h == f"./{n}" for n, h in mounted_json.items())
