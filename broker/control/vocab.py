"""Closed vocabularies of the broker: rule names, trigger metrics, decision and move kinds.

StrEnums, so every value *is* its string: ``json.dumps``, Prometheus labels, f-strings and
``==`` against a plain string all see the same text the broker wrote before these existed.
Pure: nothing here imports anything of ours.
"""

from __future__ import annotations

from enum import StrEnum


class Rule(StrEnum):
    """A batch rule of ``gpubroker.broker.control.batch_rules`` (the rows of docs/RULES.md), plus ``held``."""

    STATIC = "static"  # control.strategy static: never moves
    EMERGENCY = "emergency"  # free memory under gpu.emergency_free_frac (or the replica shrank): halve
    P95_QUEUEING = "p95_queueing"  # P95 near the cap with a backlog: grow (the latency is queueing)
    P95_HIGH = "p95_high"  # P95 near the cap without a backlog: shrink multiplicatively
    IDLE = "idle"  # no arrivals for idle_hold_s: go to the floor
    SM_BUSY = "sm_busy"  # SM utilisation near 100% with P95 rising: hold
    SM_LOW = "sm_low"  # SM utilisation low with work waiting: grow by a step
    QUEUE_HIGH = "queue_high"  # queue above the dead band's top: scale up in proportion
    QUEUE_LOW = "queue_low"  # queue below the dead band's bottom: scale down in proportion
    P95_LOW = "p95_low"  # P95 well under the cap with a backlog: grow by a step
    LOW_LOAD = "low_load"  # too few arrivals for the wait to gather a batch: the wait goes to wait.min_ms
    MODEL = "model"  # the latency model's plan (L(b) = a + c*b and the arrival rate)
    HOLD = "hold"  # nothing to do: keep the cap (last row of every rule set)
    HELD = "held"  # anti-oscillation (gpubroker.broker.control.policy) held a change back: not a table row


class Trigger(StrEnum):
    """The metric that drove a decision (``ModelDecision.trigger``, the log's ``trigger``)."""

    QUEUE_DEPTH = "queue_depth"
    P95_MS = "p95_ms"
    FREE_FRAC = "free_frac"
    ARRIVAL_RATE_RPS = "arrival_rate_rps"
    SM_UTIL_FRAC = "sm_util_frac"
    STATIC = "static"  # the static strategy's cap
    HOLD = "hold"


class MoveKind(StrEnum):
    """A quota ledger step (``QuotaMove.kind``, the log's ``move``; see gpubroker.broker.control.lending)."""

    LEND = "lend"  # an idle model's surplus to a memory-bound busy one (two-phase)
    RECLAIM = "reclaim"  # an owner takes its base back (two-phase from a loan, or the free pool)
    CONFIRM = "confirm"  # a donor runs its lowered grant and is under it: the transfer completes
    GROW = "grow"  # a busy model grows from the free pool
    RELEASE = "release"  # an idle borrower hands its loan back to the free pool
    ABORT = "abort"  # a transfer not confirmed within broker.transfer_timeout_s
    # a reclaim the borrower does not honour escalates (gpubroker.broker.control.lending's reclaim steps)
    RECLAIM_CACHE = "reclaim_cache"  # the borrower empties its allocator caches and re-measures
    RECLAIM_DRAIN = "reclaim_drain"  # the borrower pauses admission and lets running batches finish
    RECLAIM_RESTART = "reclaim_restart"  # the borrower's replicas restart


class EntryKind(StrEnum):
    """The ``kind`` of a decision-log entry (``BrokerCore`` and ``gpubroker.broker.control.decision_log``)."""

    SETTINGS = "settings"  # a model's settings changed (inputs, old, new, trigger, rule, reason)
    MOVE = "move"  # a quota move
    NOTE = "note"  # a policy note (profile switch, dead band widened)
    REGISTER = "register"  # a replica registered
    RESTORE = "restore"  # checkpoint restore, or why not
    APPLY = "apply"  # a config reload
    INVARIANT = "invariant"  # a broken invariant (sum of grants over usable)
    ENGINE = "engine"  # an LLM engine's bounds or rule changed (gpubroker.broker.control.llm_window: inputs, old, new, trigger, rule)
    REPLICAS = "replicas"  # a model's replica target changed on a card (gpubroker.broker.control.replica_targets: inputs, old, new, trigger, rule)


__all__ = ["EntryKind", "MoveKind", "Rule", "Trigger"]
