"""Memory probes: what a replica reads of its memory, the one module of ``deployments/`` that
touches pynvml and torch for a reading (both imported lazily).

A probe has ``read() -> MemoryReading`` and ``enforce(grant_bytes) -> None``:

- ``NvmlProbe(index, pid)``: card total/used from NVML, this process's bytes from the
  compute-process list, SM utilisation. NVML cannot cap a process: ``enforce`` records.
- ``TorchCudaProbe(index)``: torch's view of this process (allocated/reserved/peak);
  ``enforce`` sets ``torch.cuda.set_per_process_memory_fraction(grant / total)``.
- ``CudaProbe``: card numbers and SM util from NVML when it initialises, process bytes and
  enforcement from torch (what ``make_probe`` returns on cuda).
- ``HostProbe(capacity_bytes)``: CPU-only machines; RSS per process from /proc, the same
  ledger governs host memory. ``enforce`` records the limit (checked by ``over_limit``); what
  holds a replica to its grant is ``gpubroker.deployments.enforce.limits`` (RLIMIT_DATA), not this probe.

Readings the limiters of ``limits`` and the watchers of ``watch`` use (the limit itself is set
there): ``proc_status_bytes`` (VmData, VmRSS, RssAnon/RssFile/RssShmem from /proc/<pid>/status:
what ``RLIMIT_DATA`` counts beside what is resident), ``thread_count``, ``rss_bytes``, and on NVML
``NvmlProbe.process_bytes`` / ``NvmlProbe.process_sm_util_frac`` (this pid's memory and SM share
from ``nvmlDeviceGetComputeRunningProcesses`` / ``nvmlDeviceGetProcessUtilization``).

Its readers are on the Serve side: the replica (``gpubroker.deployments.replica.deployment``,
``make_probe``), a managed Serve deployment (``gpubroker.deployments.serve.managed``) and this room's
``limits`` and ``watch``. The device and the card's capacity come from ``gpubroker.broker.capacity``
(the broker actor reads the capacity too, and the broker never imports ``deployments``); this module
imports nothing else of ours. Policies never see a probe: the replica reads it and sends numbers
in its StatsReport.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from gpubroker.broker.capacity import cuda_index, device_name, host_total_bytes
from gpubroker.broker.capacity import nvml as nvml_lib


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: int  # capacity of the card (or the host-memory pool on cpu)
    used_bytes: int  # used now, all processes (cpu: the registered processes)
    process_bytes: int  # used by this replica process now
    free_frac: float  # free share of total_bytes, in [0, 1]
    sm_util_frac: float | None = None  # NVML SM utilisation in [0, 1]; None without a GPU


def _free_frac(total: int, used: int) -> float:
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - used / total))


# ---------------------------------------------------------------------------------------------
# NVML


class NvmlProbe:
    """Card memory and SM utilisation from NVML; this process's bytes from its process list."""

    def __init__(self, index: int = 0, pid: int | None = None, uuid: str | None = None):
        self.index = index  # NVML index (physical order, ignores CUDA_VISIBLE_DEVICES)
        self.pid = os.getpid() if pid is None else pid
        self.limit_bytes: int | None = None
        self._util_seen_us = 0  # newest process-utilisation sample already read (NVML µs timestamp)
        nvml = nvml_lib()
        if uuid:  # the card torch calls cuda:N, whatever CUDA_VISIBLE_DEVICES says
            self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        else:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def for_torch_device(cls, index: int = 0, pid: int | None = None) -> NvmlProbe:
        """The NVML view of torch's cuda:index (matched by UUID when torch reports one)."""
        uuid = None
        try:
            import torch

            raw = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            if raw is not None:
                text = str(raw)
                uuid = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
        except Exception:
            uuid = None
        if uuid is not None:
            try:
                return cls(index, pid, uuid=uuid)
            except Exception:
                pass
        return cls(index, pid)

    def process_bytes(self) -> int:
        """Bytes NVML attributes to ``pid`` (0 when not listed, e.g. in another pid namespace)."""
        nvml = nvml_lib()
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except nvml.NVMLError:
            return 0
        used = 0
        for proc in procs:
            if proc.pid == self.pid:
                used += int(proc.usedGpuMemory or 0)  # None when the driver does not say
        return used

    def process_sm_util_frac(self) -> float | None:
        """This pid's SM share in [0, 1] from ``nvmlDeviceGetProcessUtilization`` (samples since the
        previous call); 0.0 when the pid has no sample, None where the driver does not say."""
        nvml = nvml_lib()
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self._handle, self._util_seen_us)
        except (nvml.NVMLError, AttributeError):  # not supported, or no sample since the timestamp
            return None
        mine = [s for s in samples if s.pid == self.pid]
        if samples:
            self._util_seen_us = max(int(s.timeStamp) for s in samples)
        if not mine:
            return 0.0
        return min(1.0, max(0.0, sum(float(s.smUtil) for s in mine) / len(mine) / 100.0))

    def sm_util_frac(self) -> float | None:
        nvml = nvml_lib()
        try:
            return float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100.0
        except nvml.NVMLError:
            return None

    def card(self) -> tuple[int, int]:
        info = nvml_lib().nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.total), int(info.used)

    def read(self) -> MemoryReading:
        total, used = self.card()
        return MemoryReading(total, used, self.process_bytes(), _free_frac(total, used), self.sm_util_frac())

    def enforce(self, grant_bytes: int | None) -> None:
        self.limit_bytes = grant_bytes  # NVML cannot cap a process; the torch probe does


# ---------------------------------------------------------------------------------------------
# torch.cuda


class TorchCudaProbe:
    """This process as torch's caching allocator sees it; enforcement by memory fraction."""

    def __init__(self, index: int = 0):
        import torch

        self.index = index
        self._torch = torch
        self.total_bytes = int(torch.cuda.get_device_properties(index).total_memory)
        self.limit_bytes: int | None = None

    def allocated_bytes(self) -> int:
        return int(self._torch.cuda.memory_allocated(self.index))

    def reserved_bytes(self) -> int:
        return int(self._torch.cuda.memory_reserved(self.index))

    def peak_bytes(self) -> int:
        return int(self._torch.cuda.max_memory_allocated(self.index))

    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.index)

    def read(self) -> MemoryReading:
        free, total = self._torch.cuda.mem_get_info(self.index)
        used = int(total) - int(free)
        return MemoryReading(int(total), used, self.reserved_bytes(), _free_frac(int(total), used), None)

    def enforce(self, grant_bytes: int | None) -> None:
        """Cap this process's allocator at ``grant_bytes`` (None lifts the cap)."""
        self.limit_bytes = grant_bytes
        if grant_bytes is None:
            fraction = 1.0
        else:
            fraction = min(1.0, max(grant_bytes / self.total_bytes, 1e-6))
        self._torch.cuda.set_per_process_memory_fraction(fraction, self.index)


class CudaProbe:
    """Card and SM utilisation from NVML (when it initialises), process and cap from torch."""

    def __init__(self, index: int = 0, nvml: NvmlProbe | None = None):
        self.torch = TorchCudaProbe(index)
        self.nvml = nvml

    @property
    def limit_bytes(self) -> int | None:
        return self.torch.limit_bytes

    def read(self) -> MemoryReading:
        if self.nvml is None:
            return self.torch.read()
        total, used = self.nvml.card()
        return MemoryReading(
            total, used, self.torch.reserved_bytes(), _free_frac(total, used), self.nvml.sm_util_frac()
        )

    def enforce(self, grant_bytes: int | None) -> None:
        self.torch.enforce(grant_bytes)


# ---------------------------------------------------------------------------------------------
# Host memory (CPU-only machines)


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident set size of ``pid`` (this process by default); None when it is gone."""
    path = f"/proc/{'self' if pid is None else pid}/statm"
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:
        return None


_STATUS_KB_FIELDS = ("VmSize", "VmData", "VmStk", "VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status_bytes(pid: int | None = None) -> dict[str, int]:
    """Memory lines of /proc/<pid>/status in bytes: ``VmData`` is what ``RLIMIT_DATA`` counts
    (private writable mappings and the heap, reserved or touched), ``VmRSS`` what is resident
    (= RssAnon + RssFile + RssShmem), ``VmHWM`` the peak of VmRSS since the process started. Empty when the file cannot be read (not Linux, pid gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in _STATUS_KB_FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def thread_count(pid: int | None = None) -> int:
    """Threads of ``pid`` (this process by default); 0 when unknown. Each thread's stack is a
    private writable mapping: ``RLIMIT_DATA`` counts its whole reserved size."""
    try:
        return len(os.listdir(f"/proc/{'self' if pid is None else pid}/task"))
    except OSError:
        return 0


class HostProbe:
    """Host memory as the 'card': RSS of this process and of registered replica processes."""

    def __init__(self, capacity_bytes: int | None = None, pids: Iterable[int] = ()):
        self.capacity_bytes = int(capacity_bytes) if capacity_bytes else host_total_bytes()
        self.pids: set[int] = set(pids)
        self.limit_bytes: int | None = None

    def register(self, pid: int) -> None:
        self.pids.add(int(pid))

    def unregister(self, pid: int) -> None:
        self.pids.discard(int(pid))

    def read(self) -> MemoryReading:
        process = rss_bytes() or 0
        if self.pids:
            used = 0
            for pid in sorted(self.pids):
                value = rss_bytes(pid)
                if value is not None:
                    used += value
        else:
            used = process
        total = self.capacity_bytes
        return MemoryReading(total, used, process, _free_frac(total, used), None)

    def enforce(self, grant_bytes: int | None) -> None:
        self.limit_bytes = grant_bytes

    def over_limit(self) -> bool:
        return self.limit_bytes is not None and (rss_bytes() or 0) > self.limit_bytes


# ---------------------------------------------------------------------------------------------
# The probe for a device


def make_probe(device: object, capacity_bytes: int | None = None) -> HostProbe | CudaProbe:
    """The probe a replica uses: HostProbe on cpu, CudaProbe (NVML if it works) on cuda."""
    name = device_name(device)
    if name == "cpu":
        return HostProbe(capacity_bytes)
    index = cuda_index(name)
    try:
        nvml: NvmlProbe | None = NvmlProbe.for_torch_device(index)
    except Exception:
        nvml = None
    return CudaProbe(index, nvml)
