"""tests/chaos/report.py and Faults: counts come from checks and a Tally; a failed or missing row,
one that lost a request, or one whose requests do not add up fails the report."""

from __future__ import annotations

import json

import pytest

from tests.chaos import report
from tests.chaos.harness import FaultKind, Faults, observation
from tests.chaos.tally import CountError, Tally


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_faults_count_what_was_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    faults = Faults("t", "three refusals", FaultKind.MALFORMED_INPUT)
    faults.check("a", True)
    faults.check("b", False)
    faults.check("c", True)
    row = faults.record(Tally.of([422, 422, 413], sent=3))
    assert (row["faults_injected"], row["faults_survived"], row["ok"]) == (3, 2, False)
    assert (row["sent"], row["answered"], row["refused"], row["lost"]) == (3, 0, 3, 0)
    assert row["refused_by"] == {"413 bad input": 1, "422 bad input": 2}
    assert faults.failures() == ["b"]
    assert json.loads((tmp_path / "r.jsonl").read_text())["faults_survived"] == 2


def test_a_row_without_checks_is_no_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    assert Faults("t", "nothing checked", FaultKind.NETWORK).record(Tally())["ok"] is False


def test_a_row_that_sends_nothing_says_0_sent_and_a_lost_request_fails_it(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    faults = Faults("t", "a check", FaultKind.BAD_CONFIG)
    faults.check("a", True)
    row = faults.record(Tally())
    assert row["ok"] and (row["sent"], row["lost"], row["lost_by"]) == (0, 0, {})
    assert observation("t", "listeners", ok=True)["sent"] == 0
    lossy = faults.record(Tally.of([200, TimeoutError()], sent=2))
    assert lossy["ok"] is False and lossy["lost_by"] == {"client timeout": 1}


def test_record_refuses_a_tally_that_does_not_add_up(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_CHAOS_RESULTS", str(tmp_path / "r.jsonl"))
    faults = Faults("t", "one sent, two counted", FaultKind.OVERLOAD)
    faults.check("a", True)
    with pytest.raises(CountError, match="t: one sent, two counted: sent 1 != answered 2"):
        faults.record(Tally.of([200, 200], sent=1))
    assert not (tmp_path / "r.jsonl").exists()  # nothing written


GOOD = {
    "nodeid": "tests/x.py::a",
    "kind": "memory",
    "faults_injected": 1,
    "faults_survived": 1,
    "ok": True,
    **Tally.of([200, {"status": 503, "detail": "queue is full; retry later"}], sent=2).to_row(),
}


def test_report_fails_on_a_missing_row_and_passes_when_all_are_there(tmp_path):
    good = GOOD
    path = tmp_path / "r.jsonl"
    _write(path, [{"expect": "tests/x.py::a"}, {"expect": "tests/x.py::b"}, good])
    assert report.main(["report", str(path)]) == 1
    _write(path, [{"expect": "tests/x.py::a"}, good])
    assert report.main(["report", str(path)]) == 0


def test_report_fails_on_a_failed_or_lossy_row(tmp_path):
    path = tmp_path / "r.jsonl"
    _write(path, [{**GOOD, **Tally.of([200, TimeoutError()], sent=2).to_row()}])
    assert report.main(["report", str(path)]) == 1
    _write(path, [{"nodeid": "tests/x.py::a", "kind": "test failed", "ok": False}])
    assert report.main(["report", str(path)]) == 1


@pytest.mark.parametrize(
    "broken",
    [
        {"sent": 3},  # one sent and never counted
        {"answered": 2},  # the totals do not add up to sent
        {"refused_by": {}},  # a total its counts by status do not give
    ],
    ids=["sent", "total", "by status"],
)
def test_report_fails_when_a_rows_requests_do_not_add_up(tmp_path, broken, capsys):
    path = tmp_path / "r.jsonl"
    _write(path, [{"expect": "tests/x.py::a"}, GOOD])
    assert report.main(["report", str(path)]) == 0
    _write(path, [{"expect": "tests/x.py::a"}, {**GOOD, **broken}])
    assert report.main(["report", str(path)]) == 1
    assert "count:" in capsys.readouterr().out


def test_report_fails_on_a_row_counted_under_the_old_definition(tmp_path, capsys):
    old = {k: v for k, v in GOOD.items() if not k.endswith("_by") and k not in ("counting", "refused")}
    path = tmp_path / "r.jsonl"
    _write(path, [{"expect": "tests/x.py::a"}, {**old, "rejected": 1}])
    assert report.main(["report", str(path)]) == 1
    assert "recount it with `make chaos`" in capsys.readouterr().out.replace("\n", "")
