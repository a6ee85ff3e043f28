"""Markdown tables of the live scenarios (what ``python -m bench`` prints and RESULTS.md holds)."""

from __future__ import annotations

from typing import Any

from gpubroker.sim.numbers import fmt as _f  # one number formatter for the simulator and live tables


def _machine(res: dict[str, Any]) -> str:
    m = res.get("machine", {})
    return f"_{m.get('nproc')} CPUs ({m.get('cpu_model')}), {m.get('mem_gib')} GiB, {m.get('date')}_"


def _told(row: dict[str, Any]) -> str:
    st = row.get("settings") or {}
    cap, wait = st.get("max_batch_size"), st.get("batch_wait_timeout_s")
    if not cap or not wait:
        return "–"
    return f"{cap['median']:g} / {wait['median'] * 1000:.0f} ms"


def seed_md(res: dict[str, Any]) -> str:
    lines = [
        f"### seed: knee gain ({_machine(res)})",
        "",
        "| workload | fitted a / c (ms) | static 8:10 saturation: lazy 8/(a+8c) / eager model / **measured** | ref rate (½ measured) | S | cap 1.2·S | static 8 knee @1.2·S, held on all seeds | broker knee @1.2·S, held | BentoML knee @1.2·S, held | bound (1−2a/C)/c, max latency | **gain, one cap** | static 8 knee @S, held | gain vs static 8 @S | broker/bound | broker/BentoML |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        fb = r.get("fit_broker", {})
        bento = r.get("bentoml", {})
        lines.append(
            f"| {r['workload']} | {_f(fb.get('a_ms'), 2)} / {_f(fb.get('c_ms'), 3)} | "
            f"{_f(r.get('static8_saturation_lazy_rps'))} / {_f(r.get('static8_saturation_eager_model_rps'))} / **{_f(r.get('static8_saturation_rps'))}**/s | "
            f"{_f(r['reference_rps'])}/s | {_f(r['S_ms'], 0)} ms | "
            f"{_f(r['cap_ms'], 0)} ms | {held_cell(r['static8'])} | {held_cell(r['broker'])} | "
            f"{held_cell(bento) if 'knee_rps' in bento else 'n/a (' + str(bento.get('error', 'off'))[:60] + ')'} | "
            f"{_f(r['bound_rps'])}/s | **{_f(r['gain'], 2)}** | {held_cell(r.get('static8_at_S') or {})} | "
            f"{_f(r.get('gain_vs_static8_at_S'), 2)} | {_f(r['broker_vs_bound'], 2)} | {_f(r.get('broker_vs_bentoml'), 2)} |"
        )
    lines.append("")
    for r in res["results"]:
        lines.append(f"Rates tried, {r['workload']}:")
        lines.append("")
        lines.append(
            "| arm | rate | pass | attainment | P50 | P95 | P99 | mean batch | set cap / wait (median) | rejections | timeouts | send lag p99 |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        sat = {"rows": r.get("saturation_rows", [])}
        s_at = {"rows": r.get("S_rows", [])}
        for arm, doc in (
            ("static8 saturation (loose cap)", sat),
            ("static8 at ref (S)", s_at),
            ("static8 @S", r.get("static8_at_S")),
            ("static8 @1.2·S", r.get("static8")),
            ("broker", r.get("broker")),
            ("bentoml", r.get("bentoml")),
        ):
            for row in (doc or {}).get("rows", []) + (doc or {}).get("seeds_at_knee", []):
                m = next(iter(row["models"].values()))
                lines.append(
                    f"| {arm} (seed {row['seed']}) | {row['rate']} | {'✓' if row['pass'] else '✗'} | {_f(m['attainment'], 3)} | "
                    f"{_f(m['p50_ms'], 0)} | {_f(m['p95_ms'], 0)} | {_f(m['p99_ms'], 0)} | {_f(m.get('mean_batch'))} | {_told(row)} | "
                    f"{m['rejections']} | {m['timeouts']} | {_f(m['send_lag_p99_ms'])} |"
                )
        lines.append("")
    return "\n".join(lines)


def held_cell(doc: dict[str, Any]) -> str:
    """A knee held on every seed, with seed 0's beside it (older results: seed 0's only)."""
    if doc.get("seed0_knee_rps") is None:
        return f"{_f(doc.get('knee_rps'))}/s (seed 0)"
    if doc.get("held_resolved") is False:  # the budget ran out before a rate held on every seed
        return f"**not held** above {_f(doc.get('held_below_rps'))}/s (seed 0: {_f(doc['seed0_knee_rps'])}/s)"
    return f"**{_f(doc['knee_rps'])}/s** (seed 0: {_f(doc['seed0_knee_rps'])}/s)"


def oracle_md(res: dict[str, Any]) -> str:
    ref = res.get("reference") or {}
    lines = [
        f"### oracle: {res['workload']}, cap {res['cap_ms']:.0f} ms ({_machine(res)})",
        "",
        f"Reference {res['reference_rps']:.2f}/s, S {_f(ref.get('S_ms'), 0)} ms: {ref.get('source', '')}. "
        f"Static grid: {len(res['grid'])} arms (batch × wait × formation: Ray's eager one, the lazy gate) "
        "screened in the simulator at each rate; the best candidates ran live beside the broker (seed 0, same "
        "arrivals). Broker attainment over every seed is a floor of its oracle ratio (no arm completes more than "
        "was offered).",
        "",
        "| rate | broker goodput | broker P95 | broker batch | broker set cap / wait | best static (live) | its goodput | its P95 | oracle ratio | broker attainment, all seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rates"]:
        seeds = ", ".join(_f(x, 3) for x in r.get("broker_attainment_seeds", [r.get("broker_attainment")]))
        lines.append(
            f"| {r['rate_rps']:.1f}/s | {r['broker_goodput_rps']:.1f} | {_f(r['broker_p95_ms'], 0)} ms | {_f(r['broker_mean_batch'])} | "
            f"{_told({'settings': r.get('broker_settings')})} | "
            f"{r['best_static']} | {r['best_static_goodput_rps']:.1f} | {_f(r['static_p95_ms'].get(r['best_static']), 0)} ms | "
            f"**{_f(r['oracle_ratio'], 3)}** | {seeds} |"
        )
    lines += [
        "",
        "Live static candidates per rate (goodput req/s, P95 ms; simulator's prediction in brackets):",
        "",
        "| rate | candidates |",
        "|---|---|",
    ]
    screen = res.get("screen", {})
    for r in res["rates"]:
        sim = {c["arm"]: c for c in screen.get(f"{r['rate_rps']:.3f}", [])}
        cells = []
        for arm, g in r["static_goodput_rps"].items():
            c = sim.get(arm, {})
            cells.append(
                f"{arm}: {_f(g)}, {_f(r['static_p95_ms'].get(arm), 0)} ms [{_f(c.get('sim_goodput_rps'))}, {_f(c.get('sim_p95_ms'), 0)} ms]"
            )
        lines.append(f"| {r['rate_rps']:.1f} | " + "; ".join(cells) + " |")
    return "\n".join(lines)


def burst_md(res: dict[str, Any]) -> str:
    lines = [
        f"### burst: 3 models, {res['models'][0]} x{res['burst']['factor']:g} for {res['burst']['length_s']:g}s, cap {res['cap_ms']:.0f} ms ({_machine(res)})",
        "",
        "| arm | model | attainment (run) | attainment (burst) | P95 run | P95 burst | goodput | mean batch | peak mem | OOM splits | rejections | timeouts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in res["arms"].items():
        for n in res["models"]:
            s = a["summary"].get(n, {})
            b = a["in_burst"].get(n, {})
            lines.append(
                f"| {arm} | {n} | {_f(s.get('attainment'), 3)} | {_f(b.get('attainment'), 3)} | {_f(s.get('p95_ms'), 0)} | "
                f"{_f(b.get('p95_ms'), 0)} | {_f(s.get('goodput_rps'))} | {_f(a['batch'][n]['mean_batch'])} | "
                f"{a['peak_used_bytes'][n] / 2**20:.0f} MiB | {a['ooms'][n]} | {s.get('rejections')} | {s.get('timeouts')} |"
            )
    return "\n".join(lines)


def overhead_md(res: dict[str, Any]) -> str:
    lines = [
        f"### overhead: {res['workload']}, batch {res['batch']}, wait {res['wait_ms']:g} ms ({_machine(res)})",
        "",
        "| load | arm | seed | offered | completed | P50 | P95 | mean batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        lines.append(
            f"| {r['load']} | {r['arm']} | {r['seed']} | {r['rate']:.1f} | {r['completed_rps']:.2f} | {_f(r['p50_ms'], 0)} | {_f(r['p95_ms'], 0)} | {_f(r['mean_batch'])} |"
        )
    lines += [
        "",
        f"Throughput ratio pinned/plain at saturation: **{res['saturated_throughput_ratio']:.3f}**; "
        f"at half load {res['half_throughput_ratio']:.3f}; P50 ratio at half load {res['half_p50_ratio']:.3f}.",
    ]
    return "\n".join(lines)


def trace_md(res: dict[str, Any]) -> str:
    lines = [
        f"### trace: Azure LLM code trace 2023 (CC-BY 4.0, Patel et al., Splitwise, ISCA 2024), token-priced profiled "
        f"a={res['a_ms']:g} ms, {res['c_ms_per_token'] * 1000:.2f} µs/token, mean {res['mean_tokens']:.0f} tokens, cap {res['cap_ms']:.0f} ms ({_machine(res)})",
        "",
        "| arm | scale | rate | seed | attainment | goodput | P50 | P95 | P99 | mean batch (req) | set cap (tokens) / wait | rejections | timeouts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['arm']} | {r['scale']} | {r['rate_rps']:.1f} | {r['seed']} | {r['attainment']:.3f} | {r['goodput_rps']:.1f} | "
            f"{_f(r['p50_ms'], 0)} | {_f(r['p95_ms'], 0)} | {_f(r['p99_ms'], 0)} | {_f(r['mean_batch'])} | {_told(r)} | {r['rejections']} | {r['timeouts']} |"
        )
    return "\n".join(lines)


def oracle_knee_md(res: dict[str, Any]) -> str:
    lines = [
        f"### oracle knee: {res['workload']}, cap 1.2·S = {res['cap_ms']:.0f} ms ({_machine(res)})",
        "",
        "| arm | knee @1.2·S | rates tried (P95 ms, ✓/✗) |",
        "|---|---|---|",
    ]
    for a in res["arms"]:
        tried = ", ".join(
            f"{r['rate']} ({_f(next(iter(r['models'].values()))['p95_ms'], 0)}, {'✓' if r['pass'] else '✗'})"
            for r in a["rows"]
        )
        lines.append(f"| {a['arm']} | {_f(a['knee_rps'])}/s | {tried} |")
    lines += [
        "",
        f"Oracle knee (best of these arms): **{_f(res['oracle_knee_rps'])}/s** ({res['oracle_arm']}); broker knee from "
        f"`seed`: {_f(res.get('broker_knee_rps'))}/s; broker/oracle **{_f(res.get('broker_vs_oracle'), 2)}**.",
    ]
    return "\n".join(lines)


MD = {
    "seed": seed_md,
    "oracle": oracle_md,
    "burst": burst_md,
    "overhead": overhead_md,
    "trace": trace_md,
    "oracle-knee": oracle_knee_md,
}
