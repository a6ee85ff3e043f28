"""``python -m bench.tick_instructions``: its arithmetic and its refusals (callgrind itself is
not run here: one count takes about 100 s; docs/BENCHMARKS.md has its measured runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.tick_instructions as ti

ROOT = Path(__file__).resolve().parents[2]


def test_per_tick_is_ticks_minus_reports_and_reports_are_over_the_warmup(monkeypatch):
    counts = {(0.0, "ticks"): 1_000, (20.0, "ticks"): 9_000, (20.0, "reports"): 5_000}
    monkeypatch.setattr(ti, "_count", lambda tree, cards, models, seconds, mode: counts[(seconds, mode)])
    res = ti.measure(ROOT, cards=2, models=4, seconds=20.0, say=lambda _m: None)
    assert res["per_tick"] == (9_000 - 5_000) // 20  # 20 ticks at a 1-s control interval
    assert res["per_report_round"] == (5_000 - 1_000) // 40  # 40 rounds at a 0.5-s report interval


def test_without_valgrind_it_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(ti.shutil, "which", lambda _name: None)
    assert ti.main(["--tree", str(ROOT)]) == 2
    assert "apt-get install valgrind" in capsys.readouterr().err


def test_a_tree_that_is_not_a_checkout_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ti.shutil, "which", lambda _name: "/usr/bin/valgrind")
    with pytest.raises(SystemExit):
        ti.main(["--tree", str(tmp_path)])
    assert "not a gpubroker checkout" in capsys.readouterr().err


def test_a_failed_run_names_its_mode_and_shows_valgrinds_last_lines(monkeypatch):
    class Done:
        returncode, stderr = 1, "==1== some valgrind complaint\n"

    monkeypatch.setattr(ti.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(RuntimeError, match=r"(?s)callgrind run \(reports, 20 s\).*some valgrind complaint"):
        ti._count(ROOT, 2, 4, 20.0, "reports")


def test_its_interval_defaults_are_bench_scales():
    import inspect

    from bench import scale

    params = inspect.signature(ti.measure).parameters
    assert params["control_interval_s"].default == scale.CONTROL_INTERVAL_S
    assert params["report_interval_s"].default == scale.REPORT_INTERVAL_S
