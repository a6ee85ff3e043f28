"""Live views for the CLI: a refreshing status table and a decision-log follower.

Both take plain callables (``fetch_status() -> dict``, ``fetch_decisions(since_seq) -> list``)
so they run without Ray in tests; ``gpubroker/cli/fleet.py`` passes closures around the broker
(``gpubroker.deployments.fleet_client.fetch_status`` / ``fetch_decisions``). ``status_table`` takes a
``BrokerCore.status()`` dict (see broker/core.py).
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

from gpubroker.quotas.sizes import format_size


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _ms(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0f}"


def _frac(value: Any) -> str:
    return "-" if value is None else f"{100.0 * float(value):.0f}%"


def _clock(t: Any) -> str:
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


def status_table(status: Mapping[str, Any], *, title: str | None = None) -> Table:
    """One row per model: grant/used vs base, batch cap and wait, queue, latency against the SLO, cost."""
    cap = status.get("capacity_bytes")
    head = (
        f"config {status.get('config_hash', '?')}  profile {status.get('profile', '?')} "
        f"({status.get('price_per_gpu_hour', 0):g}/GPU-h)  device {status.get('device', '?')}  "
        f"granted {_size(status.get('granted_bytes'))} / usable {_size(status.get('usable_bytes'))} "
        f"/ capacity {_size(cap)}  free {_frac(status.get('free_frac'))}  "
        f"ticks {status.get('ticks', 0)} (last {_clock(status.get('last_tick_s'))})"
    )
    if status.get("dry_run"):
        head += "  [DRY RUN]"
    table = Table(title=title, caption=head, caption_justify="left", expand=False)
    for col, justify in (
        ("model", "left"),
        ("grant / base", "right"),
        ("used", "right"),
        ("batch", "right"),
        ("wait ms", "right"),
        ("queue", "right"),
        ("P50/P95/P99 ms", "right"),
        ("SLO ms", "right"),
        ("attain", "right"),
        ("rps", "right"),
        ("cost/1k", "right"),
        ("repl", "right"),
        ("ver", "right"),
        ("enforce", "left"),
        ("flags", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, m in sorted(status.get("models", {}).items()):
        p95, slo = m.get("p95_ms"), m.get("slo_p95_ms")
        p95_style = "red" if p95 is not None and slo is not None and p95 > slo else ""
        lat = Text.assemble(f"{_ms(m.get('p50_ms'))}/", (_ms(p95), p95_style), f"/{_ms(m.get('p99_ms'))}")
        grant, base = m.get("grant_bytes"), m.get("base_bytes")
        grant_style = (
            "cyan"
            if grant is not None and base is not None and grant > base
            else ("yellow" if grant is not None and base is not None and grant < base else "")
        )
        flags = []
        if not m.get("admit", True):
            flags.append("[red]paused[/]")
        if not m.get("calibrated", True):
            flags.append("uncalibrated")
        if m.get("emergency_shrinks"):
            flags.append(f"emerg {m['emergency_shrinks']}")
        if m.get("oom_splits"):
            flags.append(f"oom {m['oom_splits']}")
        cost = m.get("cost_per_1k_requests")
        unit = m.get("batch_unit") or m.get("cost_unit") or "requests"
        table.add_row(
            name,
            Text.assemble((_size(grant), grant_style), f" / {_size(base)}"),
            _size(m.get("used_bytes")),
            f"{m.get('max_batch_size', '-')}" + (" tok" if unit == "tokens" else ""),
            _ms(None if m.get("batch_wait_timeout_s") is None else 1000.0 * m["batch_wait_timeout_s"]),
            f"{m.get('queue_depth', 0):g}",
            lat,
            _ms(slo),
            _frac(m.get("attainment")),
            f"{m.get('arrival_rate_rps', 0.0):.1f}",
            "-" if cost is None else f"{cost:.4f}",
            str(m.get("replicas", "-")),
            str(m.get("settings_version", "-")),
            m.get("enforcement") or "-",  # the replicas' layers: cgroup, rlimit+watch, fraction+watch, watch
            " ".join(flags),
        )
    return table


def _render(status: Mapping[str, Any] | None, error: str | None, interval_s: float) -> Group | Table:
    parts: list[Any] = []
    if status is not None:
        parts.append(status_table(status))
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
