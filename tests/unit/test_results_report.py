"""Every figure from a command: bench/RESULTS.md and the README's results table, as committed, are
what ``python -m bench report`` (``bench.results``) writes from the JSON committed under bench/results/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import results

ROOT = Path(__file__).resolve().parents[2]


def test_results_md_as_committed_is_what_the_report_writes(monkeypatch):
    monkeypatch.chdir(ROOT)
    committed = (ROOT / "bench/RESULTS.md").read_text(encoding="utf-8")
    assert committed == results.build(), "bench/RESULTS.md differs: run `python -m bench report` and commit it"


def test_readme_table_as_committed_is_what_the_report_writes(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert results.glance() in readme, "README.md's results table differs: run `python -m bench report`"
    assert results.with_glance(readme, results.glance()) == readme


def test_a_figure_without_its_file_is_not_reported(tmp_path):
    (tmp_path / "sim").mkdir()
    shutil.copy(ROOT / "bench/results/sim/knee-a20.json", tmp_path / "sim/knee-a20.json")
    text = results.build(tmp_path)
    assert "## Knee gain and the oracle" in text and "bench/results/sim/knee-a20.json" in text
    assert "Where memory binds" not in text and "Live stack" not in text
    assert "lending" not in results.glance(tmp_path)


def test_the_headline_is_the_gain_at_one_cap_and_names_the_variant(tmp_path):
    doc = json.loads((ROOT / "bench/results/sim/knee-a20.json").read_text(encoding="utf-8"))
    doc.update(gain=2.0, gain_vs_static8_at_S=3.0)
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim/knee-a20.json").write_text(json.dumps(doc))
    assert "| **2.00×** |" in results.build(tmp_path)
    assert "knee gain a=20 c=0.5 (1.2·S vs S) | 2.0× (3.0×) |" in results.glance(tmp_path)


def test_the_readme_needs_its_markers():
    with pytest.raises(ValueError, match="results:begin"):
        results.with_glance("# a README without the block\n", "table")


def test_the_one_rule_live_runs_are_reported_with_their_ingress_and_rule(tmp_path):
    name = "seed-profiled-direct.json"
    doc = json.loads((ROOT / f"bench/results/{results.LIVE_ONE_RULE}/{name}").read_text(encoding="utf-8"))
    doc["results"][0].update(gain=4.0, broker_vs_bentoml=0.5)
    doc["results"][0]["bentoml"]["knee_rps"] = None  # no rate held on every seed
    (tmp_path / results.LIVE_ONE_RULE).mkdir()
    (tmp_path / results.LIVE_ONE_RULE / name).write_text(json.dumps(doc))
    text = results.build(tmp_path)
    assert "## Live stack under one rule" in text
    row = next(line for line in text.splitlines() if line.startswith("| profiled"))
    assert "| direct |" in row and "| **4.00×** |" in row and "| – |" in row and row.endswith("| 0.50 |")
    assert "no arm sheds" in text and "every seed of [0, 1, 2]" in text
    assert f"bench/results/{results.LIVE_ONE_RULE}/{name}" in text


def _burst_doc(peak_mib: int) -> dict:
    arm = {
        "summary": {n: {"attainment": 0.9} for n in ("alpha", "beta", "gamma")},
        "in_burst": {n: {"attainment": 0.8} for n in ("alpha", "beta", "gamma")},
        "batch": {n: {"mean_batch": 3.0} for n in ("alpha", "beta", "gamma")},
        "peak_used_bytes": {"alpha": peak_mib * 2**20, "beta": 20 * 2**20, "gamma": 20 * 2**20},
        "series": {"alpha": {"grant_bytes": [None, 64 * 2**20, 120 * 2**20]}},
        "ooms": {n: 0 for n in ("alpha", "beta", "gamma")},
    }
    return {
        "models": ["alpha", "beta", "gamma"],
        "a_ms": 300.0,
        "c_ms": 5.0,
        "cap_ms": 1200.0,
        "base_rate_rps": 2.0,
        "burst": {"start_s": 50.0, "length_s": 60.0, "factor": 5.0},
        "capacity": "192MiB",
        "quota_base_bytes": 64 * 2**20,
        "arms": {"broker": arm, "static-split": arm},
        "command": "python -m bench burst --out x",
        "code": {"commit": "abc1234", "dirty_paths": []},
    }


@pytest.mark.parametrize(
    ("peak", "won"),
    [(60, "won within its base, by batch control"), (67, "won within its base"), (150, "borrowed memory carried part")],
)
def test_the_live_burst_says_whether_borrowed_memory_won_it(tmp_path, peak, won):
    """The burst headline credited borrowed memory where the busy model peaked under its base; a peak
    within 5% of base (status samples once a second) is not counted as borrowed."""
    (tmp_path / results.LIVE_BURST).mkdir()
    (tmp_path / results.LIVE_BURST / "burst.json").write_text(json.dumps(_burst_doc(peak)))
    text = results.build(tmp_path)
    assert "## Live stack: one model bursting" in text and "| broker | alpha | 0.900 | 0.800 |" in text
    assert f"`alpha` peaked at {peak}.0 MiB against its base of 64.0 MiB (grant up to 120.0 MiB): " in text
    assert won in text and "mean batch 3.0 under the broker against 3.0 under the static split" in text
    assert "| live burst: attainment in it, broker / static | 0.80 / 0.80 |" in results.glance(tmp_path)
    assert (
        f"bench/results/{results.LIVE_BURST}/burst.json`, written by `python -m bench burst --out x` on commit abc1234"
        in text
    )
