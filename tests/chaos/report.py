"""Print the chaos table from the results file the reliability tests write (``make chaos``).

    python tests/chaos/report.py [RESULTS.jsonl]

Rows come from ``tests/chaos/harness.py``: injected and survived are counted from what each test
observed. The table is split by kind of fault (malformed input, bad config, overload, process or
node killed, broker restarted, network, memory) so that no kind hides another. A test the
collection expected (``@pytest.mark.chaos``) that wrote no row, or a failing row, fails the report.

Exit 1 when any row failed, lost a request, or is missing; 0 otherwise (2: no results).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.chaos.harness import results_path  # noqa: E402

COUNTS = ("faults_injected", "faults_survived", "sent", "answered", "rejected", "lost")


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


def row_ok(row: dict) -> bool:
    return bool(row.get("ok")) and not _n(row, "lost")


def table(rows: list[dict]) -> Table:
    t = Table(title="gpubroker chaos: faults by kind, survived as observed; requests sent, answered, rejected, lost")
    for col in (
        "kind",
        "test",
        "fault",
        "injected",
        "survived",
        "sent",
        "answered",
        "rejected",
        "lost",
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
                str(r.get("figure", "")),
                "[green]yes[/]" if row_ok(r) else "[red]NO[/]",
            )
        _total_row(t, f"{kind}: total", by_kind[kind])
        t.add_section()
    _total_row(t, "ALL", rows)
    return t


def _total_row(t: Table, label: str, rows: list[dict]) -> None:
    t.add_row(
        label,
        f"{len(rows)} row(s)",
        "",
        *(str(sum(_n(r, k) for r in rows)) for k in COUNTS),
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
        console.print(
            f"[red]failed[/]: {r.get('nodeid') or r.get('test')}: {r.get('fault')} {r.get('failed_checks', '')}"
        )
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
