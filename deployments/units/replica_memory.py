"""The replica's memory side (``deployments.replica.ModelReplica`` inherits it): the grant as an
OS or allocator limit (``deployments.enforce``), the fast loop's reading of memory, and a replica
that holds over its grant (the limit keeps the runtime's slack; no batch runs; after
``HELD_RESTART_T`` x ``transfer_timeout_s`` it restarts itself).

Mixed into the Serve deployment class so its state stays the replica's own (``limiter``,
``probe``, ``settings``, ``delta``, ...); nothing here is used without ``ModelReplica``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from broker.wire import ModelSettings
from deployments.units.fast_loop import FastEvent, fast_loop_step
from deployments.units.oom import HeldOverGrant

logger = logging.getLogger("ray.serve")

HELD_RESTART_T = 4  # a replica held over its grant restarts itself after this many transfer_timeout_s
# (after the broker's escalation of a reclaim, 3 T, so a reclaim always restarts through its own step)


class ReplicaMemory:
    """Memory methods of ``ModelReplica`` (see the module docstring)."""

    limiter: Any
    probe: Any
    settings: ModelSettings

    def _grant_per_replica(self, settings: ModelSettings) -> int:
        return max(1, settings.grant_bytes // max(1, self.card_replicas))

    def _enforce(self, settings: ModelSettings) -> None:
        grant = self._grant_per_replica(settings)
        try:
            # CUDA: set_per_process_memory_fraction (+ empty_cache on a shrink); cpu: RLIMIT_DATA.
            reading = self.limiter.set_grant(grant)
            logger.info("gpubroker replica %s: memory limit for grant %d: %s", self.name, grant, reading)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: limiter.set_grant(%d) failed: %r", self.name, grant, exc)
        try:
            self.adapter.set_memory_limit(grant)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: set_memory_limit(%d) failed: %r", self.name, grant, exc)

    # ------------------------------------------------------------------ fast loop
    def _read_memory(self) -> float | None:
        """Update used bytes and the free share; returns the free share the fast loop uses."""
        try:
            reading = self.probe.read()
        except Exception:  # noqa: BLE001 - no reading: no emergency decisions on it
            return None
        if self.on_cuda:
            self.mem_used_bytes = int(reading.process_bytes)
            free = reading.free_frac
        else:  # host quota: free share of this replica's grant
            self.mem_used_bytes = max(0, int(reading.process_bytes) - self.baseline_bytes)
            grant = self._grant_per_replica(self.settings)
            free = max(0.0, 1.0 - self.mem_used_bytes / grant)
        self.device_free_frac = free
        self.sm_util_frac = reading.sm_util_frac
        self.delta.mem_peak_bytes = max(self.delta.mem_peak_bytes, self.mem_used_bytes)
        return free

    def _fast_loop(self) -> None:
        free = self._read_memory()
        self.limiter.refresh()
        target = self.oom_ceiling.target(self.settings.max_batch_size)
        out = fast_loop_step(free, self.cap, target, self.paused, self.fast)
        if out.cap != self.cap:
            self.cap = out.cap
            self._batch.set_max_batch_size(out.cap)
        self.paused = out.paused
        if out.counted:
            self.delta.emergency_shrinks += 1
        if out.event in (FastEvent.SHRINK, FastEvent.PAUSE) and out.counted:
            logger.warning(
                "gpubroker replica %s: free %.1f%% < %.1f%%: %s, batch cap %d",
                self.name,
                100 * (free or 0.0),
                100 * self.fast.emergency_free_frac,
                out.event,
                out.cap,
            )

    def _held_over_grant(self) -> HeldOverGrant | None:
        """The process holds more than its grant, by the limiter's count (host: VmData, the
        limit's own) and by the broker's (resident memory over the baseline): the batch is refused
        before the model, whose next allocation would take the runtime's slack.

        A reclaim or release under it escalates in the broker (caches, drain, restart: 3 T). A
        replica held over with no such transfer (a model that keeps what it allocates, at its own
        grant) restarts itself once its batches have been refused for ``HELD_RESTART_T`` x T (it
        is checked as batches come): its check_health fails from then on (sticky, as the broker's
        restart), Serve replaces it, the new process holds nothing."""
        over = getattr(self.limiter, "held_over", None)
        grant = self._grant_per_replica(self.settings)
        if not over or self.mem_used_bytes <= grant:
            self.held_since = None
            return None
        now = time.monotonic()
        if self.held_since is None:
            self.held_since = now
        bound_s = HELD_RESTART_T * self.cfg.broker.transfer_timeout_s
        if not self.held_restart and now - self.held_since >= bound_s:
            self.held_restart = (
                f"model '{self.name}' holds {self.mem_used_bytes / 2**20:.1f} MiB, over its grant of "
                f"{grant / 2**20:.1f} MiB, for {bound_s:g}s: fail check_health so Serve restarts the replica"
            )
            logger.warning("gpubroker replica %s: %s", self.name, self.held_restart)
        return HeldOverGrant(self.name, int(self.mem_used_bytes), grant)

    def _held_after_oom(self) -> HeldOverGrant | None:
        """In the batch's thread, after an out-of-memory error: measure again (the limit's floor
        rises over what is held, so the runtime can allocate) and say whether the model must stop."""
        try:
            self.limiter.refresh(after_oom=True)
            self._read_memory()
            return self._held_over_grant()
        except MemoryError:  # not even room to measure: stop the model, the next batch measures again
            grant = self._grant_per_replica(self.settings)
            return HeldOverGrant(self.name, max(int(self.mem_used_bytes), grant + 1), grant)
