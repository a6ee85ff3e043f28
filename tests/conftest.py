"""Chaos bookkeeping for ``make chaos``: what is expected, and a failing row for a failed test.

Every test that writes a chaos row carries ``@pytest.mark.chaos``. Under ``make chaos``
(``$GPUBROKER_CHAOS_RESULTS`` set) the collection writes one ``{"expect": nodeid}`` line per
such test that will run, and a failed one writes a row with ``ok: false``; ``tests/chaos/report.py``
then fails on any expected test without a passing row. ``make test`` writes nothing.
"""

from __future__ import annotations

import pytest

from tests.chaos.harness import recording, write_row


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: writes a chaos row (tests/chaos/harness.py Faults)")


def pytest_collection_finish(session: pytest.Session) -> None:
    if not recording():
        return
    for item in session.items:
        if item.get_closest_marker("chaos") is not None:
            write_row({"expect": item.nodeid})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201 - a hook wrapper
    outcome = yield
    rep = outcome.get_result()
    if not recording() or item.get_closest_marker("chaos") is None or not rep.failed:
        return
    write_row(
        {
            "test": item.nodeid.split("::")[0],
            "nodeid": item.nodeid,
            "fault": f"test failed in {rep.when}",
            "kind": "test failed",
            "faults_injected": 0,
            "faults_survived": 0,
            "figure": (rep.longreprtext or "").strip().splitlines()[-1][:200] if rep.longreprtext else "",
            "ok": False,
        }
    )
