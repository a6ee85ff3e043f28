"""Closed vocabularies of the fleet config: objectives, batch formations, control strategies.

StrEnums, so every value *is* its string: pydantic reads them from the YAML's plain strings,
``model_dump(mode="json")`` and ``json.dumps`` write the same strings, and ``==`` against a
plain string, dict lookups and f-strings all see the text the config holds.
"""

from __future__ import annotations

from enum import StrEnum


class Objective(StrEnum):
    """What a price profile asks of the batch plan (``profiles.schedule[].objective``)."""

    THROUGHPUT = "throughput"  # larger batches within the latency slack
    LATENCY = "latency"  # smaller batches, tight caps
    BALANCED = "balanced"


class BatchFormation(StrEnum):
    """How replicas form batches (``broker.batch_formation``)."""

    EAGER = "eager"  # Ray 2.60's @serve.batch as is: a batch closes a wait after its first request
    LAZY = "lazy"  # a gate holds requests while a batch runs; the next batch sizes itself to the load


class Strategy(StrEnum):
    """Which rule set moves a model's batch cap (``models.<name>.control.strategy``; docs/RULES.md)."""

    HYBRID = "hybrid"  # the model's plan guarded by the queue, P95 and SM rules
    QUEUE = "queue"  # queue dead band only
    AIMD = "aimd"  # P95 additive increase, multiplicative decrease
    MODEL = "model"  # the latency model's plan
    STATIC = "static"  # never moves
