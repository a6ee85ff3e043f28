"""Live views for the CLI: a refreshing status table and a decision-log follower.

Both take plain callables (``fetch_status() -> dict``, ``fetch_decisions(since_seq) -> list``)
so they run without Ray in tests; ``gpubroker/cli/fleet.py`` passes closures around the broker
(``gpubroker.deployments.cluster.fleet_client.fetch_status`` / ``fetch_decisions``). The watch redraws the very
tables ``gpubroker status`` prints (``gpubroker.cli.views.fleet_view``).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpubroker.cli.views import fleet_view
from gpubroker.quotas.sizes import format_size


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _clock(t: Any) -> str:
    return "-" if t is None else _dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


def _render(status: Mapping[str, Any] | None, error: str | None, interval_s: float) -> Group | Table:
    parts: list[Any] = []
    if status is not None:
        parts.extend(fleet_view(status))
    if error:
        parts.append(Text(f"broker unreachable: {error} (retrying every {interval_s:g}s)", style="red"))
    if status is not None and status.get("last_error"):
        parts.append(Text(f"last tick error: {status['last_error']}", style="red"))
    parts.append(Text(f"refresh every {interval_s:g}s, Ctrl-C to stop", style="dim"))
    return Group(*parts)


def watch_status(
    fetch_status: Callable[[], Mapping[str, Any]],
    *,
    interval_s: float = 1.0,
    console: Console | None = None,
    iterations: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraw the status table every ``interval_s`` until Ctrl-C (or ``iterations`` refreshes). Returns refreshes."""
    console = console or Console()
    status: Mapping[str, Any] | None = None
    done = 0
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while iterations is None or done < iterations:
                error = None
                try:
                    status = fetch_status()
                except Exception as exc:  # noqa: BLE001 - keep watching; the broker may be restarting
                    error = f"{type(exc).__name__}: {exc}"
                live.update(_render(status, error, interval_s), refresh=True)
                done += 1
                if iterations is not None and done >= iterations:
                    break
                sleep(interval_s)
    except KeyboardInterrupt:
        pass
    return done


def decision_line(entry: Mapping[str, Any]) -> str:
    """One decision-log entry as one line: seq, time, kind, model, change, trigger, reason."""
    kind = entry.get("kind", "?")
    parts = [f"#{entry.get('seq', '?')}", _clock(entry.get("time_s")), f"{kind:<8}", str(entry.get("model") or "-")]
    if kind == "settings":
        old, new = entry.get("old") or {}, entry.get("new") or {}
        diff = ", ".join(f"{k} {old.get(k)}->{new.get(k)}" for k in new if old.get(k) != new.get(k))
        parts.append(diff or "no change")
        parts.append(f"[{entry.get('trigger')}={entry.get('trigger_value')}]")
    elif kind == "move":
        parts.append(
            f"{entry.get('move')} {entry.get('donor') or '-'} -> {entry.get('recipient') or '-'} "
            f"{_size(entry.get('amount_bytes'))}"
        )
    parts.append(str(entry.get("reason", "")))
    if entry.get("dry_run"):
        parts.append("(dry run)")
    return " ".join(p for p in parts if p)


def new_decisions(entries: Iterable[Mapping[str, Any]], since_seq: int) -> tuple[list[Mapping[str, Any]], int]:
    """Entries after ``since_seq`` in seq order, and the new high-water mark."""
    fresh = sorted((e for e in entries if int(e.get("seq", 0)) > since_seq), key=lambda e: int(e["seq"]))
    return fresh, (int(fresh[-1]["seq"]) if fresh else since_seq)


def follow_decisions(
    fetch_decisions: Callable[[int], Sequence[Mapping[str, Any]]],
    emit: Callable[[Mapping[str, Any]], None],
    *,
    since_seq: int = 0,
    interval_s: float = 1.0,
    iterations: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_error: Callable[[Exception], None] | None = None,
) -> int:
    """Poll ``fetch_decisions(since_seq)`` every ``interval_s`` and ``emit`` each new entry once.

    Returns the last seq seen. A broker restart that restores an older checkpoint can make the
    seq go back; entries are only emitted once per seq. Stops on Ctrl-C or after ``iterations`` polls.
    """
    seq = since_seq
    polls = 0
    try:
        while iterations is None or polls < iterations:
            try:
                fresh, seq = new_decisions(fetch_decisions(seq), seq)
                for entry in fresh:
                    emit(entry)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - keep following across broker restarts
                if on_error is not None:
                    on_error(exc)
            polls += 1
            if iterations is not None and polls >= iterations:
                break
            sleep(interval_s)
    except KeyboardInterrupt:
        pass
    return seq
