"""Router configuration files, validation and the CLI (the CLI only parses and calls one function)."""
from __future__ import annotations

import json

import pytest
import yaml

from kvtune.errors import ConfigError
from kvtune.router import cli
from kvtune.router.config import RouterConfig, config_from_dict, load_config, write_config
from kvtune.spans import Mode

pytestmark = pytest.mark.timeout(60)

EXAMPLE = {
    "mode": "push", "host": "127.0.0.1", "port": 9000, "state": "sqlite:/tmp/x.db",
    "decoder_ttl_s": 120, "margin_s": 15, "max_body_bytes": 65536,
    "prefill": [{"url": "http://10.0.0.1:8100", "engine_id": "p0", "kv_port": 5600, "tp_size": 2}],
    "decode": ["http://10.0.0.2:8200", {"url": "http://10.0.0.3:8200/"}],
    "telemetry": {"json_path": "/tmp/spans"},
}


def test_yaml_and_json_files_round_trip(tmp_path):
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(EXAMPLE))
    cfg = load_config(tmp_path / "router.yaml")
    assert cfg.mode is Mode.PUSH and cfg.port == 9000 and cfg.params_ttl_s == 105
    assert cfg.prefill[0].engine_id == "p0" and cfg.prefill[0].tp_size == 2
    assert cfg.prefill[0].side_channel_host == "10.0.0.1"
    assert [d.url for d in cfg.decode] == ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
    assert cfg.telemetry == {"json_path": "/tmp/spans"}
    again = load_config(write_config(cfg, tmp_path / "copy.json"))
    assert again == cfg
    assert json.loads((tmp_path / "copy.json").read_text())["mode"] == "push"
    assert load_config(write_config(cfg, tmp_path / "copy.yaml")) == cfg


def test_defaults_bind_loopback():
    cfg = config_from_dict({"prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2"})
    assert cfg.host == "127.0.0.1" and cfg.mode is Mode.PULL
    assert cfg.state.startswith("sqlite:") and cfg.params_ttl_s < cfg.decoder_ttl_s


@pytest.mark.parametrize("change, field", [
    ({"mode": "probe"}, "mode"),
    ({"mode": "sideways"}, "mode"),
    ({"margin_s": 500}, "margin_s"),
    ({"margin_s": -1}, "margin_s"),
    ({"decoder_ttl_s": 0}, "decoder_ttl_s"),
    ({"port": 70000}, "port"),
    ({"state": "mysql://x"}, "state"),
    ({"prefill": []}, "prefill"),
    ({"decode": ["ftp://x"]}, "decode[0].url"),
    ({"colour": "blue"}, "unknown keys"),
    ({"prefill": [{"url": "http://a:1", "engine": "x"}]}, "unknown keys"),
    ({"decoder_ttl_s": "soon"}, "decoder_ttl_s"),
])
def test_invalid_configs_name_the_file_and_field(tmp_path, change, field):
    data = {"prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2", **change}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_push_needs_prefill_engine_id_and_port():
    with pytest.raises(ConfigError, match="engine_id"):
        config_from_dict({"mode": "push", "prefill": "http://127.0.0.1:1",
                          "decode": "http://127.0.0.1:2"})


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("mode: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def _parse(argv):
    import argparse
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    return parser.parse_args(["router", *argv])


def test_cli_flags_call_run_router_once(monkeypatch):
    calls = []
    monkeypatch.setattr("kvtune.router.server.run_router",
                        lambda config, port_file=None: calls.append((config, port_file)) or 0)
    args = _parse(["--prefill", "http://127.0.0.1:8100#engine_id=p0&kv_port=5600",
                   "--prefill", "http://127.0.0.1:8101#engine_id=p1&kv_port=5601",
                   "--decode", "http://127.0.0.1:8200", "--mode", "push", "--port", "0",
                   "--state", "sqlite:/tmp/r.db", "--margin-s", "5", "--port-file", "/tmp/p"])
    assert args.func(args) == 0
    (config, port_file), = calls
    assert isinstance(config, RouterConfig) and port_file == "/tmp/p"
    assert config.mode is Mode.PUSH and config.port == 0 and config.margin_s == 5
    assert [(p.url, p.engine_id, p.kv_port) for p in config.prefill] == [
        ("http://127.0.0.1:8100", "p0", 5600), ("http://127.0.0.1:8101", "p1", 5601)]


def test_cli_config_file_with_overrides(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("kvtune.router.server.run_router",
                        lambda config, port_file=None: calls.append(config) or 0)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(EXAMPLE))
    args = _parse(["--config", str(path), "--mode", "bidirectional", "--host", "0.0.0.0"])
    assert args.func(args) == 0
    assert calls[0].mode is Mode.BIDIRECTIONAL and calls[0].host == "0.0.0.0"
    assert calls[0].port == 9000


def test_cli_without_upstreams_is_an_error():
    args = _parse(["--mode", "pull"])
    with pytest.raises(ConfigError, match="--prefill"):
        cli.run(args)


def test_kvtune_cli_dispatches_router(monkeypatch):
    from kvtune.cli import main
    calls = []
    monkeypatch.setattr("kvtune.router.server.run_router",
                        lambda config, port_file=None: calls.append(config) or 0)
    assert main(["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
                modules=(("router", "kvtune.router.cli"),)) == 0
    assert calls[0].prefill[0].url == "http://127.0.0.1:1"
    assert main(["router", "--mode", "pull"], modules=(("router", "kvtune.router.cli"),)) == 2


def test_default_margin_keeps_short_ttls_usable():
    base = {"prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2"}
    assert config_from_dict({**base, "decoder_ttl_s": 480}).margin_s == 30
    short = config_from_dict({**base, "decoder_ttl_s": 20})
    # a quarter of 20 s would be 5 s, under vLLM's readback margin (5 s) + 1 s of slack
    assert short.margin_s == 6 and short.params_ttl_s == 14
    assert config_from_dict({**base, "decoder_ttl_s": 5}).params_ttl_s == 0  # never offered
    assert config_from_dict({**base, "decoder_ttl_s": 20, "margin_s": 0}).params_ttl_s == 20
