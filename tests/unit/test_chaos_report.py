"""tests/chaos/report.py and Faults: counts come from checks; a failed or missing row fails the report."""

from __future__ import annotations

import json

from tests.chaos import report
from tests.chaos.harness import FaultKind, Faults


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_faults_count_what_was_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    faults = Faults("t", "three refusals", FaultKind.MALFORMED_INPUT)
    faults.check("a", True)
    faults.check("b", False)
    faults.check("c", True)
    row = faults.record(sent=3, answered=0, rejected=2)
    assert (row["faults_injected"], row["faults_survived"], row["ok"]) == (3, 2, False)
    assert faults.failures() == ["b"]
    assert json.loads((tmp_path / "r.jsonl").read_text())["faults_survived"] == 2


def test_a_row_without_checks_is_no_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    assert Faults("t", "nothing checked", FaultKind.NETWORK).record()["ok"] is False


def test_report_fails_on_a_missing_row_and_passes_when_all_are_there(tmp_path):
    good = {"nodeid": "tests/x.py::a", "kind": "memory", "faults_injected": 1, "faults_survived": 1, "ok": True}
    path = tmp_path / "r.jsonl"
    _write(path, [{"expect": "tests/x.py::a"}, {"expect": "tests/x.py::b"}, good])
    assert report.main(["report", str(path)]) == 1
    _write(path, [{"expect": "tests/x.py::a"}, good])
    assert report.main(["report", str(path)]) == 0


def test_report_fails_on_a_failed_or_lossy_row(tmp_path):
    path = tmp_path / "r.jsonl"
    _write(path, [{"nodeid": "tests/x.py::a", "kind": "network", "ok": True, "lost": 1}])
    assert report.main(["report", str(path)]) == 1
    _write(path, [{"nodeid": "tests/x.py::a", "kind": "test failed", "ok": False}])
    assert report.main(["report", str(path)]) == 1
