"""``python -m bench report`` reads the results directory it is given, and nothing else; the
command refuses a ``--out`` it would not read (``make bench`` passed one, issue 39)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from bench import results
from bench.cli import app as bench_app

ROOT = Path(__file__).resolve().parents[2]


def _results_dir(tmp: Path, gain: float) -> Path:
    """A results tree with only the a=20 knee file, its headline gain set to ``gain``."""
    doc = json.loads((ROOT / "bench/results/sim/knee-a20.json").read_text(encoding="utf-8"))
    doc["gain"] = gain
    (tmp / "res/sim").mkdir(parents=True)
    (tmp / "res/sim/knee-a20.json").write_text(json.dumps(doc), encoding="utf-8")
    return tmp / "res"


def test_the_report_written_from_a_directory_reads_that_directory(tmp_path):
    root = _results_dir(tmp_path, gain=7.4)
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    results.write(root, results_md=tmp_path / "RESULTS.md", readme=readme)
    text = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "| **7.40×** |" in text  # the gain of the file in the directory given
    assert "Where memory binds" not in text  # the committed lending.json is not read
    table = readme.read_text(encoding="utf-8").split(results.README_BEGIN, 1)[1]
    assert "| 7.4× (" in table and "lending" not in table.split(results.README_END, 1)[0]


def test_report_refuses_an_out_it_would_not_read(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = (ROOT / "bench/RESULTS.md").read_text(encoding="utf-8")
    res = CliRunner().invoke(bench_app, ["report", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "--out" in res.output and "bench/results/" in res.output and "drop --out" in res.output
    assert (ROOT / "bench/RESULTS.md").read_text(encoding="utf-8") == before
    assert not any(tmp_path.iterdir())
