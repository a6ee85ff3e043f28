"""Print the chaos table from the results file the reliability tests write (``make chaos``).

    python tests/chaos/report.py [RESULTS.jsonl]

Rows come from ``tests/chaos/harness.py``: injected and survived are counted from what each test
observed, its requests by ``tests/chaos/tally.py``: sent = answered + refused (by status) + lost
(by cause), every request the test sent included. The table is split by kind of fault (malformed
input, bad config, overload, process or node killed, broker restarted, network, memory) so that no
kind hides another. A test the collection expected (``@pytest.mark.chaos``) that wrote no row, or
a failing row, fails the report; so does a row whose requests do not add up (its totals against
each other and against its counts by status), and a row counted under an older definition
(no per-status counts: recount it with ``make chaos``).

Exit 1 when any row failed, lost a request, does not add up, or is missing; 0 otherwise (2: no results).
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.chaos.harness import results_path  # noqa: E402
from tests.chaos.tally import CountError, check_row  # noqa: E402

COUNTS = ("faults_injected", "faults_survived", "sent", "answered", "refused", "lost")


def load(path: Path) -> tuple[list[dict], list[str]]:
    """(rows, expected node ids) from the JSON lines; unreadable lines are skipped."""
    rows: list[dict] = []
    expected: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "expect" in obj:
            expected.append(str(obj["expect"]))
        elif isinstance(obj, dict):
            rows.append(obj)
    return rows, expected


def missing_rows(rows: list[dict], expected: list[str]) -> list[dict]:
    """A failing row for each expected test that wrote none."""
    seen = {r.get("nodeid") for r in rows}
    return [
        {"test": e.split("::")[0], "nodeid": e, "fault": "no row written", "kind": "missing", "ok": False}
        for e in dict.fromkeys(expected)
        if e not in seen
    ]


def _n(row: dict, key: str) -> int:
    return int(row.get(key, 0) or 0)


def problems(row: dict) -> list[str]:
    """Why a row fails the report: its test failed, it lost requests, or its count does not add up."""
    out = [] if row.get("ok") else [f"not ok {row.get('failed_checks') or ''}".rstrip()]
    if _n(row, "lost"):
        out.append(f"lost {_n(row, 'lost')}: {row.get('lost_by') or 'causes not kept'}")
    if row.get("kind") not in ("missing", "test failed"):  # those wrote no counts: failing already
        try:
            check_row(row)
        except CountError as exc:
            out.append(f"count: {exc}")
    return out


def row_ok(row: dict) -> bool:
    return not problems(row)


def by_status(row: dict) -> str:
    """``refused 503 shed:3, 422 bad input:2; lost client timeout:1`` (answered: the 'answered' column)."""
    parts = []
    for key in ("refused", "lost"):
        counts = row.get(f"{key}_by") or {}
        if counts:
            parts.append(f"{key} " + ", ".join(f"{k}:{v}" for k, v in counts.items()))
    return "; ".join(parts)


def table(rows: list[dict]) -> Table:
    t = Table(title="gpubroker chaos: faults by kind, survived as observed; requests sent = answered + refused + lost")
    for col in (
        "kind",
        "test",
        "fault",
        "injected",
        "survived",
        "sent",
        "answered",
        "refused",
        "lost",
        "by status",
        "figure",
        "ok",
    ):
        t.add_column(
            col, justify="right" if col in COUNTS or col in ("injected", "survived") else "left", overflow="fold"
        )
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_kind[str(r.get("kind", "unknown"))].append(r)
    for kind in sorted(by_kind):
        for r in by_kind[kind]:
            t.add_row(
                kind,
                str(r.get("nodeid") or r.get("test", "")),
                str(r.get("fault", "")),
                *(str(_n(r, k)) for k in COUNTS),
                by_status(r),
                str(r.get("figure", "")),
                "[green]yes[/]" if row_ok(r) else "[red]NO[/]",
            )
        _total_row(t, f"{kind}: total", by_kind[kind])
        t.add_section()
    _total_row(t, "ALL", rows)
    return t


def _total_row(t: Table, label: str, rows: list[dict]) -> None:
    merged: dict[str, Counter] = {f"{k}_by": Counter() for k in ("refused", "lost")}
    for r in rows:
        for key, counts in merged.items():
            counts.update(r.get(key) or {})
    t.add_row(
        label,
        f"{len(rows)} row(s)",
        "",
        *(str(sum(_n(r, k) for r in rows)) for k in COUNTS),
        by_status({k: dict(sorted(v.items())) for k, v in merged.items()}),
        "",
        "[green]yes[/]" if all(row_ok(r) for r in rows) else "[red]NO[/]",
    )


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else results_path()
    console = Console(width=220)
    if not path.exists():
        console.print(f"no chaos results at {path}; run `make chaos`")
        return 2
    rows, expected = load(path)
    rows += missing_rows(rows, expected)
    console.print(table(rows))
    bad = [r for r in rows if not row_ok(r)]
    for r in bad:
        console.print(f"[red]failed[/]: {r.get('nodeid') or r.get('test')}: {r.get('fault')}: {'; '.join(problems(r))}")
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
