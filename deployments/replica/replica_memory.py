"""The replica's memory side (``gpubroker.deployments.replica.deployment.ModelReplica`` inherits it): the grant as an
OS or allocator limit (``gpubroker.deployments.enforce.limits``), re-asserted at every report; the measurement
layer that needs no cooperation (``gpubroker.deployments.enforce.watch``: the watcher thread, the watchdog process
and its cgroup, told every grant); the fast loop's reading of memory; and a replica that holds
over its grant (the limit keeps the runtime's slack; no batch runs; after ``HELD_RESTART_T`` x
``transfer_timeout_s`` it restarts itself).

Mixed into the Serve deployment class so its state stays the replica's own (``limiter``,
``probe``, ``settings``, ``delta``, ...); nothing here is used without ``ModelReplica``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpubroker.broker.control.violation import WATCH_SLACK_BYTES, WatchLimits
from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.replica.fast_loop import FastEvent, fast_loop_step
from gpubroker.deployments.replica.oom import HeldOverGrant

logger = logging.getLogger("ray.serve")

HELD_RESTART_T = 4  # a replica held over its grant restarts itself after this many transfer_timeout_s
# (after the broker's escalation of a reclaim, 3 T, so a reclaim always restarts through its own step)


class ReplicaMemory:
    """Memory methods of ``ModelReplica`` (see the module docstring)."""

    limiter: Any
    probe: Any
    settings: ModelSettings
    watch: Any  # gpubroker.deployments.enforce.watch.ReplicaWatch, None outside Serve
    watchdog: Any  # gpubroker.deployments.enforce.watch.WatchdogHandle, None outside Serve or when it did not start
    watch_baseline_bytes: int

    def _grant_per_replica(self, settings: ModelSettings) -> int:
        return max(1, settings.grant_bytes // max(1, self.card_replicas))

    def _enforce(self, settings: ModelSettings) -> None:
        grant = self._grant_per_replica(settings)
        self._note_grant(grant)
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
        self._sync_watchdog()

    # ------------------------------------------------------------------ the measurement layer
    def _start_watch(self) -> None:
        """The layer the model cannot lift (``gpubroker.deployments.enforce.watch``): the watchdog process (and its
        cgroup where the node allows) and the watcher thread. Started before the limiter, so the
        watchdog does not inherit the replica's soft limit; not for a replica outside Serve."""
        from gpubroker.deployments.enforce.watch import ReplicaWatch, WatchdogHandle, WatchReadings, end_own_process

        self.watch = self.watchdog = None
        self.lifted = ""  # set when the in-process limit is found lifted (``_reassert``)
        self._grant_floor: tuple[int, float] | None = None
        self._watch_sent: WatchLimits | None = None
        if not self.in_serve:
            return
        overhead = self.cfg.gpu.context_overhead_bytes(1, True) if self.on_cuda else 0
        self.watch_baseline_bytes = overhead if self.on_cuda else self.baseline_bytes
        try:
            self.watchdog = WatchdogHandle(self.name, self.device, self.watch_baseline_bytes)
        except OSError as exc:
            logger.warning("gpubroker replica %s: no watchdog process (%r): the watcher thread holds", self.name, exc)
        if self.watchdog is not None and not self.watchdog.cgroup:
            logger.warning(
                "gpubroker replica %s: no kernel memory limit (%s): the measurement layer holds",
                self.name,
                self.watchdog.why_not,
            )
        self._sync_watchdog()
        readings = WatchReadings(self._watch_used, self._watch_limits, lifted=lambda: self.lifted)
        self.watch = ReplicaWatch(self.name, readings, on_end=end_own_process)
        self.watch.start()

    def _watch_used(self) -> int | None:
        """What the watchers measure: resident memory over the pre-model baseline on the host;
        NVML's bytes for this pid over the CUDA context on a card."""
        from gpubroker.deployments.enforce.watch import host_used_bytes

        if not self.on_cuda:
            return host_used_bytes(None, self.watch_baseline_bytes)
        return max(0, self.limiter.read().resident_bytes - self.watch_baseline_bytes)

    def _note_grant(self, grant: int) -> None:
        """A lowered grant binds the watchers only after the broker's reclaim escalation had its
        time (``HELD_RESTART_T`` + 1 transfer timeouts): until then they hold the old one."""
        last = getattr(self, "_watched_grant", None)
        if last is not None and grant < last:
            bound_s = (HELD_RESTART_T + 1) * self.cfg.broker.transfer_timeout_s
            self._grant_floor = (last, time.monotonic() + bound_s)
        self._watched_grant = grant

    def _watch_limits(self) -> WatchLimits:
        grant = self._grant_per_replica(self.settings)
        floor = getattr(self, "_grant_floor", None)
        if floor is not None and time.monotonic() < floor[1]:
            grant = max(grant, floor[0])
        return WatchLimits(grant, WATCH_SLACK_BYTES)

    def _sync_watchdog(self) -> None:
        """Tell the watchdog the limits now (its cgroup limit follows), when they changed."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is None:
            return
        limits = self._watch_limits()
        if limits != self._watch_sent:
            watchdog.send(limits)
            self._watch_sent = limits

    def _reassert(self) -> None:
        """At every report: the in-process limit read back and set again; found lifted, the
        watcher declares a violation at its next reading."""
        try:
            lifted = self.limiter.reassert()
        except Exception as exc:  # noqa: BLE001 - a reading, never a failure
            logger.warning("gpubroker replica %s: limit re-assert failed: %r", self.name, exc)
            return
        if lifted and not self.lifted:
            self.lifted = lifted
            logger.warning("gpubroker replica %s: %s", self.name, lifted)
        self._sync_watchdog()

    def enforcement(self) -> str:
        """Which layers hold this replica: ``cgroup`` (a kernel limit, plus the others),
        ``rlimit+watch``, ``fraction+watch``, ``watch``; ``unenforced`` outside Serve."""
        if getattr(self, "watch", None) is None:
            return "unenforced"
        if self.watchdog is not None and self.watchdog.cgroup:
            return "cgroup"
        kind = str(getattr(self.limiter, "kind", ""))
        return {"rlimit_data": "rlimit+watch", "cuda_fraction": "fraction+watch"}.get(kind, "watch")

    def violation(self) -> str:
        """The watcher's declared violation ("" when none): new work is refused with it."""
        watch = getattr(self, "watch", None)
        return "" if watch is None else watch.violation

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
        # on a card the reading is the card's: a replica within its grant is not the one to stop
        within = self.on_cuda and self.mem_used_bytes <= self._grant_per_replica(self.settings)
        out = fast_loop_step(free, self.cap, target, self.paused, self.fast, within_grant=within)
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
