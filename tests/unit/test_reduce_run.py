"""``bench.reduce_run``: a run's traces become summaries, its aggregates stay as they were."""

from __future__ import annotations

import json

from bench import reduce_run


def _run() -> dict:
    tick = {"a": {"kv_blocks": 8, "max_num_seqs": 8}, "b": {"kv_blocks": 8, "max_num_seqs": 8}}
    grown = {"a": {"kv_blocks": 18, "max_num_seqs": 18}, "b": {"kv_blocks": 3, "max_num_seqs": 3}}
    arm = {
        "arm": "broker",
        "goodput_rps": 98.5,
        "attainment": 0.55,
        "ttft_p95_ms": 1900.0,
        "bounds_trace": [tick, grown, tick],
        "quota_moves": [{"move": "lend"}, {"move": "lend"}, {"move": "reclaim"}],
    }
    series = {"alpha": {"t_s": [0.0, 1.0, 2.0], "grant_bytes": [None, 64, 120]}}
    return {"kv_bound": {"runs": [{"arms": [arm]}]}, "burst": {"series": series}, "code": {"commit": "abc"}}


def test_traces_become_spans_and_counts_and_the_aggregates_stay():
    out = reduce_run.reduce_run(_run(), "run.json", command="cmd --out x", commit=None)
    arm = out["kv_bound"]["runs"][0]["arms"][0]
    assert "bounds_trace" not in arm and "quota_moves" not in arm
    assert arm["bounds_summary"]["ticks"] == 3
    assert arm["bounds_summary"]["engines"]["a"]["kv_blocks"] == [8, 18]
    assert arm["bounds_summary"]["engines"]["b"]["max_num_seqs"] == [3, 8]
    assert arm["quota_moves_by_kind"] == {"lend": 2, "reclaim": 1}
    assert (arm["goodput_rps"], arm["attainment"], arm["ttft_p95_ms"]) == (98.5, 0.55, 1900.0)
    assert out["burst"]["series_summary"] == {"alpha": {"samples": 3, "grant_bytes": [64, 120]}}
    assert out["reduced"]["traces_summarised"] == ["bounds_trace", "quota_moves", "series"]


def test_command_and_commit_are_filled_only_where_the_run_lacks_them():
    out = reduce_run.reduce_run(_run(), "run.json", command="cmd", commit="def")
    assert out["command"] == "cmd" and out["code"]["commit"] == "abc"
    assert out["reduced"]["recorded_at_reduction"] == ["command"]


def test_reducing_twice_changes_nothing(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run()))
    reduce_run.main([str(path), "--command", "cmd"])
    once = path.read_text()
    reduce_run.main([str(path)])
    assert path.read_text() == once
    assert json.loads(once)["reduced"]["recorded_at_reduction"] == ["command"]
