"""Replica targets of a fleet: the replica rule (``gpubroker.broker.control.replica_rules``) for every model on every card.

After every card's core has ticked, ``ReplicaTargets.step`` reads what the tick left (rate, live
replicas, latency fit, grant, active profile) and decides a target per card and model (each card's
group is its own Serve deployment), with one ``kind: replicas`` log entry per change. The targets
live here; they are not checkpointed (a restarted broker starts from the configured counts). Each
card is read as a ``CardView`` (its config, its last tick's snapshot and policy state): the rules
read only those. Time is ``now_s``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from gpubroker.broker.control.decision_log import finite
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.profiles import active_profile
from gpubroker.broker.control.replica_rules import (
    LOWER_AFTER_WINDOWS,
    THROUGHPUT,
    ReplicaDecision,
    ReplicaInputs,
    ReplicaParams,
    ReplicaState,
    decide,
    initial_state,
)
from gpubroker.broker.control.state import PolicyState
from gpubroker.broker.control.types import FleetSnapshot
from gpubroker.broker.control.vocab import EntryKind
from gpubroker.quotas.config import FleetConfig


class CardView(NamedTuple):
    """What the replica rule reads of one card after its tick."""

    config: FleetConfig  # the card's config
    snapshot: FleetSnapshot | None  # its last tick's snapshot (None before the first)
    state: PolicyState | None  # its policy state after that tick


def card_inputs(
    card: CardView, now_s: float, only: Callable[[str, Any], bool] | None = None
) -> dict[str, ReplicaInputs]:
    """The replica rule's inputs for the models of one card, after its tick (``only``: the models,
    by name and spec, whose inputs are wanted; default every one)."""
    cfg, snap, state = card.config, card.snapshot, card.state
    profile = active_profile(cfg.profiles, now_s)
    out: dict[str, ReplicaInputs] = {}
    for name, spec in cfg.models.items():
        if only is not None and not only(name, spec):
            continue
        load = snap.models.get(name) if snap is not None else None
        ms = state.models.get(name) if state is not None else None
        fit = ms.latency_fit if (ms is not None and spec.kind != "llm") else None  # LLM engines: configured count
        grant = state.ledger.grant(name) if state is not None and name in state.ledger.quotas else spec.quota.base
        mem_cap = MemoryModel.from_load(load).cap_for(grant / max(1, spec.replicas)) if load is not None else None
        cap = spec.batch.ceiling if mem_cap is None else max(spec.batch.floor, min(spec.batch.ceiling, mem_cap))
        out[name] = ReplicaInputs(
            now_s=now_s,
            configured=int(spec.replicas),
            live=int(load.replicas) if load is not None else 0,
            objective=str(profile.objective),
            arrival_rate_rps=float(load.arrival_rate_rps) if load is not None else 0.0,
            unit_per_request=max(float(load.cost_per_request), 1.0) if load is not None else 1.0,
            fit=fit,
            batch_cap=int(cap),
            slo_ms=spec.slo_p95_ms * profile.latency_slack,
        )
    return out


@functools.lru_cache(maxsize=256)
def _params(window_s: float) -> ReplicaParams:
    return ReplicaParams(lower_after_s=LOWER_AFTER_WINDOWS * window_s)


def params_for(config: FleetConfig, model: str) -> ReplicaParams:
    """The hysteresis of one model: a lower waits ``LOWER_AFTER_WINDOWS`` of its rate window."""
    return _params(float(config.models[model].control.window_s))


def replicas_entry(
    inp: ReplicaInputs, d: ReplicaDecision, name: str, card: str, dry: bool
) -> tuple[dict[str, Any], str]:
    """One replica-target change for the decision log: the entry and its log line."""
    entry: dict[str, Any] = {
        "kind": EntryKind.REPLICAS,
        "time_s": inp.now_s,
        "model": name,
        "trigger": d.trigger,
        "rule": d.rule,
        "trigger_value": finite(d.trigger_value),
        "reason": d.reason,
        "inputs": {
            "objective": inp.objective,
            "arrival_rate_rps": round(inp.arrival_rate_rps, 3),
            "replicas": inp.live,
            "configured_replicas": inp.configured,
            "a_ms": None if inp.fit is None else round(inp.fit.a_ms, 3),
            "c_ms": None if inp.fit is None else round(inp.fit.c_ms, 4),
            "batch_cap": inp.batch_cap,
            "slo_p95_ms": round(inp.slo_ms, 1),
            "needed": d.needed,
        },
        "old": {"replica_target": d.old},
        "new": {"replica_target": d.target},
        "dry_run": dry,
    }
    if card:
        entry["card"] = card
    where = f"{name}@{card}" if card else name
    line = f"{where}: replica_target {d.old}->{d.target} [{d.trigger}={entry['trigger_value']}] {d.reason}" + (
        " (dry run)" if dry else ""
    )
    return entry, line


class ReplicaTargets:
    """The replica target of every (card, model); ``step`` once per fleet tick."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, str], ReplicaState] = {}

    def step(
        self, now_s: float, cards: Mapping[str, CardView], *, dry_run: bool, label_cards: bool
    ) -> list[tuple[dict[str, Any], str]]:
        """Decide every live card's models; the log entries of the targets that changed.
        ``label_cards``: entries carry ``card`` (a fleet of many cards)."""
        changes: list[tuple[dict[str, Any], str]] = []
        for cid, card in cards.items():
            only = None
            if active_profile(card.config.profiles, now_s).objective != THROUGHPUT:
                # off-peak every target is the configured count: only a model not there yet is decided
                def only(name: str, spec: Any, cid: str = cid) -> bool:
                    st = self.states.get((cid, name))
                    return st is not None and st != initial_state(spec.replicas)

            for name, inp in card_inputs(card, now_s, only).items():
                key = (cid, name)
                st = self.states.get(key) or initial_state(inp.configured)
                d, self.states[key] = decide(inp, st, params_for(card.config, name))
                if d.changed:
                    changes.append(replicas_entry(inp, d, name, cid if label_cards else "", dry_run))
        return changes

    def target(self, card: str, model: str, configured: int) -> int:
        """The target of ``model`` on ``card`` (the configured count before its first decision)."""
        st = self.states.get((card, model))
        return configured if st is None else st.target


__all__ = ["CardView", "ReplicaTargets", "card_inputs", "params_for", "replicas_entry"]
