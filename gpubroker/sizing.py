"""The quota a model's measured profile asks for: what ``gpubroker calibrate`` suggests.

A replica's grant counts more than the model's modelled bytes (weights + bytes per item x batch).
On host memory (``gpu.device: cpu``) the replica measures its process's resident memory over what
it held just before the model loaded (``gpubroker.deployments.replica.deployment``), so the grant
also pays for:

- **the process's own footprint beside the model**: what loading and running the model adds
  beyond its weights (the model's module and its imports, torch's first runs, allocator pools).
  ``gpubroker calibrate`` measures it in its own process, the same way (resident memory after
  torch is imported, before the model loads, against after its runs);
- **the Ray Serve replica's runtime**: what a replica holds for serving beyond its load (request
  objects, buffers and threads of Ray's core worker, Serve's batcher), which a process without
  Ray cannot measure: ``REPLICA_RUNTIME_BYTES``, measured on a live replica
  (bench/notes/calibrate-footprint.md); ``gpubroker calibrate --runtime SIZE`` replaces it.

On a card (``cuda:N``) the replica measures the card's bytes for its pid over the CUDA context,
which ``gpu.context_overhead`` already takes from the card; both parts are 0 there.

Each of min, base and max then keeps the share of the grant that the replica's fast loop and the
broker's memory model keep free (``gpu.emergency_free_frac``; ``SLACK_UNMEASURED`` until a replica
has reported), so a replica at its suggested quota is not already in a memory emergency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpubroker.broker.control.memory_model import SLACK_UNMEASURED
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.sizes import format_size

MiB = 1024**2
# What a Ray Serve replica on host memory holds for serving beyond its load-time footprint, up to
# its default max_queued (256) requests in flight, with a third more for growth under sustained load
# (bench/notes/calibrate-footprint.md has the measurements and the command).
REPLICA_RUNTIME_BYTES = 48 * MiB


@dataclass(frozen=True)
class Footprint:
    """What a replica process holds beside its model's modelled bytes, on the memory its grant counts."""

    process_bytes: int  # measured: loading and running the model, beyond its weights (imports, pools)
    runtime_bytes: int  # the Ray Serve replica's runtime while it serves (REPLICA_RUNTIME_BYTES on cpu)

    @property
    def total_bytes(self) -> int:
        return self.process_bytes + self.runtime_bytes


NO_FOOTPRINT = Footprint(0, 0)


def kept_free_frac(cfg: FleetConfig) -> float:
    """The share of a grant a replica keeps free: its fast loop's emergency line and the broker's
    slack before any report, whichever is larger."""
    return max(cfg.gpu.emergency_free_frac, SLACK_UNMEASURED)


def runtime_bytes_for(device: str) -> int:
    """The runtime part for a replica on ``device``: host memory counts it, a card does not."""
    return 0 if device.startswith("cuda") else REPLICA_RUNTIME_BYTES


@dataclass(frozen=True)
class QuotaSuggestion:
    """The quota a profile asks for under a P95 cap C, by BENCHMARK.md's limit: a request waits
    at most one batch and runs in the next, so the largest batch within C is b* = (C/2 - a)/c.
    min holds the batch floor, base b*, max the largest batch that runs within C alone, (C - a)/c.
    Each is (footprint + weights + bytes_per_item x batch) / (1 - free_frac), rounded up to MiB."""

    slo_p95_ms: float
    batch_at_slo: int  # b*, within [floor, ceiling]
    batch_alone: int  # (C - a)/c, within [b*, ceiling]
    min_bytes: int  # each rounded up to MiB
    base_bytes: int
    max_bytes: int
    weights_bytes: int = 0  # the parts, for the operator to see why
    bytes_per_item: float = 0.0
    process_bytes: int = 0
    runtime_bytes: int = 0
    free_frac: float = 0.0


def quota_bytes(footprint: Footprint, weights_bytes: int, bytes_per_item: float, batch: int, free_frac: float) -> int:
    """The grant that holds a batch with the footprint beside it and ``free_frac`` of it free, in whole MiB."""
    held = footprint.total_bytes + weights_bytes + bytes_per_item * batch
    return int(math.ceil(held / (1.0 - free_frac) / MiB)) * MiB


def suggest_quota(
    a_ms: float,
    c_ms: float,
    weights_bytes: int,
    bytes_per_item: float,
    spec: ModelSpec,
    slo_ms: float | None = None,
    footprint: Footprint = NO_FOOTPRINT,
    free_frac: float = 0.0,
) -> QuotaSuggestion:
    """The suggestion for L(b) = a + c*b and memory weights + bytes_per_item*b beside ``footprint``
    (default cap: slo_p95_ms)."""
    if not 0.0 <= free_frac < 1.0:
        raise ValueError(f"free_frac must be in [0, 1), got {free_frac}")
    cap = slo_ms or spec.slo_p95_ms
    floor, ceiling = spec.batch.floor, spec.batch.ceiling
    per = max(c_ms, 1e-9)
    at_slo = int(min(ceiling, max(floor, (cap / 2 - a_ms) / per)))
    alone = int(min(ceiling, max(at_slo, (cap - a_ms) / per)))

    def mem(batch: int) -> int:
        return quota_bytes(footprint, weights_bytes, bytes_per_item, batch, free_frac)

    return QuotaSuggestion(
        cap,
        at_slo,
        alone,
        mem(floor),
        mem(at_slo),
        mem(alone),
        weights_bytes,
        bytes_per_item,
        footprint.process_bytes,
        footprint.runtime_bytes,
        free_frac,
    )


def least_quota_bytes(cfg: FleetConfig, spec: ModelSpec) -> int:
    """The least grant one replica of ``spec`` can serve with before its own model is counted
    beyond a profile's weights: Ray Serve's runtime (on host memory) and the profile's weights,
    with the share kept free."""
    weights = spec.profile.weights_bytes if spec.profile is not None and spec.profile.weights_bytes else 0
    return quota_bytes(Footprint(0, runtime_bytes_for(cfg.gpu.device)), int(weights), 0.0, 0, kept_free_frac(cfg))


def quota_warnings(cfg: FleetConfig) -> list[str]:
    """One line per request-batching model on host memory whose quota max, per replica, is under
    ``least_quota_bytes``: its replica would find its grant full before its first batch and pause
    admission (503) until ``up``'s wait runs out. The line names the size to use."""
    if cfg.gpu.device != "cpu":
        return []
    out = []
    for name, spec in cfg.models.items():
        if spec.kind != "batch":
            continue
        least = least_quota_bytes(cfg, spec)
        per_replica = spec.quota.max // max(1, spec.replicas)
        if per_replica < least:
            out.append(
                f"models.{name}.quota.max: {format_size(per_replica)} per replica is under what a replica "
                f"process holds on host memory beside its model (Ray Serve's runtime, "
                f"{format_size(REPLICA_RUNTIME_BYTES)}, with {kept_free_frac(cfg):g} kept free): its grant would fill "
                f"as it serves (503 memory emergency, or no 200 for `up`'s first request); give it at least {format_size(least)} per replica, or run "
                f"`gpubroker calibrate CONFIG {name}` for the quota its model needs"
            )
    return out
