"""Hashes of what the control plane outputs, to check that a change to its speed changed nothing.

A refactor of the window, the rules or the broker core must give the same answers. This runs
``bench.scale``'s synthetic fleets on a fake clock (seed 3; 16 cards x 100 models, 1 x 100,
1 x 10; 150 s each) and hashes every settings reply, the decision log and the final status, and
the simulator's broker arm on 100 models x 300 s of trace arrivals (without its wall time), and
the LLM path (``llm_run``: three deterministic fake engines bursting in turn beside a request
model on one card, through ``FleetBroker``: idle lends, grows, reclaims, a handover). Run it on
two trees and compare the lines:

    python -m bench.output_hashes            # one line per case
    git worktree add /tmp/base <commit> && (cd /tmp/base && python -m bench.output_hashes)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

from bench.scale import _Cores, synthetic_config, synthetic_doc

MiB = 1024**2


def digest(obj: Any) -> str:
    """A short hash of ``obj`` as sorted JSON (dataclasses as dicts, tuples and sets as lists)."""

    def plain(o: Any) -> Any:
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        return str(o)

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=plain).encode()).hexdigest()[:16]


def scale_hashes(cards: int, models: int, seconds: float, seed: int = 3) -> tuple[str, str, str]:
    """(replies, decision log, status) of ``models`` models over ``cards`` cards after ``seconds``."""
    cores = _Cores(synthetic_doc(models, cards=cards), seed)
    replies: list[Any] = []  # ModelSettings (hashed as their fields)
    report = cores.broker.report

    def recording(rep: Any, *args: Any) -> Any:
        out = report(rep, *args)
        replies.append(out)
        return out

    cores.broker.report = recording
    cores.run(seconds)
    status = cores.broker.status()
    return digest(replies), digest(cores.broker.decisions()), digest(_without(status, "checkpoint_path"))


def sim_hash(models: int = 100, seconds: float = 300.0, seed: int = 0) -> str:
    from gpubroker.sim.engine import SimOptions, run_sim

    cfg = synthetic_config(models)
    res = dataclasses.asdict(
        run_sim(cfg, "broker", {n: 0.5 for n in cfg.models}, seconds, arrivals="trace", opts=SimOptions(seed=seed))
    )
    res.pop("wall_s", None)
    return digest(res)


def _without(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        return {k: _without(v, key) for k, v in obj.items() if k != key}
    if isinstance(obj, list):
        return [_without(v, key) for v in obj]
    return obj


# ------------------------------------------------------------------ the LLM path
LLM_BLOCK_BYTES = 256 * 1024  # a KV block of the tiny engines (configs/llm-demo.yaml)
LLM_WEIGHTS_BYTES = 1536 * 1024
LLM_SPARE_BLOCKS = 2  # blocks the cache tensor holds besides the usable ones (llm_rules.LlmRuleConfig)
# per engine: (start s, end s, arrivals per report) bursts; a burst moves from engine to engine so
# idle engines lend, the busy one grows and borrows, an owner reclaims and a borrower hands over
LLM_BURSTS = {
    "chat": ((5, 40, 12), (95, 125, 10)),
    "code": ((45, 80, 12), (110, 140, 12)),
    "sum": ((20, 30, 3), (60, 100, 2)),
}


def _llm_doc() -> dict[str, Any]:
    """Three tiny engines and one request model on a 64 MiB host card."""
    engine = {
        "kind": "llm",
        "model": "tiny-llama",
        "options": {
            "max_model_len": 512,
            "block_tokens": 128,
            "kv_cache_blocks": 8,
            "kv_cache_blocks_min": 5,
            "kv_cache_blocks_max": 80,
            "max_num_seqs": 8,
            "max_num_seqs_max": 32,
            "max_batched_tokens": 1024,
        },
        "llm": {"expected_peak_concurrency": 16, "ttft_slo_ms": 3000, "tpot_slo_ms": 300},
        "quota": {"min": 4 * MiB, "base": 12 * MiB, "max": 24 * MiB},
        "control": {"idle_hold_s": 5, "reclaim_hold_s": 2},
    }
    request = {
        "model": "profiled",
        "options": {"a_ms": 5, "c_ms": 0.3, "weights_bytes": 3 * MiB, "bytes_per_item": 64 * 1024},
        "quota": {"min": 4 * MiB, "base": 12 * MiB, "max": 20 * MiB},
        "batch": {"floor": 2, "ceiling": 128},
        "slo_p95_ms": 100,
    }
    return {
        "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, "metrics_port": 0, "decision_log_size": 4000},
        "gpu": {"device": "cpu", "capacity": 64 * MiB, "reserve_frac": 0.12, "emergency_free_frac": 0.10},
        "models": {"chat": engine, "code": engine, "sum": engine, "embed": request},
    }


class _FakeEngine:
    """A deterministic engine: sequences arrive by ``LLM_BURSTS``, run within the bounds and the
    cache the broker set (a new cache size takes effect at once, as a restart), finish in two
    report intervals each. It reports what ``engine_report`` reports and follows its reply."""

    def __init__(self, name: str, settings: Any) -> None:
        self.name, self.settings, self.seq = name, settings, 0
        self.blocks, self.max_seqs, self.max_tokens, self.paused = 8, 8, 1024, False
        self.queue, self.tokens_in, self.tokens_out, self.rebuilds, self.idle_s = 0, 0, 0, 0, 0.0
        self.last_restart_s = 0.0

    def arrivals(self, t_s: float) -> int:
        return sum(n for start, end, n in LLM_BURSTS[self.name] if start <= t_s < end)

    def report(self, t_s: float, now_s: float) -> Any:
        from gpubroker.broker.wire import EngineReport, StatsReport

        new = self.arrivals(t_s)
        self.queue += new
        fits = self.blocks * 128 // 256  # sequences of 256 tokens the cache holds
        running = min(self.queue, self.max_seqs, max(1, fits))
        done = running // 2 + (running % 2 if self.queue <= running else 0)
        waiting = self.queue - running
        self.queue -= done
        self.tokens_in += new * 128
        self.tokens_out += done * 128
        self.idle_s = 0.0 if self.queue or new else self.idle_s + 0.5
        ttft = 80.0 + 40.0 * waiting
        engine = {
            "model": self.name,
            "running": running,
            "waiting": waiting,
            "max_num_seqs": self.max_seqs,
            "max_batched_tokens": self.max_tokens,
            "prefill_paused": self.paused,
            "kv_blocks_total": self.blocks,
            "kv_blocks_used": min(self.blocks, 2 * running),
            "kv_blocks_reserved": min(self.blocks, 2 * running),
            "kv_blocks_free": self.blocks - min(self.blocks, 2 * running),
            "kv_block_tokens": 128,
            "kv_block_bytes": LLM_BLOCK_BYTES,
            "kv_cache_bytes": (self.blocks + LLM_SPARE_BLOCKS) * LLM_BLOCK_BYTES,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "rebuilds": self.rebuilds,
            "last_restart_s": self.last_restart_s,
            "prefill_time_frac": 0.2,
            "samples": 20,
            "ttft_p50_ms": ttft / 2,
            "ttft_p95_ms": ttft,
            "tpot_p50_ms": 20.0 + running,
            "tpot_p95_ms": 40.0 + 2 * running,
            "max_model_len": 512,
            "max_num_seqs_max": 32,
            "max_batched_tokens_max": 4096,
            "step_tokens_per_block": 128.0,
            "kv_cache_blocks_min": 5,
            "kv_cache_blocks_max": 80,
            "idle_for_s": self.idle_s,
            "seq_tokens": 256,
            "weights_bytes": LLM_WEIGHTS_BYTES,
        }
        used = LLM_WEIGHTS_BYTES + (self.blocks + LLM_SPARE_BLOCKS) * LLM_BLOCK_BYTES
        self.seq += 1
        return StatsReport(
            model=self.name,
            replica_id=f"{self.name}-r0",
            seq=self.seq,
            now_s=now_s,
            interval_s=0.5,
            arrivals=new,
            completions=done,
            latency_ms=tuple(400.0 + 10.0 * i for i in range(min(done, 8))),
            busy_s=0.5 if running else 0.0,
            queue_depth=running + waiting,
            mem_used_bytes=used,
            mem_peak_bytes=used,
            settings_version=self.settings.version,
            engine=EngineReport(**engine),
        )

    def follow(self, settings: Any) -> None:
        """Take the reply's bounds: a new cache size is a restart."""
        self.settings = settings
        bounds = settings.engine
        if bounds is None:
            return
        if bounds.kv_blocks != self.blocks:
            self.blocks, self.rebuilds, self.last_restart_s = bounds.kv_blocks, self.rebuilds + 1, 1.0
        self.max_seqs, self.max_tokens, self.paused = (
            bounds.max_num_seqs,
            bounds.max_batched_tokens,
            bounds.prefill_paused,
        )


def _request_report(settings: Any, seq: int, t_s: float, now_s: float) -> Any:
    from gpubroker.broker.wire import StatsReport

    rate = 60 if 50 <= t_s < 70 else 4
    cap = settings.max_batch_size
    batches = tuple((float(min(cap, rate // 2)), 5.0 + 0.3 * min(cap, rate // 2)) for _ in range(2))
    used = 3 * MiB + int(64 * 1024 * min(cap, rate))
    return StatsReport(
        model="embed",
        replica_id="embed-r0",
        seq=seq,
        now_s=now_s,
        interval_s=0.5,
        arrivals=rate,
        completions=rate,
        latency_ms=tuple(10.0 + (i % 7) * (8.0 if rate > 10 else 1.0) for i in range(min(rate, 16))),
        batches=batches,
        batch_requests=tuple(int(b[0]) for b in batches),
        busy_s=sum(b[1] for b in batches) / 1000.0,
        queue_depth=rate // 3 if rate > 10 else 0,
        mem_used_bytes=used,
        mem_peak_bytes=used,
        settings_version=settings.version,
    )


def llm_run(seconds: float = 150.0) -> tuple[Any, list[Any]]:
    """The fleet broker after ``seconds`` of the engines' bursts (``LLM_BURSTS``) beside a request
    model, on a fake clock; and every settings reply."""
    import json

    from gpubroker.broker.core import NullMetrics
    from gpubroker.broker.fleet_core import FleetBroker

    t = [1_700_000_000.0]
    broker = FleetBroker(json.dumps(_llm_doc()), clock=lambda: t[0], metrics=NullMetrics())
    cal = {"weights_bytes": 3 * MiB, "bytes_per_unit": 64.0 * 1024, "cost_unit": "requests"}
    embed = broker.register("embed", "embed-r0", cal)
    engines = [_FakeEngine(n, broker.register(n, f"{n}-r0", {"weights_bytes": LLM_WEIGHTS_BYTES})) for n in LLM_BURSTS]
    replies: list[Any] = []
    for step in range(1, int(round(seconds / 0.5)) + 1):
        t[0] += 0.5
        t_s = step * 0.5
        for eng in engines:
            out = broker.report(eng.report(t_s, t[0]))
            eng.follow(out)
            replies.append(out)
        embed = broker.report(_request_report(embed, step, t_s, t[0]))
        replies.append(embed)
        if step % 2 == 0:
            broker.tick()
    return broker, replies


def llm_hashes(seconds: float = 150.0) -> tuple[str, str, str]:
    """(replies, decision log, status) of ``llm_run``."""
    broker, replies = llm_run(seconds)
    return digest(replies), digest(broker.decisions()), digest(_without(broker.status(), "checkpoint_path"))


def main() -> None:
    for cards, models in ((16, 100), (1, 100), (1, 10)):
        print(f"{cards}x{models}", *scale_hashes(cards, models, 150.0))
        sys.stdout.flush()
    print("sim", sim_hash())
    print("llm", *llm_hashes())


if __name__ == "__main__":
    main()
