"""kvtune.export.write with --force: it replaces only a previous export, and a failed replacement
leaves the previous export where it was."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from test_export import EXPECTED_FILES, _tuning

from kvtune.cli import main
from kvtune.errors import ConfigError
from kvtune.export import write


def _threshold(d) -> int:
    return json.loads((d / "recommendation.json").read_text())["written"]["kv_recompute_threshold"]


def test_force_refuses_a_directory_that_is_not_an_export(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / "recommendation.json").write_text('{"not": "kvtune"}')  # a marker by another tool
    with pytest.raises(ConfigError, match="not a previous export.*even with --force"):
        write(_tuning(), home, model="m", overwrite=True)
    assert sorted(os.listdir(home)) == ["recommendation.json", "thesis.tex"]
    assert sorted(os.listdir(tmp_path)) == ["home"]  # no temporary directory left behind


def test_force_refuses_a_directory_holding_a_copied_recommendation(tmp_path):
    """Before: a directory that merely held a copy of a real export's recommendation.json (the
    user's notes beside it) was replaced whole with --force."""
    prev = write(_tuning(threshold=300), tmp_path / "prev", model="m")
    notes = tmp_path / "notes"
    notes.mkdir()
    shutil.copy(prev / "recommendation.json", notes / "recommendation.json")
    (notes / "analysis.md").write_text("keep me")
    with pytest.raises(ConfigError, match=r"no \.kvtune-export marker.*even with --force"):
        write(_tuning(threshold=301), notes, model="m", overwrite=True)
    assert sorted(os.listdir(notes)) == ["analysis.md", "recommendation.json"]
    (notes / ".kvtune-export").symlink_to(prev / ".kvtune-export")  # a linked marker: no either
    with pytest.raises(ConfigError, match="not a previous export"):
        write(_tuning(threshold=301), notes, model="m", overwrite=True)
    assert (notes / "analysis.md").read_text() == "keep me"


def test_force_refuses_files_and_links(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    with pytest.raises(ConfigError, match="not a directory"):
        write(_tuning(), f, model="m", overwrite=True)
    prev = write(_tuning(), tmp_path / "prev", model="m")
    link = tmp_path / "link"
    link.symlink_to(prev)
    with pytest.raises(ConfigError, match="not a directory"):
        write(_tuning(), link, model="m", overwrite=True)
    assert f.read_text() == "keep" and link.is_symlink() and _threshold(prev) == 300


def test_cli_force_on_a_non_export_is_a_clear_error(tmp_path, capsys):
    """``kvtune recommend --force`` on a plain directory, through the real pipeline: an error line,
    no traceback, nothing deleted."""
    from kvtune import spans as sc
    from kvtune.testing import synthetic as syn

    trace = tmp_path / "spans.jsonl"
    syn.write_otlp_json(syn.SyntheticCase(workload=syn.SyntheticWorkload(n_conversations=20)).spans(
        mode=sc.Mode.BIDIRECTIONAL, seed=3), trace)
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.py").write_text("print('hi')")
    code = main(["recommend", str(trace), "--out", str(src), "--force"],
                (("recommend", "kvtune.recommend.cli"),))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "not a previous export" in err
    assert sorted(os.listdir(src)) == ["main.py"]


def test_failed_second_rename_restores_the_previous_export(tmp_path, monkeypatch):
    """Fault injection (a fake: the rename of the new directory into place is made to fail, which
    a real disk does only rarely): the previous export comes back, nothing is left hidden."""
    out = write(_tuning(threshold=300), tmp_path / "out", model="m")
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(str(src)).startswith(".out.tmp-"):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(ConfigError, match="cannot write.*No space left"):
        write(_tuning(threshold=301), out, model="m", overwrite=True)
    monkeypatch.undo()
    assert _threshold(out) == 300 and sorted(os.listdir(out)) == sorted(EXPECTED_FILES)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no hidden .out.old-*/.out.tmp-* folders


def test_a_writer_racing_into_the_output_keeps_the_previous_export_findable(tmp_path):
    """A real fault: between the two renames another process creates the output directory (with
    a file), so neither the new export nor the old one can take the name; the error says where
    the previous export was kept, and it is intact there."""
    out = write(_tuning(threshold=300), tmp_path / "out", model="m")

    def racer(path):
        path.mkdir()
        (path / "other.txt").write_text("theirs")

    with pytest.raises(ConfigError, match="kept in") as info:
        write(_tuning(threshold=301), out, model="m", overwrite=True, _between_renames=racer)
    kept = tmp_path / str(info.value).rsplit("kept in ", 1)[1].split("/")[-2] / "dir"
    assert _threshold(kept) == 300 and (out / "other.txt").read_text() == "theirs"
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the new one is cleaned up


def test_force_replaces_a_previous_export_whole(tmp_path):
    out = write(_tuning(threshold=300), tmp_path / "out", model="m")
    (out / "stale.txt").write_text("old")
    write(_tuning(threshold=301), out, model="m", overwrite=True)
    assert _threshold(out) == 301 and sorted(os.listdir(out)) == sorted(EXPECTED_FILES)
    assert sorted(os.listdir(tmp_path)) == ["out"]
