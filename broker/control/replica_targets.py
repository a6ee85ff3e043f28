"""Replica targets of one card: the replica rule (``gpubroker.broker.control.replica_rules``) for
each of its models, a step of ``gpubroker.broker.control.policy.decide`` after the quota plan.

A card's models are one Serve deployment per card, so a target is per card and model and reads
only that card's tick: the model's rate and live replicas (the snapshot), its latency fit and
its new grant (the tick's model states and ledger) and the active profile. The hysteresis lives
in ``PolicyState.replicas`` (not checkpointed: a restarted broker starts from the configured
counts). Changes come back as ``ReplicaChange`` for the decision log (``replicas_entry``). Pure:
time is the snapshot's ``now_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from gpubroker.broker.control.decision_log import finite
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.replica_rules import (
    LOWER_AFTER_WINDOWS,
    THROUGHPUT,
    ReplicaChange,
    ReplicaInputs,
    ReplicaParams,
    ReplicaState,
    decide,
    initial_state,
)
from gpubroker.broker.control.state import ModelState
from gpubroker.broker.control.types import FleetSnapshot, LogLine
from gpubroker.broker.control.vocab import EntryKind
from gpubroker.broker.wire import DecisionRecord
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import QuotaLedger
from gpubroker.quotas.schedule import ProfileSpec


class ReplicaStep(NamedTuple):
    """The replica rule's answer for one card's tick."""

    states: Mapping[str, ReplicaState]  # model -> its hysteresis after this tick (the next state's)
    changes: tuple[ReplicaChange, ...]  # the targets that changed, in config order


def model_inputs(
    name: str,
    spec: ModelSpec,
    snapshot: FleetSnapshot,
    ms: ModelState | None,
    ledger: QuotaLedger,
    profile: ProfileSpec,
) -> ReplicaInputs:
    """What the replica rule reads of one model after the tick's quota plan (``ms``: its state)."""
    load = snapshot.models.get(name)
    fit = ms.latency_fit if (ms is not None and spec.kind != "llm") else None  # LLM engines: configured count
    grant = ledger.grant(name) if name in ledger.quotas else spec.quota.base
    mem_cap = MemoryModel.from_load(load).cap_for(grant / max(1, spec.replicas)) if load is not None else None
    cap = spec.batch.ceiling if mem_cap is None else max(spec.batch.floor, min(spec.batch.ceiling, mem_cap))
    return ReplicaInputs(
        now_s=snapshot.now_s,
        configured=int(spec.replicas),
        live=int(load.replicas) if load is not None else 0,
        objective=str(profile.objective),
        arrival_rate_rps=float(load.arrival_rate_rps) if load is not None else 0.0,
        unit_per_request=max(float(load.cost_per_request), 1.0) if load is not None else 1.0,
        fit=fit,
        batch_cap=int(cap),
        slo_ms=spec.slo_p95_ms * profile.latency_slack,
    )


def step_replicas(
    config: FleetConfig,
    snapshot: FleetSnapshot,
    models: Mapping[str, ModelState],
    ledger: QuotaLedger,
    profile: ProfileSpec,
    states: Mapping[str, ReplicaState],
) -> ReplicaStep:
    """Each model's replica target after the quota plan (``models``, ``ledger``: the tick's).
    Under another objective than throughput every target is the configured count, so only a model
    not there yet is decided; a lower waits ``LOWER_AFTER_WINDOWS`` of the model's rate window."""
    out = dict(states)
    changes: list[ReplicaChange] = []
    for name, spec in config.models.items():
        st = states.get(name)
        if profile.objective != THROUGHPUT and (st is None or st == initial_state(spec.replicas)):
            continue
        inp = model_inputs(name, spec, snapshot, models.get(name), ledger, profile)
        params = ReplicaParams(lower_after_s=LOWER_AFTER_WINDOWS * float(spec.control.window_s))
        d, out[name] = decide(inp, st or initial_state(inp.configured), params)
        if d.changed:
            changes.append(ReplicaChange(name, inp, d))
    return ReplicaStep(out, tuple(changes))


def replica_target(states: Mapping[str, ReplicaState], name: str, configured: int) -> int:
    """The target of ``name`` (the configured count before its first decision)."""
    st = states.get(name)
    return configured if st is None else st.target


def replicas_entry(change: ReplicaChange, card: str, dry: bool) -> LogLine:
    """One replica-target change for the decision log: the entry and its log line (``card``: the
    card it names, "" in a one-card fleet)."""
    inp, d, name = change.inputs, change.decision, change.model
    entry: DecisionRecord = {
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


__all__ = ["ReplicaChange", "ReplicaStep", "model_inputs", "replica_target", "replicas_entry", "step_replicas"]
