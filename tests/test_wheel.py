"""The built wheel, installed into a fresh virtual environment (no editable install, no source tree
on the path, run from an empty directory), runs `kvtune tune --traces <fixture>` to a report: the
notebooks and everything else `kvtune tune` needs ship in the package.

Third-party dependencies come from this interpreter's site-packages through a path line in the
fresh environment's ``.pth`` file (a plain path: the ``.pth`` files there, among them the editable
install's ``__editable__.kvtune-0.1.0.pth``, are not run), so nothing is downloaded.

The fixture ``tests/fixtures/spans/tune_small.jsonl`` was written with ``kvtune.testing.synthetic``:
``probe_spans(iterations=5, descriptor_bytes=(None,), seed=0)`` plus
``serving_spans(SyntheticWorkload(n_conversations=6), mode="bidirectional", seed=1)``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "spans" / "tune_small.jsonl"


def _tracked_tree(dest: Path) -> Path:
    """Copy the files git tracks (and new, not ignored ones) to ``dest``: the build's temporary
    files (build/, *.egg-info) land there, not in the checkout."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        rel = Path(os.fsdecode(raw))
        src = ROOT / rel
        if not src.is_file() or rel.parts[0] in ("tests", "bench", "examples", "dashboards"):
            continue  # deleted in the work tree, or not part of the package build
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
           and not k.startswith("KVTUNE_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from this tree installed (no dependencies): its bin/."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know which files the package is built from")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _tracked_tree(tmp / "src")
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(src)], check=True, cwd=tmp,
                   env=_clean_env(), timeout=300)
    wheels = list(dist.glob("kvtune-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True,
                               env=_clean_env()).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # Plain path lines: Python adds them to sys.path after the venv's own site-packages and does
    # not run the .pth files found there (so not the editable install's finder).
    (site / "kvtune-test-deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                    "--no-index", "-q", str(wheels[0])], check=True, cwd=tmp, env=_clean_env(),
                   timeout=300)
    return env_dir


def test_wheel_in_a_fresh_venv_runs_kvtune_tune_to_a_report(installed, tmp_path):
    env_dir = installed
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "import json, sys, kvtune, kvtune.notebooks as n;"
                            "print(json.dumps([kvtune.__file__, str(n.NOTEBOOKS_DIR), sys.path,"
                            "sorted(sys.modules)]))"],
                           capture_output=True, text=True, check=True, cwd=tmp_path,
                           env=_clean_env())
    kvtune_file, notebooks_dir, path, modules = json.loads(where.stdout)
    assert Path(kvtune_file).resolve().is_relative_to(env_dir.resolve()), kvtune_file
    assert Path(notebooks_dir).resolve().is_relative_to(env_dir.resolve())
    assert (Path(notebooks_dir) / "tune.ipynb").exists()
    assert not any(m.startswith("__editable__") for m in modules), "editable finder imported"
    assert str(ROOT) not in path and "" not in path[1:], path

    out = tmp_path / "out"
    proc = subprocess.run([str(env_dir / "bin" / "kvtune"), "tune", "--traces", str(FIXTURE),
                           "--out", str(out)], capture_output=True, text=True, cwd=tmp_path,
                          env=_clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "report.html").stat().st_size > 10_000
    rec = json.loads((out / "configs" / "recommendation.json").read_text())
    assert rec["trace_source_kind"] == "user"
    assert "kv_recompute_threshold" in proc.stdout
    for name in ("fabric_floor", "recompute_threshold", "block_ttl", "mode_choice", "stalls",
                 "tune"):
        assert (out / "notebooks" / f"{name}.ipynb").exists(), name
