"""The CLI's rich views: config and fleet-status tables, decision lines, simulator tables, errors."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from gpubroker.quotas.config import ConfigError, FleetConfig
from gpubroker.quotas.placement import Placement
from gpubroker.quotas.sizes import exact_size, format_size
from gpubroker.sim.numbers import fmt

err_console = Console(stderr=True)


# =============================================================================== config
def print_config_error(exc: ConfigError) -> None:
    err_console.print(f"[bold red]invalid config[/] {exc.source}: {len(exc.issues)} problem(s)")
    for issue in exc.issues:
        err_console.print(f"  - {issue}", markup=False, highlight=False)


def config_table(cfg: FleetConfig, source: str) -> Table:
    if cfg.gpus == "auto":
        where = "cards: every GPU of the Ray cluster (gpus: auto, found and placed at start)"
    elif cfg.gpus is not None:
        where = f"{len(cfg.gpus)} card(s) on {len({c.node for c in cfg.gpus if not isinstance(c, str)})} node(s), placed below"
    else:
        cap = cfg.gpu.capacity_bytes
        usable = format_size(cfg.usable_bytes()) if cap is not None else "auto (measured at start)"
        where = f"device {cfg.gpu.device}, usable {usable}"
    table = Table(title=f"{source}: {len(cfg.models)} model(s), {where}")
    for col in ("model", "ref", "quota min/base/max", "batch", "wait ms", "P95 SLO ms", "prio", "replicas", "strategy"):
        table.add_column(col)
    for name, m in cfg.models.items():
        table.add_row(
            name,
            m.model,
            f"{format_size(m.quota.min)} / {format_size(m.quota.base)} / {format_size(m.quota.max)}",
            f"{m.batch.floor}..{m.batch.ceiling} {m.batch.unit}",
            f"{m.wait.min_ms:g}..{m.wait.max_ms:g}",
            f"{m.slo_p95_ms:g}",
            str(m.priority),
            str(m.replicas),
            m.control.strategy,
        )
    return table


def placement_table(placement: Placement) -> Table:
    """Where ``gpubroker up`` will put every replica of a listed ``gpus:`` fleet (``gpubroker.quotas.placement``)."""
    table = Table(title="placement (quotas/placement.py): each card holds the base of every model on it")
    for col in ("card", "node", "device", "capacity", "usable", "Σ base", "free", "models (replicas)"):
        table.add_column(col, justify="left" if col in ("card", "node", "device", "models (replicas)") else "right")
    for plan in placement.cards:
        card = plan.card
        table.add_row(
            card.id,
            card.node,
            str(card.device),
            format_size(card.capacity_bytes),
            format_size(plan.usable_bytes),
            format_size(plan.base_bytes),
            format_size(plan.free_bytes),
            ", ".join(f"{m} x{n}" if n > 1 else m for m, n in plan.models.items()) or "-",
        )
    return table


def budget_table(b: Any) -> Table:
    """``validate --explain``: the card's budget (``gpubroker.validate.CardBudget``), sizes with their bytes."""

    def size(n: int | None, unknown: str = "auto (measured at start)") -> str:
        return unknown if n is None else exact_size(n)

    title = f"card budget ({b.device}): usable = capacity x (1 - reserve_frac) - CUDA context per process"
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("capacity", size(b.capacity_bytes))
    table.add_row(f"reserve ({b.reserve_frac:g} of capacity)", size(b.reserve_bytes))
    context = b.context_bytes_each * b.processes
    table.add_row(
        f"CUDA context: {b.processes} process(es) x {format_size(b.context_bytes_each)} ({b.context_note})",
        exact_size(context),
    )
    table.add_row("usable", size(b.usable_bytes))
    table.add_row("sum of base quotas", exact_size(b.base_sum_bytes))
    table.add_row("usable - sum of base (lent and borrowed beyond the bases)", size(b.free_bytes, "-"))
    for m in b.models:
        replicas = f" x{m.replicas} replicas" if m.replicas > 1 else ""
        table.add_row(
            f"{m.name}{replicas}: min / base / max",
            f"{exact_size(m.min_bytes)} / {exact_size(m.base_bytes)} / {exact_size(m.max_bytes)}",
        )
        q = m.suggested
        if q is not None:
            table.add_row(
                f"  its profile suggests, for P95 <= {q.slo_p95_ms:g} ms (batch {q.batch_at_slo} at load, "
                f"{q.batch_alone} alone)",
                f"{format_size(q.min_bytes)} / {format_size(q.base_bytes)} / {format_size(q.max_bytes)}",
            )
    return table


# =============================================================================== fleet
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _frac(value: Any) -> str:
    return "-" if value is None else f"{100.0 * float(value):.0f}%"


def _clock(t: Any) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(float(t)))


def _status_caption(st: Mapping[str, Any]) -> str:
    head = (
        f"config {st.get('config_hash', '?')}  profile {st.get('profile', '?')} "
        f"(${st.get('price_per_gpu_hour', 0):g}/GPU-h)  device {st.get('device', '?')}  "
        f"granted {_size(st.get('granted_bytes'))} / usable {_size(st.get('usable_bytes'))} "
        f"/ capacity {_size(st.get('capacity_bytes'))}  free {_frac(st.get('free_frac'))}  "
        f"ticks {st.get('ticks', 0)} (last {_clock(st.get('last_tick_s'))})"
    )
    return head + ("  [DRY RUN]" if st.get("dry_run") else "")


STATUS_COLUMNS = (
    "model",
    "grant / base",
    "used",
    "batch",
    "wait ms",
    "queue",
    "P50/P95/P99 ms",
    "SLO ms",
    "attain",
    "rps",
    "$/1k",
    "repl -> target",
    "ver",
    "enforce",
    "flags",
)


def _flags(m: Mapping[str, Any]) -> str:
    flags = []
    if not m.get("admit", True):
        flags.append("[red]PAUSED[/]")
    if not m.get("calibrated", True):
        flags.append("uncalibrated")
    if m.get("emergency_shrinks"):
        flags.append(f"emerg {m['emergency_shrinks']}")
    if m.get("oom_splits"):
        flags.append(f"oom {m['oom_splits']}")
    return " ".join(flags)


def _grant(m: Mapping[str, Any]) -> str:
    """Grant / base, green while borrowing, yellow while lending."""
    grant, base = m.get("grant_bytes"), m.get("base_bytes")
    shown = _size(grant)
    if grant is not None and base is not None and grant != base:
        shown = f"[{'green' if grant > base else 'yellow'}]{shown}[/]"
    return f"{shown} / {_size(base)}"


def _latency(m: Mapping[str, Any]) -> str:
    p95, slo = m.get("p95_ms"), m.get("slo_p95_ms")
    shown = _ms(p95) if p95 is None or slo is None or p95 <= slo else f"[red]{_ms(p95)}[/]"
    return f"{_ms(m.get('p50_ms'))}/{shown}/{_ms(m.get('p99_ms'))}"


def _engine_cells(e: Mapping[str, Any]) -> tuple[str, str, str, str, str]:
    """An LLM's batch, wait, latency, SLO and attainment cells: it has no batch cap or wait (its
    bounds are in the engines table); its latency is TTFT and TPOT P95 against their SLOs."""
    over = [
        e.get(p) is not None and e.get(s) is not None and e[p] > e[s]
        for p, s in (("ttft_p95_ms", "ttft_slo_ms"), ("tpot_p95_ms", "tpot_slo_ms"))
    ]
    ttft, tpot = _ms(e.get("ttft_p95_ms")), _ms(e.get("tpot_p95_ms"))
    latency = f"ttft {'[red]' + ttft + '[/]' if over[0] else ttft} tpot {'[red]' + tpot + '[/]' if over[1] else tpot}"
    slo = f"{_ms(e.get('ttft_slo_ms'))}/{_ms(e.get('tpot_slo_ms'))}"
    return f"{e.get('max_num_seqs', '-')} seqs", "-", latency, slo, "-"


def status_table(st: Mapping[str, Any]) -> Table:
    """One row per model: grant and use against base, batch cap and wait, queue, latency against the
    SLO, attainment, rate, cost, replicas and their target, settings version, enforcement, flags.
    The one table of ``gpubroker status`` and ``status --watch``; cells wrap, never cut, when narrow."""
    table = Table(caption=_status_caption(st), caption_justify="left")
    for col in STATUS_COLUMNS:
        table.add_column(col, justify="left" if col in ("model", "enforce", "flags") else "right", overflow="fold")
    for name, m in sorted(st.get("models", {}).items()):
        unit = " tok" if m.get("batch_unit") == "tokens" else ""
        cost = m.get("cost_per_1k_requests")
        wait = m.get("batch_wait_timeout_s")
        engine = m.get("engine")
        batch, wait_ms, latency, slo, attain = (
            _engine_cells(engine)
            if engine is not None
            else (
                _cap(m, unit) if m.get("max_batch_size") is not None else "-",
                _ms(None if wait is None else 1000.0 * wait),
                _latency(m),
                _ms(m.get("slo_p95_ms")),
                _frac(m.get("attainment")),
            )
        )
        table.add_row(
            name,
            _grant(m),
            _size(m.get("used_bytes")),
            batch,
            wait_ms,
            f"{m.get('queue_depth', 0):g}",
            latency,
            slo,
            attain,
            f"{m.get('arrival_rate_rps', 0.0):.1f}",
            "-" if cost is None else f"{cost:.4f}",
            f"{m.get('replicas', '-')} -> {_target(m)}"
            if m.get("replica_target") is not None
            else str(m.get("replicas", "-")),
            str(m.get("settings_version", "-")),
            m.get("enforcement") or "-",  # the replicas' layers: cgroup, rlimit+watch, fraction+watch, watch
            _flags(m),
        )
    return table


def fleet_view(st: Mapping[str, Any]) -> list[Table]:
    """What ``gpubroker status`` prints and ``status --watch`` redraws: cards, models, LLM engines."""
    return [t for t in (card_table(st), status_table(st), engine_table(st)) if t is not None]


def _cap(m: Mapping[str, Any], unit: str) -> str:
    """The batch cap, marked ``mem`` when the grant's memory holds it there (status' ``memory_ceiling``:
    the batch the grant holds by the memory the broker measured, gpubroker.broker.control.policy.memory_view)."""
    ceiling = m.get("memory_ceiling")
    held = ceiling is not None and m["max_batch_size"] >= ceiling
    return f"{m['max_batch_size']}{unit}" + (" [yellow]mem[/]" if held else "")


def _target(m: Mapping[str, Any]) -> str:
    """The replica target (gpubroker.broker.control.replica_rules), marked when it is under the live replicas' count."""
    target = m.get("replica_target")
    if target is None:
        return "-"
    return f"[cyan]{target}[/]" if target < m.get("replicas", target) else str(target)


def card_table(st: Mapping[str, Any]) -> Table | None:
    """The fleet by card (a many-card fleet; None for one card): each card's memory and its models."""
    cards = st.get("cards") or []
    if len(cards) < 2:
        return None
    table = Table(title=f"cards ({sum(1 for c in cards if c.get('live', True))} of {len(cards)} live)")
    for col in (
        "card",
        "node",
        "device",
        "capacity",
        "usable",
        "granted",
        "used",
        "models: grant / used (replicas, target) $/1k",
    ):
        table.add_column(
            col, justify="left" if col in ("card", "node", "device") or col.startswith("models") else "right"
        )
    for c in cards:
        models = (
            "; ".join(
                f"{n} {format_size(m['grant_bytes'])} / {format_size(m['used_bytes'])} ({m['replicas']}, {_target(m)})"
                + ("" if m.get("cost_per_1k_requests") is None else f" ${m['cost_per_1k_requests']:.4f}")
                for n, m in c.get("models", {}).items()
            )
            or "-"
        )
        card = c["id"] if c.get("live", True) else f"[red]{c['id']} LOST[/]"
        table.add_row(
            card,
            str(c.get("node", "")),
            str(c.get("device", "")),
            format_size(c["capacity_bytes"]),
            format_size(c["usable_bytes"]),
            format_size(c["granted_bytes"]),
            format_size(c["used_bytes"]),
            models,
        )
    return table


def engine_table(st: Mapping[str, Any]) -> Table | None:
    """The LLM engines' bounds as the broker set them, and what their engines report (None: no LLMs)."""
    engines = {n: m["engine"] for n, m in st.get("models", {}).items() if m.get("engine") is not None}
    if not engines:
        return None
    table = Table(title="LLM engines (bounds set by the broker's llm rules)")
    for col in (
        "model",
        "max seqs",
        "batch tok",
        "KV blocks",
        "KV used/free",
        "prefill",
        "run/wait",
        "TTFT P95",
        "TPOT P95",
        "SLO ms",
        "tok/s in/out",
        "rule",
    ):
        table.add_column(col, justify="left" if col in ("model", "rule") else "right")
    for name, e in engines.items():
        ok = [
            e.get("ttft_p95_ms") is None or e["ttft_p95_ms"] <= e["ttft_slo_ms"],
            e.get("tpot_p95_ms") is None or e["tpot_p95_ms"] <= e["tpot_slo_ms"],
        ]
        ttft = _ms(e.get("ttft_p95_ms")) if ok[0] else f"[red]{_ms(e.get('ttft_p95_ms'))}[/]"
        tpot = _ms(e.get("tpot_p95_ms")) if ok[1] else f"[red]{_ms(e.get('tpot_p95_ms'))}[/]"

        def g(key: str, e: Mapping[str, object] = e) -> str:
            return "-" if e.get(key) is None else str(e[key])

        table.add_row(
            name,
            g("max_num_seqs"),
            g("max_batched_tokens"),
            f"{g('kv_blocks')} ({g('kv_blocks_total')} now)",
            f"{g('kv_blocks_used')}/{g('kv_blocks_free')}",
            "[red]PAUSED[/]" if e.get("prefill_paused") else "on",
            f"{g('running')}/{g('waiting')}",
            ttft,
            tpot,
            f"{e['ttft_slo_ms']:g}/{e['tpot_slo_ms']:g}",
            f"{e.get('tokens_in_per_s', 0):.0f}/{e.get('tokens_out_per_s', 0):.0f}",
            str(e.get("rule", "-")),
        )
    return table


def describe_decision(d: Mapping[str, Any]) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(d.get("time_s", 0))) + f".{int((d.get('time_s', 0) % 1) * 1000):03d}"
    kind = d.get("kind")
    if kind == "settings":
        old, new = d["old"], d["new"]
        parts = []
        for key, label in (
            ("max_batch_size", "batch"),
            ("batch_wait_timeout_s", "wait_s"),
            ("grant_bytes", "grant"),
            ("admit", "admit"),
        ):
            if old[key] != new[key]:
                a, b = old[key], new[key]
                if key == "grant_bytes":
                    a, b = format_size(a), format_size(b)
                parts.append(f"{label} {a}->{b}")
        tv = d.get("trigger_value")
        trig = f"{d.get('trigger')}={tv:.3g}" if isinstance(tv, (int, float)) else f"{d.get('trigger')}"
        return f"#{d['seq']} {t} {d['model']}: {', '.join(parts) or 'no change'}  [{trig}]  {d.get('reason', '')}" + (
            " (dry run)" if d.get("dry_run") else ""
        )
    if kind == "replicas":
        where = f"{d['model']}@{d['card']}" if d.get("card") else d["model"]
        tv = d.get("trigger_value")
        trig = f"{d.get('trigger')}={tv:.3g}" if isinstance(tv, (int, float)) else f"{d.get('trigger')}"
        return (
            f"#{d['seq']} {t} {where}: replicas {d['old']['replica_target']}->{d['new']['replica_target']}  "
            f"[{trig}]  {d.get('reason', '')}" + (" (dry run)" if d.get("dry_run") else "")
        )
    if kind == "move":
        return (
            f"#{d['seq']} {t} quota {d['move']}: {d.get('donor') or 'pool'} -> {d.get('recipient') or 'pool'} "
            f"{format_size(d['amount_bytes'])}  {d.get('reason', '')}"
        )
    if kind == "engine":
        old, new = d.get("old") or {}, d.get("new") or {}
        changed = [f"{k} {old.get(k)}->{v}" for k, v in new.items() if k in old and old[k] != v]
        tv = d.get("trigger_value")
        trig = f"{d.get('trigger')}={tv:.3g}" if isinstance(tv, (int, float)) else f"{d.get('trigger')}"
        return (
            f"#{d['seq']} {t} {d.get('model')}: engine {d.get('rule')} {', '.join(changed) or 'no change'}  "
            f"[{trig}]  {d.get('reason', '')}" + (" (dry run)" if d.get("dry_run") else "")
        )
    model = f"{d['model']}: " if d.get("model") else ""
    return f"#{d['seq']} {t} {model}[{kind}] {d.get('reason', '')}"


# =============================================================================== simulator
def result_table(result: Any, title: str) -> Table:
    table = Table(title=title)
    for col in (
        "model",
        "offered/s",
        "completed/s",
        "attain",
        "goodput/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "cap ms",
        "mean batch",
        "ooms",
        "rejects",
        "timeouts",
    ):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name, m in result.models.items():
        table.add_row(
            name,
            fmt(m.offered_rps),
            fmt(m.completed_rps),
            fmt(m.attainment, 3),
            fmt(m.goodput_rps),
            fmt(m.p50_ms),
            fmt(m.p95_ms),
            fmt(m.p99_ms),
            fmt(m.cap_ms),
            fmt(m.mean_batch),
            str(m.ooms),
            str(m.rejects),
            str(m.timeouts),
        )
    return table


def knee_check_table(v: dict[str, Any]) -> Table:
    t = Table(
        title=f"{v['model']}: a={v['a_ms']:g} ms, c={v['c_ms']:g} ms, {v.get('batching', 'eager')} batching; reference {v['reference_rps']:.1f}/s, "
        f"S = {v['S_ms']:.1f} ms, broker cap 1.2·S = {v['cap_ms']:.1f} ms"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("static 8 saturation /s", v["static8_saturation_rps"]),
        ("static 8 saturation, lazy 8/(a+8c) /s", v.get("static8_saturation_lazy_rps")),
        ("static 8 knee at 1.2·S /s", v["static8_knee_rps"]),
        ("static 8 knee at S /s", v.get("static8_knee_at_S_rps")),
        ("broker knee at 1.2·S /s", v["broker_knee_rps"]),
        ("oracle knee at 1.2·S /s", v.get("oracle_knee_rps")),
        ("oracle arm", v.get("oracle_arm")),
        ("bound (1-2a/C)/c /s", v["bound_rps"]),
        ("knee gain, both at 1.2·S", v["gain"]),
        ("knee gain, broker 1.2·S / static 8 S", v.get("gain_vs_static8_at_S")),
        ("oracle gain", v.get("oracle_gain")),
        ("broker / oracle", v.get("broker_vs_oracle")),
        ("broker / bound", v["broker_vs_bound"]),
    ]
    for k, x in rows:
        t.add_row(k, fmt(x, 2 if isinstance(x, float) and x < 10 else 1))
    return t
