"""Configuration files under hostile input (issue 29): a 380-byte YAML alias bomb in a verify
config and in the router's config fails at once with a clear error (peak memory measured in a
subprocess, its VmHWM), and non-finite numbers are a ConfigError, not an OverflowError."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune import safe_yaml
from kvtune.errors import ConfigError
from kvtune.router.config import load_config as load_router_config
from kvtune.verify.configs import load_config as load_verify_config

ROOT = Path(__file__).resolve().parent.parent
PEAK_LIMIT_MIB = 300
LEVELS = "abcdefghi"


def alias_bomb(key: str) -> str:
    """Nine levels of nine aliases each: 9**9 (387 million) leaves from about 380 bytes."""
    lines = [f"{key}:", f"  - &a [{','.join(['lol'] * 9)}]"]
    for prev, cur in zip(LEVELS, LEVELS[1:]):
        lines.append(f"  - &{cur} [{','.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def test_the_bomb_is_small():
    assert len(alias_bomb("kv_recompute_threshold")) < 400


CHILD = r"""
import json, sys
from kvtune.errors import KvtuneError
from kvtune.router.config import load_config as router
from kvtune.verify.configs import load_config as verify
try:
    (router if sys.argv[1] == "router" else verify)(sys.argv[2])
    out = {"error": None}
except KvtuneError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
out["peak_mib"] = int(hwm.split()[1]) / 1024
print(json.dumps(out))
"""


@pytest.mark.parametrize("which", ["verify", "router"])
def test_alias_bomb_fails_fast_with_a_clear_error(which, tmp_path):
    """Before: verify built a 351-million-character error message (1.08 GB)."""
    path = tmp_path / "bomb.yaml"
    body = alias_bomb("kv_recompute_threshold" if which == "verify" else "prefill")
    path.write_text(("mode: bidirectional\n" if which == "verify" else "") + body)
    proc = subprocess.run([sys.executable, "-c", CHILD, which, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "ConfigError"
    assert str(path) in out["message"] and "alias" in out["message"]
    assert len(out["message"]) < 1000
    assert out["peak_mib"] < PEAK_LIMIT_MIB, out


def test_recursive_alias_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="recursive"):
        safe_yaml.load("a: &x [1, *x]\n", source="f.yaml")


def test_plain_aliases_still_load():
    assert safe_yaml.load("a: &x [1, 2]\nb: *x\n", source="f") == {"a": [1, 2], "b": [1, 2]}
    assert safe_yaml.load("", source="f") is None


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400", "2.5", "-1", "[1]"])
def test_threshold_must_be_a_finite_integer(value, tmp_path):
    """Before: ``kv_recompute_threshold: .inf`` was an uncaught OverflowError."""
    path = tmp_path / "c.yaml"
    path.write_text(f"mode: bidirectional\nkv_recompute_threshold: {value}\n")
    with pytest.raises(ConfigError, match="kv_recompute_threshold.*finite integer"):
        load_verify_config(str(path))


def test_router_config_yaml_errors_are_truncated(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("prefill: [" + "x, " * 100_000 + "\n  : : bad")
    with pytest.raises(ConfigError) as err:
        load_router_config(path)
    assert str(path) in str(err.value) and len(str(err.value)) < 1000
