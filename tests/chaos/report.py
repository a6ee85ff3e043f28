"""Print the chaos table from the results file the reliability tests write (``make chaos``).

    python tests/chaos/report.py [RESULTS.jsonl]

Exit 1 when any row lost a request or failed; 0 otherwise (2: no results).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.chaos.harness import results_path  # noqa: E402


def load(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def table(rows: list[dict]) -> Table:
    t = Table(title="gpubroker chaos: faults injected and survived; requests sent, answered, rejected, lost")
    for col in ("test", "fault", "injected", "survived", "sent", "answered", "rejected", "lost", "figure", "ok"):
        t.add_column(col, justify="left" if col in ("test", "fault", "figure") else "right", overflow="fold")
    tot = {k: 0 for k in ("faults_injected", "faults_survived", "sent", "answered", "rejected", "lost")}
    for r in rows:
        for k in tot:
            tot[k] += int(r.get(k, 0) or 0)
        lost = int(r.get("lost", 0) or 0)
        t.add_row(
            str(r.get("test", "")),
            str(r.get("fault", "")),
            str(r.get("faults_injected", 0)),
            str(r.get("faults_survived", 0)),
            str(r.get("sent", 0)),
            str(r.get("answered", 0)),
            str(r.get("rejected", 0)),
            f"[red]{lost}[/]" if lost else "0",
            str(r.get("figure", "")),
            "[green]yes[/]" if r.get("ok") else "[red]NO[/]",
        )
    t.add_section()
    t.add_row(
        "TOTAL",
        f"{len(rows)} scenario(s)",
        str(tot["faults_injected"]),
        str(tot["faults_survived"]),
        str(tot["sent"]),
        str(tot["answered"]),
        str(tot["rejected"]),
        f"[red]{tot['lost']}[/]" if tot["lost"] else "[green]0[/]",
        "",
        "[green]yes[/]" if all(r.get("ok") for r in rows) else "[red]NO[/]",
    )
    return t


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else results_path()
    console = Console(width=200)
    if not path.exists():
        console.print(f"no chaos results at {path}; run `make chaos`")
        return 2
    rows = load(path)
    console.print(table(rows))
    bad = [r for r in rows if r.get("lost") or not r.get("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
