"""Record a ``make tune`` (``kvtune tune --verify``) output directory as a committed example.

    .venv/bin/python scripts/record_example.py out/tune examples/fleet

Copies what the example tests recompute from (``tests/test_lab_examples.py``): the tuning's spans
and exported configs (``tune/spans``, ``tune/configs``), the verification's result
(``verify/verify.json``) with its figures as plotly JSON (``verify/figures``), and the replayed
conversations (``verify-workload.json``). Machine paths are replaced: the output directory by
``tune``, the locally made model's directory by ``kvtune-tiny-model``. Not copied: the HTML pages
(about 5 MB each with plotly.js inline; ``kvtune.verify.page.write`` renders them again), the
executed notebooks and the verification's per-start span directories.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kvtune.errors import KvtuneError
from kvtune.local.pair import default_model_dir
from kvtune.verify import figures, results
from kvtune.verify.tune_link import VERIFY_DIR, WORKLOAD_FILE

TEXT_SUFFIXES = (".json", ".jsonl", ".md", ".args", ".yaml")


def _scrub(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


def _copy_tree(src: Path, dst: Path, replacements: dict[str, str]) -> int:
    n = 0
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in TEXT_SUFFIXES:
            target.write_text(_scrub(path.read_text(), replacements))
        else:
            shutil.copyfile(path, target)
        n += 1
    return n


def record(out: Path, dest: Path) -> list[Path]:
    """Write ``dest`` from the ``kvtune tune --verify`` directory ``out``; returns the files."""
    out, dest = out.resolve(), dest.resolve()
    result_file = out / VERIFY_DIR / results.RESULT_FILE
    for need in (out / "spans", out / "configs" / "recommendation.json", result_file,
                 out / VERIFY_DIR / WORKLOAD_FILE):
        if not need.exists():
            raise KvtuneError(f"{need}: missing; expected the output of kvtune tune --verify")
    if dest.exists():
        shutil.rmtree(dest)
    model = default_model_dir()
    repl = {str(out): "tune", str(model): "kvtune-tiny-model",
            str(model.resolve()): "kvtune-tiny-model"}
    _copy_tree(out / "spans", dest / "tune" / "spans", repl)
    _copy_tree(out / "configs", dest / "tune" / "configs", repl)
    verify = dest / VERIFY_DIR
    verify.mkdir(parents=True)
    (verify / results.RESULT_FILE).write_text(_scrub(result_file.read_text(), repl))
    (dest / "verify-workload.json").write_text((out / VERIFY_DIR / WORKLOAD_FILE).read_text())
    res = results.read(result_file)
    figs = verify / "figures"
    figs.mkdir()
    (figs / "verify--comparison.json").write_text(figures.comparison(res).to_json())
    if res.crossover is not None:
        (figs / "verify--crossover.json").write_text(figures.crossover(res.crossover).to_json())
    if res.predictions is not None:
        (figs / "verify--predictions.json").write_text(figures.predictions(res.predictions).to_json())
    return sorted(p for p in dest.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="kvtune tune --verify output directory")
    ap.add_argument("dest", type=Path, help="example directory to (re)write, e.g. examples/fleet")
    args = ap.parse_args(argv)
    try:
        files = record(args.out, args.dest)
    except KvtuneError as e:
        print(f"record_example: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in files)
    print(f"{args.dest}: {len(files)} files, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
