"""The broker core: everything the broker does, without Ray.

``BrokerCore`` governs one card and takes the clock (and metrics, checkpoint path) as arguments: it
runs inside ``gpubroker.broker.fleet_core.FleetBroker`` (one per card; the Ray actor and the simulator drive
that) and alone in unit tests on a fake clock. Replicas call ``register`` once and ``report`` (a
``StatsReport``) every report interval and get their ``ModelSettings`` back; ``tick`` runs one
slow-loop step; ``apply`` swaps the config; ``status`` is the JSON-safe view.

Slow loop (one ``tick``): ``ReportWindow.snapshot`` -> ``gpubroker.broker.control.policy.decide`` -> versioned settings table (a
model's version bumps only when its settings change) -> checkpoint (``gpubroker.broker.checkpoint``) -> decision log
(bounded; one entry and one log line per change, with its inputs, result and reason).

``status()`` returns a JSON-safe dict::

    {"config_hash", "launch_hash", "profile", "price_per_gpu_hour", "dry_run", "now_s",
     "capacity_bytes", "usable_bytes", "granted_bytes", "used_bytes", "free_frac",
     "ticks", "last_tick_s", "restored", "checkpoint_path",
     "models": {name: {"grant_bytes", "base_bytes", "used_bytes", "max_batch_size",
                       "batch_wait_timeout_s", "queue_depth", "p50_ms", "p95_ms", "p99_ms",
                       "slo_p95_ms", "attainment", "arrival_rate_rps", "completion_rate_rps",
                       "settings_version", "replicas", "admit", "cost_per_1k_requests",
                       "cost_unit", "calibrated", "emergency_shrinks", "oom_splits",
                       "memory_ceiling", "fixed_bytes"}}}   # gpubroker.broker.control.policy.memory_view
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from prometheus_client import CollectorRegistry

from gpubroker.broker.checkpoint import CHECKPOINT_DECISIONS, CardSlot, Checkpoint, CheckpointFile
from gpubroker.broker.control import policy
from gpubroker.broker.control.cost import cost_per_1k_requests
from gpubroker.broker.control.decision_log import DecisionLog, finite, settings_entry, settings_view
from gpubroker.broker.control.llm_rules import engines_from_llm_section
from gpubroker.broker.control.llm_window import EngineWindow, engine_status
from gpubroker.broker.control.profiles import active_profile
from gpubroker.broker.control.reconfig import next_up_notes, redeploy_issues, weights_issues
from gpubroker.broker.control.replica_rules import ReplicaChange
from gpubroker.broker.control.replica_targets import replica_target
from gpubroker.broker.control.tallies import Tallies, Tally
from gpubroker.broker.control.types import FleetDecision, FleetSnapshot, GpuLoad, ModelDecision
from gpubroker.broker.control.vocab import EntryKind
from gpubroker.broker.control.window import ReportWindow
from gpubroker.broker.metrics import BrokerMetrics, NullMetrics
from gpubroker.broker.wire import (
    ApplyResult,
    BrokerStatus,
    Calibration,
    CardCheckpoint,
    DecisionRecord,
    ModelSettings,
    ModelStatus,
    RejectionsCounted,
    StatsReport,
    TickResult,
)
from gpubroker.quotas.config import ConfigError, FleetConfig, parse_config_text
from gpubroker.quotas.holding import holding_problems
from gpubroker.quotas.sizes import format_size

logger = logging.getLogger("gpubroker.broker")

REPLICA_STALE_S = 10.0  # a replica silent this long no longer counts in `replicas`


def wire_settings(name: str, md: ModelDecision) -> ModelSettings:
    """What the replicas of ``name`` run after a tick's decision: its settings as the wire carries them."""
    return ModelSettings(
        model=name,
        version=md.version,
        max_batch_size=md.max_batch_size,
        batch_wait_timeout_s=md.batch_wait_timeout_s,
        grant_bytes=md.grant_bytes,
        admit=md.admit,
        release_cache=md.release_cache,
        drain=md.drain,
        restart_token=md.restart_token,
        engine=md.engine,
    )


def _settings_fields(s: ModelDecision | ModelSettings) -> tuple[Any, ...]:
    """The fields a decision and the settings a replica runs share: equal fields, equal settings."""
    return (
        s.version,
        s.max_batch_size,
        s.batch_wait_timeout_s,
        s.grant_bytes,
        s.admit,
        s.release_cache,
        s.drain,
        s.restart_token,
        s.engine,
    )


class BrokerCore:
    """The broker without Ray. Not thread-safe: the actor calls it from one event loop.

    ``config`` is the fleet YAML (what ``apply`` and the checkpoint keep) or a parsed
    ``FleetConfig`` (the simulator's; its JSON dump stands in for the text)."""

    def __init__(
        self,
        config: str | FleetConfig,
        *,
        capacity_bytes: int | None = None,
        checkpoint: str | Path | CheckpointFile | CardSlot | None = None,
        clock: Callable[[], float] = time.time,
        metrics: BrokerMetrics | NullMetrics | None = None,
        log: DecisionLog | None = None,
        card_id: str = "",
    ) -> None:
        """``checkpoint``: where the core checkpoints: a path (a file of its own), a card's slot in a
        fleet's one file (``gpubroker.broker.checkpoint.CardCheckpoints``), or None (nowhere)."""
        self._clock = clock
        self._started_s = clock()
        if isinstance(config, FleetConfig):
            cfg, config_text = config, json.dumps(config.model_dump(mode="json"))
        else:
            cfg, config_text = parse_config_text(config, "broker config"), config
        # Prometheus metrics (broker/metrics.py); a private registry so one process may hold several cores.
        self.metrics = metrics if metrics is not None else BrokerMetrics(CollectorRegistry(), gpu=cfg.gpu.device)
        self._launch_hash = cfg.config_hash()
        self._launch_text = config_text
        if capacity_bytes is None:
            capacity_bytes = cfg.gpu.capacity_bytes
        if capacity_bytes is None:
            raise ValueError(
                "gpu.capacity is 'auto' and no capacity_bytes was given; the core does not probe hardware. "
                "Pass the measured capacity (gpubroker.broker.actor does) or set gpu.capacity in the config"
            )
        self._capacity = int(capacity_bytes)
        if isinstance(checkpoint, str | Path):
            checkpoint = CheckpointFile(checkpoint) if checkpoint else None
        self._checkpoint = checkpoint
        # the decision log; the cores of a many-card fleet share one (gpubroker.broker.fleet_core), which
        # the fleet journals once (gpubroker.broker.fleet_store): a core saves only a log it owns
        self._log = log if log is not None else DecisionLog(cfg.broker.decision_log_size)
        self._owns_log = log is None
        self.card_id = card_id  # the card this core governs ("" for a one-card fleet)
        self._ticks = 0
        self._last_tick_s: float | None = None
        self._last_snapshot: FleetSnapshot | None = None
        self._last_decision: FleetDecision | None = None
        self._memory_models: dict[str, tuple[int, float]] = {}
        self._cost_units: dict[str, str] = {}
        self._replicas: dict[str, dict[str, float]] = {}  # model -> replica_id -> last seen
        self._enforcement: dict[str, dict[str, str]] = {}  # model -> replica_id -> its memory layers (registration)
        self._replica_free: dict[str, tuple[float, float | None, float | None]] = {}  # rid -> (t, free, sm)
        self._tallies: dict[str, Tallies] = {}
        self._events: dict[str, dict[str, int]] = {}
        self.restored = False
        self._install(cfg, config_text)
        restored = self._restore()
        if not restored:
            self._state = policy.initial_state(cfg, self._usable)
            self._settings = {name: self._initial_settings(name) for name in cfg.models}
        self.checkpoint_now()

    # ---------------------------------------------------------------- config & state
    def _install(self, cfg: FleetConfig, text: str) -> None:
        self._cfg = cfg
        self._config_text = text
        self._config_hash = cfg.config_hash()
        self._usable = cfg.usable_bytes(self._capacity)
        self._window = ReportWindow(cfg)
        # kind: llm engines' reports (gpubroker.broker.control.llm_window), kept across a new config
        self._engines = self.__dict__.get("_engines") or EngineWindow(stale_after_s=REPLICA_STALE_S)
        self._engines.window_s = max(m.control.window_s for m in cfg.models.values()) if cfg.models else 30.0
        self._llm_models = tuple(n for n, m in cfg.models.items() if m.kind == "llm")
        self._engines.forget(set(self._llm_models))
        for name in cfg.models:
            self._tallies.setdefault(name, Tallies())
            self._replicas.setdefault(name, {})
            self._events.setdefault(name, {"emergency_shrinks": 0, "oom_splits": 0})

    def _initial_settings(self, name: str) -> ModelSettings:
        return self._policy_settings(self._state, name)

    def _policy_settings(self, state: Any, name: str) -> ModelSettings:
        """The policy's versioned settings (its version numbers gate two-phase confirms)."""
        return policy.model_settings(state, name, self._cfg)

    def _restore(self) -> bool:
        if self._checkpoint is None:
            return False
        try:
            ckpt = self._checkpoint.load()
        except ValueError as exc:
            self._log_event(EntryKind.RESTORE, f"checkpoint unreadable, starting fresh: {exc}")
            return False
        if ckpt is None:
            return False
        if ckpt.launch_hash != self._launch_hash and ckpt.config_hash != self._launch_hash:
            self._log_event(
                EntryKind.RESTORE,
                f"checkpoint is for config {ckpt.config_hash} (launched {ckpt.launch_hash}), this broker runs "
                f"{self._launch_hash}: starting fresh from the new config",
            )
            return False
        try:
            cfg = parse_config_text(ckpt.config_text, "checkpoint")
            self._install(cfg, ckpt.config_text)
            self._state = policy.PolicyState.from_dict(ckpt.policy_state)
            if "engines" not in ckpt.policy_state:  # written before the engines joined the policy state
                engines = engines_from_llm_section(ckpt.llm_state)
                self._state = replace(self._state, engines={n: e for n, e in engines.items() if n in self._llm_models})
            self._settings = {
                name: ModelSettings.from_dict(d) for name, d in ckpt.settings.items() if name in cfg.models
            }
            for name in cfg.models:
                self._settings.setdefault(name, self._initial_settings(name))
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint must not keep the broker down
            self._install(parse_config_text(self._launch_text, "broker config"), self._launch_text)
            self._log_event(EntryKind.RESTORE, f"checkpoint could not be applied ({exc!r}); starting fresh")
            return False
        self._memory_models = {k: (int(v[0]), float(v[1])) for k, v in ckpt.memory_models.items()}
        self._cost_units = dict(ckpt.cost_units)
        self._log.restore(list(ckpt.decisions), ckpt.decision_seq)
        self.restored = True
        self._log_event(
            EntryKind.RESTORE, f"resumed from checkpoint saved at {ckpt.saved_at_s:.3f} (config {ckpt.config_hash})"
        )
        return True

    # ---------------------------------------------------------------- replica RPCs
    def register(self, model: str, replica_id: str, calibration: Calibration | None) -> ModelSettings:
        self._require_model(model)
        cal: Calibration = calibration or {}
        weights = cal.get("weights_bytes")
        per_unit = cal.get("bytes_per_unit", cal.get("bytes_per_item"))
        if weights is not None and per_unit is not None:
            self._memory_models[model] = (int(weights), float(per_unit))
        if cal.get("cost_unit"):
            self._cost_units[model] = str(cal["cost_unit"])
        self._replicas[model][replica_id] = self._clock()
        if cal.get("enforcement"):  # cgroup, rlimit+watch, fraction+watch, watch (gpubroker.deployments.enforce.watch)
            self._enforcement.setdefault(model, {})[replica_id] = str(cal["enforcement"])
        self._log_event(
            EntryKind.REGISTER,
            f"{model} replica {replica_id} registered"
            + (
                f": weights {format_size(weights)}, {per_unit:.0f} B/unit"
                if weights is not None and per_unit is not None
                else ""
            ),
            model=model,
        )
        return self._settings[model]

    def report(self, rep: StatsReport) -> ModelSettings:
        """One replica's delta in, its current settings out (the same round trip for every
        replica, live or simulated)."""
        self._require_model(rep.model)
        self.metrics.observe_report(rep)
        now = self._clock()
        self._window.add(rep, now)
        if rep.engine and rep.model in self._llm_models:
            self._engines.add(rep.model, rep.replica_id, rep.engine, now)
        self._replicas[rep.model][rep.replica_id] = now
        self._replica_free[rep.replica_id] = (now, rep.device_free_frac, rep.sm_util_frac)
        tallies = self._tallies[rep.model]
        if rep.completions or rep.rejections or rep.timeouts or rep.errors:  # an idle report adds nothing to the sums
            tallies.add(Tally(now, rep.completions, rep.rejections + rep.timeouts + rep.errors))
        tallies.evict_older(now, self._cfg.models[rep.model].control.window_s)
        ev = self._events[rep.model]
        ev["emergency_shrinks"] += rep.emergency_shrinks
        ev["oom_splits"] += rep.oom_splits
        return self._settings[rep.model]

    def report_rejections(self, counts: Mapping[str, int]) -> RejectionsCounted:
        """Rejections the ingress made itself (Serve's queue full, a replica gone): counted like a
        replica's own in status, the window and the metrics. Unknown models are ignored."""
        now = self._clock()
        taken: dict[str, int] = {}
        for model, n in counts.items():
            if model not in self._cfg.models or int(n) <= 0:
                continue
            self._window.add_rejections(model, int(n), now)
            self._tallies[model].add(Tally(now, 0, int(n)))
            self.metrics.observe_rejections(model, int(n))
            taken[model] = int(n)
        return {"counted": taken}

    def _require_model(self, model: str) -> None:
        if model not in self._cfg.models:
            raise KeyError(f"unknown model '{model}'; the broker manages {', '.join(self._cfg.models)}")

    # ---------------------------------------------------------------- slow loop
    def _gpu_load(self, now: float) -> GpuLoad:
        used = 0
        snap = self._last_snapshot
        if snap is not None:
            used = sum(m.mem_used_bytes for m in snap.models.values())
        fresh = [(f, s) for (t, f, s) in self._replica_free.values() if now - t <= REPLICA_STALE_S]
        sms = [s for _, s in fresh if s is not None]
        measured = max(0.0, 1.0 - used / self._capacity) if self._capacity else 1.0
        on_card = self._cfg.gpu.device.startswith("cuda") or (self._cfg.gpu.device == "auto" and bool(sms))
        if not on_card:
            # Host quotas: a replica reports the free share of *its own grant* (its fast loop's
            # business); the pool's free share is what the replicas' measured use leaves.
            free_frac = measured
        else:  # on a card every replica reads the same NVML free share; take the most recent low
            frees = [f for f, _ in fresh if f is not None]
            free_frac = min(frees) if frees else measured
        return GpuLoad(self._capacity, self._usable, used, free_frac, max(sms) if sms else None)

    def tick(self) -> TickResult:
        """One control step: snapshot -> decide -> settings table -> checkpoint -> decision log."""
        started = time.perf_counter()
        now = self._clock()
        gpu = self._gpu_load(now)
        slack = active_profile(self._cfg.profiles, now).latency_slack
        slo_ms = {name: spec.slo_p95_ms * slack for name, spec in self._cfg.models.items()}
        snap = self._window.snapshot(now, gpu, dict(self._memory_models), slo_ms)
        # Recompute used from this snapshot (the first _gpu_load used the previous one).
        used = sum(m.mem_used_bytes for m in snap.models.values())
        if used != gpu.used_bytes:
            gpu = replace(gpu, used_bytes=used)
            snap = replace(snap, gpu=gpu)
        if self._llm_models:
            snap = replace(snap, engines=self._engines.views(self._llm_models, now))
        decision, new_state = policy.decide(snap, self._cfg, self._state)
        self._state = new_state
        for entry, line in decision.log:
            self._append(entry, line)  # engine bounds inside the new grants, before the settings table
        self._last_snapshot, self._last_decision = snap, decision
        self._ticks += 1
        self._last_tick_s = now
        dry = self._cfg.broker.dry_run
        changed: list[str] = []
        for name, md in decision.models.items():
            if name not in self._settings:
                continue
            old = self._settings[name]
            differs = _settings_fields(md) != _settings_fields(old)  # the wire object is built only then
            if md.changed or (differs and settings_view(md) != settings_view(old)):
                self._append(*settings_entry(now, name, old, wire_settings(name, md), md, snap.models.get(name), dry))
            if differs and not dry:
                self._settings[name] = wire_settings(name, md)  # version from the policy: bumps only on change
                changed.append(name)
        for move in decision.moves:
            self._append(
                {
                    "kind": EntryKind.MOVE,
                    "time_s": now,
                    "model": move.recipient or move.donor,
                    "move": move.kind,
                    "donor": move.donor,
                    "recipient": move.recipient,
                    "amount_bytes": move.amount_bytes,
                    "reason": move.reason,
                    "dry_run": dry,
                },
                f"quota {move.kind}: {move.donor or '-'} -> {move.recipient or '-'} {format_size(move.amount_bytes)} ({move.reason})",
            )
        for note in decision.notes:
            self._log_event(EntryKind.NOTE, note)
        self._check_grants()
        self.checkpoint_now()
        if not isinstance(self.metrics, NullMetrics):  # NullMetrics records nothing: no status() to build
            self.metrics.observe_tick(decision, self.status(), time.perf_counter() - started)
        return {"ok": True, "now_s": now, "changed": changed, "profile": decision.profile, "dry_run": dry}

    def _check_grants(self) -> None:
        """Settings' grants within usable, and sum of max(grant + in flight, measured use) <= usable."""
        used = {n: m.mem_used_bytes for n, m in getattr(self._last_snapshot, "models", {}).items()}
        total = sum(s.grant_bytes for s in self._settings.values())
        over = (
            [f"sum of grants {format_size(total)} exceeds usable {format_size(self._usable)}"]
            if total > self._usable
            else []
        )
        for problem in over + holding_problems(self._state.ledger, used):
            self._log_event(EntryKind.INVARIANT, problem)

    # ---------------------------------------------------------------- decision log
    def _append(self, entry: DecisionRecord, line: str) -> None:
        if self.card_id:
            entry = cast(DecisionRecord, {**entry, "card": self.card_id})
        self._log.append(entry, line)

    def _log_event(self, kind: EntryKind, message: str, model: str | None = None) -> None:
        self._append({"kind": kind, "time_s": self._clock(), "model": model, "reason": message}, f"[{kind}] {message}")

    def decisions(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]:
        return self._log.since(model, since_seq)

    # ---------------------------------------------------------------- apply
    def apply(self, config_text: str) -> ApplyResult:
        """``_apply`` and the reload metrics (success, time, failures, config hash in force)."""
        out = self._apply(config_text)
        self.metrics.observe_reload(bool(out["ok"]), str(out["config_hash"]))
        return out

    def _apply(self, config_text: str) -> ApplyResult:
        """Validate and swap in a new config; on any problem the running one stays."""
        old_hash = self._config_hash
        try:
            cfg = parse_config_text(config_text, "apply")
        except ConfigError as exc:
            return {"ok": False, "config_hash": old_hash, "issues": [str(i) for i in exc.issues]}
        issues = redeploy_issues(self._cfg, cfg) + weights_issues(cfg, self._memory_models)
        if issues:
            self._log_event(EntryKind.APPLY, f"refused config {cfg.config_hash()}: {'; '.join(issues)}")
            return {"ok": False, "config_hash": old_hash, "issues": issues}
        if cfg.config_hash() == old_hash:
            return {"ok": True, "config_hash": old_hash, "issues": [], "notes": ["config unchanged"]}
        try:
            usable = cfg.usable_bytes(self._capacity)
            total_base = sum(m.quota.base for m in cfg.models.values())
            if total_base > usable:
                raise ValueError(f"sum of quota.base {format_size(total_base)} exceeds usable {format_size(usable)}")
            state = policy.reconfigure_state(self._state, cfg, usable, self._clock())  # lowers first; may raise
            state.ledger.check()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the old config in place
            self._log_event(EntryKind.APPLY, f"refused config {cfg.config_hash()}: {exc}")
            return {"ok": False, "config_hash": old_hash, "issues": [str(exc)]}
        notes = next_up_notes(self._cfg, cfg)
        old_window = self._window
        self._install(cfg, config_text)
        if hasattr(old_window, "reconfigure"):  # keep the report history where the window allows it
            old_window.reconfigure(cfg)
            self._window = old_window
        self._log.resize(cfg.broker.decision_log_size)
        self._state = state
        for name in cfg.models:
            self._settings[name] = self._policy_settings(state, name)
        self._log_event(
            EntryKind.APPLY, f"config {old_hash} -> {self._config_hash}" + (f" ({'; '.join(notes)})" if notes else "")
        )
        self.checkpoint_now()
        return {"ok": True, "config_hash": self._config_hash, "issues": [], "notes": notes}

    # ---------------------------------------------------------------- checkpoint
    def checkpoint_now(self) -> CardCheckpoint:
        if self._checkpoint is None:
            return {"ok": False, "path": None}
        ckpt = Checkpoint(
            config_text=self._config_text,
            config_hash=self._config_hash,
            launch_hash=self._launch_hash,
            policy_state=self._state.to_dict(),
            settings={k: v.to_dict() for k, v in self._settings.items()},
            memory_models={k: [v[0], v[1]] for k, v in self._memory_models.items()},
            cost_units=dict(self._cost_units),
            decisions=list(self._log.entries)[-CHECKPOINT_DECISIONS:] if self._owns_log else [],
            decision_seq=self._log.seq,
            saved_at_s=self._clock(),
        )
        self._checkpoint.save(ckpt)
        return {"ok": True, "path": str(self._checkpoint.path), "saved_at_s": ckpt.saved_at_s}

    # ---------------------------------------------------------------- status
    def _profile_name(self) -> str:
        return (
            self._last_decision.profile if self._last_decision is not None else self._cfg.profiles.default_profile.name
        )

    def _profile(self) -> Any:
        """The profile in force (the last tick's; the default before the first)."""
        by_name = {p.name: p for p in self._cfg.profiles.schedule}
        return by_name.get(self._profile_name(), self._cfg.profiles.default_profile)

    def _enforcement_of(self, name: str, seen: dict[str, float], now: float) -> str:
        """The memory layers of the model's live replicas (docs/ENFORCEMENT.md), "" before any registered."""
        live = self._enforcement.get(name, {}).items()
        return "/".join(sorted({k for r, k in live if now - seen.get(r, float("-inf")) <= REPLICA_STALE_S}))

    def status(self) -> BrokerStatus:
        now = self._clock()
        snap = self._last_snapshot
        price = self._profile().price_per_gpu_hour
        models: dict[str, ModelStatus] = {}
        for name, spec in self._cfg.models.items():
            s = self._settings[name]
            load = snap.models.get(name) if snap is not None else None
            window_s, tallies = spec.control.window_s, self._tallies[name]
            tallies.evict_older(now, window_s)
            completions, misses = tallies.completions, tallies.misses
            seen = self._replicas.get(name, {})
            models[name] = {
                "grant_bytes": s.grant_bytes,
                "base_bytes": spec.quota.base,
                "used_bytes": load.mem_used_bytes if load else 0,
                "max_batch_size": s.max_batch_size,
                "batch_wait_timeout_s": s.batch_wait_timeout_s,
                "batch_unit": spec.batch.unit,
                "queue_depth": load.queue_depth if load else 0,
                "p50_ms": finite(load.p50_ms) if load else None,
                "p95_ms": finite(load.p95_ms) if load else None,
                "p99_ms": finite(load.p99_ms) if load else None,
                "slo_p95_ms": spec.slo_p95_ms * self._profile().latency_slack,
                "attainment": load.attainment
                if load
                else None,  # gpubroker.broker.control.attainment, as the policy sees it
                "completions": completions,
                "misses": misses,
                "arrival_rate_rps": load.arrival_rate_rps if load else 0.0,
                "completion_rate_rps": load.completion_rate_rps if load else 0.0,
                "settings_version": s.version,
                "replicas": sum(1 for t in seen.values() if now - t <= REPLICA_STALE_S),
                "admit": s.admit,
                "cost_per_1k_requests": cost_per_1k_requests(  # card-hours its grant holds (gpubroker.broker.control.cost) over its window
                    price, s.grant_bytes, self._usable, min(window_s, now - self._started_s), completions
                ),
                "cost_unit": self._cost_units.get(name, spec.batch.unit),
                "calibrated": name in self._memory_models,
                "emergency_shrinks": self._events[name]["emergency_shrinks"],
                "oom_splits": self._events[name]["oom_splits"],
            }
            memory = policy.memory_view(load, spec, s.grant_bytes)  # why a cap is low
            models[name]["memory_ceiling"], models[name]["fixed_bytes"] = (
                memory["memory_ceiling"],
                memory["fixed_bytes"],
            )
            if spec.kind == "llm":  # "engine": bounds, TTFT/TPOT, KV blocks (gpubroker.broker.control.llm_window)
                models[name]["kind"] = "llm"
                models[name]["engine"] = engine_status(self._engines, name, spec, self._state.engines.get(name), now)
            if enforcement := self._enforcement_of(name, seen, now):  # absent until a replica said
                models[name]["enforcement"] = enforcement
        gpu = snap.gpu if snap is not None else None
        return {
            "config_hash": self._config_hash,
            "launch_hash": self._launch_hash,
            "profile": self._profile_name(),
            "price_per_gpu_hour": price,
            "dry_run": self._cfg.broker.dry_run,
            "device": self._cfg.gpu.device,
            "now_s": now,
            "capacity_bytes": self._capacity,
            "usable_bytes": self._usable,
            "granted_bytes": sum(m["grant_bytes"] for m in models.values()),
            "used_bytes": gpu.used_bytes if gpu else 0,
            "free_frac": gpu.free_frac if gpu else None,
            "ticks": self._ticks,
            "last_tick_s": self._last_tick_s,
            "restored": self.restored,
            "checkpoint_path": str(self._checkpoint.path) if self._checkpoint else None,
            "decision_seq": self._log.seq,
            "models": models,
        }

    @property
    def config(self) -> FleetConfig:
        return self._cfg

    def replica_target(self, model: str) -> int:
        """How many replicas ``model`` should run on this card (its configured count before its first decision)."""
        return replica_target(self._state.replicas, model, self._cfg.models[model].replicas)

    @property
    def replica_changes(self) -> tuple[ReplicaChange, ...]:
        """The replica targets its last tick changed (the fleet logs them once every card ticked)."""
        return () if self._last_decision is None else self._last_decision.replicas

    def settings(self, model: str) -> ModelSettings:
        self._require_model(model)
        return self._settings[model]
