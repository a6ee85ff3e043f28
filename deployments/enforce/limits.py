"""The in-process memory limits: the grant as a limit, not a number (the first of two layers).

Any code in the process can lift these (a soft RLIMIT_DATA up to the hard limit); ``reassert()``
reads the limit back at every report and sets it again, and one found lifted is a violation for
the measurement layer (``gpubroker.deployments.enforce.watch``), which holds without the model's cooperation.

A ``MemoryLimiter`` lives in one replica process. ``start()`` measures the process before the
model loads; ``set_grant(bytes)`` sets the limit (first before the model loads, then on every
grant change, up or down, at run time); past it an allocation fails with a catchable
out-of-memory error -- never a kill -- which ``gpubroker.deployments.replica.oom`` turns into split-and-retry.
docs/ENFORCEMENT.md says what each limit counts and what it does not, with measurements.

- ``CpuRlimitLimiter`` (``device: cpu``, Linux): ``setrlimit(RLIMIT_DATA, (soft, hard))`` with
  soft = the data size measured at ``start()`` + grant + slack (+ the stacks of threads started
  since: see ``thread_credit_bytes``); hard stays at the original hard limit, so an
  unprivileged process can raise soft again on a larger grant. A process holding over its grant
  (a grant lowered under what it holds, or a model grown into the slack) never gets soft at or
  under what it holds: soft stays at what is held + slack (``held_over``), so the runtime beside
  the model (Ray's core worker, Python) can still allocate, and the replica runs no batch until
  the process is under its grant again. The kernel (>= 4.7) counts the
  heap and private writable mappings (anonymous mmap included) against it: torch raises
  ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``, numpy/bytearray
  ``MemoryError``, mmap ``OSError(ENOMEM)``.
- ``CudaFractionLimiter`` (``device: cuda:N``): ``torch.cuda.set_per_process_memory_fraction
  (grant / total, N)``; every shrink also ``empty_cache()`` and re-measures. Readings: torch's
  reserved bytes, cross-checked with NVML's bytes for this pid
  (``nvmlDeviceGetComputeRunningProcesses``) and the pid's SM share
  (``nvmlDeviceGetProcessUtilization``) where the driver has it. Past the fraction torch raises
  ``torch.cuda.OutOfMemoryError``.
- ``UnenforcedLimiter``: platforms without ``RLIMIT_DATA`` (not Linux): records, says so.

``make_limiter(device)`` picks one. Both real limiters take the world as arguments (the
``resource`` module, /proc readers, a ``torch.cuda``-like object, an NVML probe) so unit tests
drive them with fakes.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from gpubroker.broker.capacity import cuda_index
from gpubroker.deployments.enforce import probes

logger = logging.getLogger("ray.serve")

MiB = 1024**2
DEFAULT_SLACK_BYTES = (
    32 * MiB
)  # room above the grant for the runtime beside the model (Ray's core worker, Python; at 16 MiB a replica that filled its grant saw Ray's own output buffers fail)
DEFAULT_THREAD_STACK_BYTES = 8 * MiB  # glibc's pthread stack when RLIMIT_STACK is unlimited or unknown


class LimiterKind(StrEnum):
    RLIMIT_DATA = "rlimit_data"  # cpu: the kernel's data-segment limit
    CUDA_FRACTION = "cuda_fraction"  # cuda: torch's caching allocator cap
    UNENFORCED = "unenforced"  # recorded only (no mechanism on this platform)


@dataclass(frozen=True)
class LimitReading:
    """The limit as set and the process as measured right after."""

    kind: LimiterKind
    grant_bytes: int | None  # grant the limit comes from (None: no limit)
    limit_bytes: int | None  # cpu: soft RLIMIT_DATA (absolute); cuda: fraction x total; None: unlimited
    used_bytes: int  # what the limit counts: cpu VmData over the baseline; cuda torch reserved bytes
    resident_bytes: int  # cpu: RSS of the process; cuda: NVML's bytes for this pid (0 when unlisted)
    fraction: float | None = None  # cuda: the per-process memory fraction set
    sm_util_frac: float | None = None  # cuda: this pid's SM share from NVML, None when unknown
    baseline_rss_bytes: int = 0  # cpu: RSS at start(), before the model loaded

    @property
    def headroom_bytes(self) -> int | None:
        """What the model may still allocate before an allocation fails (None: unlimited)."""
        if self.grant_bytes is None:
            return None
        return self.grant_bytes - self.used_bytes


class MemoryLimiter(Protocol):
    kind: LimiterKind
    grant_bytes: int | None
    # Bytes the process holds over its grant (None: not over it). While set, the replica runs no
    # batch: the limit keeps the runtime's slack above what is held.
    held_over: int | None

    def start(self) -> None:
        """Measure the process before the model loads (its baseline)."""

    def set_grant(self, grant_bytes: int | None) -> LimitReading:
        """Limit the model to ``grant_bytes`` (None lifts the limit); a shrink releases caches."""

    def refresh(self, after_oom: bool = False) -> None:
        """Cheap, per batch: keep the limit right as the runtime changes (cpu: thread stacks);
        ``after_oom``: the model was just refused, measure whether the process holds over its grant."""

    def reassert(self) -> str:
        """At every report: read the limit back and set it again; "" when it was as set, else one
        line saying what it was found at (a limit found lifted is a violation: ``gpubroker.deployments.enforce.watch``)."""

    def release_caches(self) -> None:
        """Give freed memory back to the OS / the device (after a shrink or an OOM)."""

    def read(self) -> LimitReading:
        """The limit and the process now."""


# ---------------------------------------------------------------------------------------------
# CPU: RLIMIT_DATA


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the kernel (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class CpuRlimitLimiter:
    """``RLIMIT_DATA`` over the process's measured data size (see the module docstring)."""

    kind = LimiterKind.RLIMIT_DATA

    def __init__(
        self,
        slack_bytes: int = DEFAULT_SLACK_BYTES,
        *,
        resource_mod: Any = None,
        status: Callable[[], dict[str, int]] = probes.proc_status_bytes,
        threads: Callable[[], int] = probes.thread_count,
        trim: Callable[[], None] = _malloc_trim,
    ):
        if resource_mod is None:
            import resource as resource_mod
        if slack_bytes < 0:
            raise ValueError(f"slack_bytes must be >= 0, got {slack_bytes}; use 0 for a limit exactly at the grant")
        self._res = resource_mod
        self._status = status
        self._threads = threads
        self._trim = trim
        self.slack_bytes = int(slack_bytes)
        self.grant_bytes: int | None = None
        self.limit_bytes: int | None = None
        self.baseline_data_bytes: int | None = None  # VmData at start()
        self.baseline_rss_bytes = 0
        self.baseline_threads = 0
        self.original: tuple[int, int] | None = None  # (soft, hard) RLIMIT_DATA at start()
        self.thread_stack_bytes = DEFAULT_THREAD_STACK_BYTES
        self.held_floor_bytes: int | None = None  # soft's floor while the process holds over its grant
        self.held_over: int | None = None  # bytes held over the grant, as last measured (None: under it)
        self._lock = threading.Lock()  # set (batch thread) and read back (report) one at a time

    def start(self) -> None:
        st = self._status()
        if "VmData" not in st:
            raise RuntimeError(
                "CpuRlimitLimiter needs /proc/self/status (VmData); on this platform use UnenforcedLimiter"
            )
        self.original = tuple(self._res.getrlimit(self._res.RLIMIT_DATA))
        self.baseline_data_bytes = st["VmData"]
        self.baseline_rss_bytes = st.get("VmRSS", 0)
        self.baseline_threads = self._threads()
        stack = threading.stack_size()
        if not stack:
            soft_stack = self._res.getrlimit(self._res.RLIMIT_STACK)[0]
            stack = soft_stack if 0 < soft_stack != self._res.RLIM_INFINITY else DEFAULT_THREAD_STACK_BYTES
        self.thread_stack_bytes = int(stack)

    def thread_credit_bytes(self) -> int:
        """Stacks of threads started since ``start()``: VmData counts each whole (reserved, not
        resident), so they are added to the limit rather than taken from the model's grant."""
        return max(0, self._threads() - self.baseline_threads) * self.thread_stack_bytes

    def soft_for(self, grant_bytes: int | None) -> int:
        """The soft limit for a grant: baseline + grant + slack + thread credit, at most hard."""
        assert self.original is not None and self.baseline_data_bytes is not None
        soft0, hard = self.original
        if grant_bytes is None:
            return soft0
        soft = self.baseline_data_bytes + int(grant_bytes) + self.slack_bytes + self.thread_credit_bytes()
        return soft if hard == self._res.RLIM_INFINITY else min(soft, hard)

    def _used(self, st: dict[str, int]) -> int:
        return max(0, st.get("VmData", 0) - (self.baseline_data_bytes or 0) - self.thread_credit_bytes())

    def _update_held(self) -> None:
        """Measure whether the process holds over its grant (lowered under what it held, or grown
        into the slack): after every grant change and every out-of-memory error, and after every
        batch while it holds over (a model grows into the slack until an allocation is refused,
        and the refusal is when it is measured; docs/ENFORCEMENT.md says what that misses).

        A soft limit at or under VmData refuses every allocation of the process, the runtime's
        included: Ray's output serializer then fails and the worker exits (a restart outside the
        broker's escalation). So while the process holds over its grant,
        soft's floor is what it holds + slack, lowered as it frees, never raised (the replica runs
        no batch meanwhile: nothing of the model's grows into the slack); the floor goes once the
        process is measured under its grant."""
        if self.grant_bytes is None:
            self.held_floor_bytes = self.held_over = None
            return
        st = self._status()
        over = self._used(st) - self.grant_bytes
        if over <= 0:
            self.held_floor_bytes = self.held_over = None
            return
        floor = st.get("VmData", 0) + self.slack_bytes
        self.held_floor_bytes = floor if self.held_floor_bytes is None else min(self.held_floor_bytes, floor)
        self.held_over = over

    def _apply(self, force: bool = False) -> None:
        assert self.original is not None
        soft = self.soft_for(self.grant_bytes)
        if self.held_floor_bytes is not None and soft < self.held_floor_bytes:  # (None whenever grant is None)
            hard = self.original[1]
            soft = self.held_floor_bytes if hard == self._res.RLIM_INFINITY else min(self.held_floor_bytes, hard)
        if force or soft != self.limit_bytes:
            with self._lock:
                self._res.setrlimit(self._res.RLIMIT_DATA, (soft, self.original[1]))
                self.limit_bytes = None if self.grant_bytes is None else soft

    def set_grant(self, grant_bytes: int | None) -> LimitReading:
        if grant_bytes is not None and grant_bytes < 0:
            raise ValueError(f"grant_bytes must be >= 0 or None, got {grant_bytes}")
        if self.original is None:
            self.start()
        old = self.grant_bytes
        self.grant_bytes = None if grant_bytes is None else int(grant_bytes)
        if old is not None and grant_bytes is not None and grant_bytes < old:
            self.release_caches()  # freed heap pages still count until trimmed: trim before the measure
        self._update_held()
        self._apply(force=True)
        return self.read()

    def refresh(self, after_oom: bool = False) -> None:
        if self.original is not None and self.grant_bytes is not None:
            if after_oom or self.held_floor_bytes is not None:
                self._update_held()
            self._apply()

    def reassert(self) -> str:
        """Read the soft RLIMIT_DATA back (getrlimit) and set it again. Any code in the process can
        raise its own soft limit up to hard: one found above what was set is reported ("lifted"),
        one found elsewhere (lowered, hard changed) is only set again."""
        with self._lock:
            limit = self.limit_bytes
            if self.original is None or self.grant_bytes is None or limit is None:
                return ""
            soft, hard = self._res.getrlimit(self._res.RLIMIT_DATA)
            if soft == limit and hard == self.original[1]:
                return ""
            try:
                self._res.setrlimit(self._res.RLIMIT_DATA, (limit, hard))
            except (ValueError, OSError) as exc:  # hard lowered under it by the process: keep what the kernel allows
                logger.warning("gpubroker: RLIMIT_DATA could not be set again to %d: %r", limit, exc)
        found = "unlimited" if soft == self._res.RLIM_INFINITY else f"{soft / MiB:.1f} MiB"
        lifted = soft == self._res.RLIM_INFINITY or soft > limit
        what = f"soft RLIMIT_DATA found at {found}, set at {limit / MiB:.1f} MiB: set again"
        logger.warning("gpubroker: %s", what)
        return f"the limit was lifted ({what})" if lifted else ""

    def release_caches(self) -> None:
        gc.collect()
        self._trim()

    def read(self) -> LimitReading:
        st = self._status()
        base = self.baseline_data_bytes or 0
        return LimitReading(
            kind=self.kind,
            grant_bytes=self.grant_bytes,
            limit_bytes=self.limit_bytes,
            used_bytes=max(0, st.get("VmData", 0) - base - self.thread_credit_bytes()),
            resident_bytes=st.get("VmRSS", 0),
            baseline_rss_bytes=self.baseline_rss_bytes,
        )

    def stop(self) -> None:
        """Restore the original limit (tests, shutdown)."""
        if self.original is not None:
            self._res.setrlimit(self._res.RLIMIT_DATA, self.original)
            self.grant_bytes = self.limit_bytes = self.held_floor_bytes = self.held_over = None


# ---------------------------------------------------------------------------------------------
# CUDA: torch's per-process memory fraction


class CudaFractionLimiter:
    """``set_per_process_memory_fraction`` from the grant; ``empty_cache`` on every shrink.

    ``cuda`` is ``torch.cuda`` (or a fake with the same functions); ``nvml`` an
    ``gpubroker.deployments.enforce.probes.NvmlProbe`` for this pid, or None (then NVML is tried at ``start()``)."""

    kind = LimiterKind.CUDA_FRACTION

    def __init__(self, index: int = 0, *, cuda: Any = None, nvml: Any = None, use_nvml: bool = True):
        self.index = int(index)
        self._cuda = cuda
        self._nvml = nvml
        self._use_nvml = use_nvml and nvml is None
        self.total_bytes = 0
        self.grant_bytes: int | None = None
        self.fraction: float | None = None
        self.started = False
        self.held_over: int | None = None  # a fraction under what is reserved fails torch's allocations only

    @property
    def cuda(self) -> Any:
        if self._cuda is None:
            import torch

            self._cuda = torch.cuda
        return self._cuda

    def start(self) -> None:
        self.total_bytes = int(self.cuda.get_device_properties(self.index).total_memory)
        if self._use_nvml:
            try:
                self._nvml = probes.NvmlProbe.for_torch_device(self.index)
            except Exception as exc:  # noqa: BLE001 - NVML missing: torch's numbers only
                logger.info("gpubroker: NVML unavailable (%r): per-process memory from torch only", exc)
                self._nvml = None
        self.started = True

    def fraction_for(self, grant_bytes: int | None) -> float:
        if grant_bytes is None:
            return 1.0
        return min(1.0, max(int(grant_bytes) / self.total_bytes, 1e-6))

    def set_grant(self, grant_bytes: int | None) -> LimitReading:
        if grant_bytes is not None and grant_bytes < 0:
            raise ValueError(f"grant_bytes must be >= 0 or None, got {grant_bytes}")
        if not self.started:
            self.start()
        fraction = self.fraction_for(grant_bytes)
        shrink = self.fraction is not None and fraction < self.fraction
        self.cuda.set_per_process_memory_fraction(fraction, self.index)
        self.grant_bytes = None if grant_bytes is None else int(grant_bytes)
        self.fraction = fraction
        if shrink:  # cached blocks above the new cap would keep the process over its grant
            self.release_caches()
        return self.read()  # the re-measure

    def refresh(self, after_oom: bool = False) -> None:
        return None

    def reassert(self) -> str:
        """Set the fraction again (torch has no getter to compare with: nothing is reported)."""
        if self.started and self.fraction is not None:
            self.cuda.set_per_process_memory_fraction(self.fraction, self.index)
        return ""

    def release_caches(self) -> None:
        gc.collect()  # tensors only the garbage collector still holds
        self.cuda.empty_cache()

    def read(self) -> LimitReading:
        reserved = int(self.cuda.memory_reserved(self.index))
        nvml_bytes, sm = 0, None
        if self._nvml is not None:
            try:
                nvml_bytes = int(self._nvml.process_bytes())
                sm = self._nvml.process_sm_util_frac()
            except Exception:  # noqa: BLE001 - a reading, never a failure
                pass
        limit = None if self.fraction is None or self.grant_bytes is None else int(self.fraction * self.total_bytes)
        return LimitReading(self.kind, self.grant_bytes, limit, reserved, nvml_bytes, self.fraction, sm)


# ---------------------------------------------------------------------------------------------


class UnenforcedLimiter:
    """No limit: the grant is recorded, the replica's checks still apply. For platforms without
    RLIMIT_DATA, and for a replica built outside Serve (in a test's own process, which a limit
    would outlive)."""

    kind = LimiterKind.UNENFORCED

    def __init__(self, reason: str = f"RLIMIT_DATA needs Linux, this is {sys.platform}") -> None:
        self.grant_bytes: int | None = None
        self.reason = reason
        self.held_over: int | None = None

    def start(self) -> None:
        logger.warning("gpubroker: no memory limit (%s): grants are not enforced", self.reason)

    def set_grant(self, grant_bytes: int | None) -> LimitReading:
        self.grant_bytes = grant_bytes
        return self.read()

    def refresh(self, after_oom: bool = False) -> None:
        return None

    def reassert(self) -> str:
        return ""

    def release_caches(self) -> None:
        gc.collect()

    def read(self) -> LimitReading:
        return LimitReading(self.kind, self.grant_bytes, None, 0, probes.rss_bytes() or 0)


def make_limiter(device: str, slack_bytes: int = DEFAULT_SLACK_BYTES, *, own_process: bool = True) -> MemoryLimiter:
    """The limiter for a replica on ``device`` ('cpu' or 'cuda:N', as ``detect_device`` gives).
    ``own_process=False`` (a replica built inside another program, e.g. a test): none."""
    if not own_process:
        return UnenforcedLimiter("the replica does not own its process (built outside Serve)")
    if device == "cpu":
        if sys.platform.startswith("linux"):
            return CpuRlimitLimiter(slack_bytes)
        return UnenforcedLimiter()
    return CudaFractionLimiter(cuda_index(device))
