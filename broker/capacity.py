"""What a card holds: the device a config names and its memory in bytes (torch, NVML or the host).

The broker actor reads ``detect_capacity`` when the config leaves ``gpu.capacity`` to be measured;
the Serve side reads the device and NVML helpers here too (its probes,
``gpubroker.deployments.enforce.probes``, and card discovery, ``gpubroker.deployments.cluster.discovery``),
so NVML is initialised in one place. torch and pynvml are imported lazily, inside the functions;
this module imports nothing of ours (``tests/unit/test_layers.py``), so the broker reaches no
Serve code through it.
"""

from __future__ import annotations

import os
import re
from typing import Any


def cuda_index(device: str | int) -> int:
    """The CUDA ordinal of ``cuda`` / ``cuda:N`` (or an int); another name is a ValueError."""
    if isinstance(device, int):
        return device
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if not match:
        raise ValueError(f"'{device}' is not a CUDA device; use cuda or cuda:N")
    return int(match.group(1) or 0)


_nvml_ready = False


def nvml() -> Any:  # the pynvml module (it ships no types)
    """pynvml, initialised once per process. Raises if NVML is unavailable."""
    global _nvml_ready
    import pynvml

    if not _nvml_ready:
        pynvml.nvmlInit()
        _nvml_ready = True
    return pynvml


def nvml_total_bytes(index: int) -> int:
    """Memory of the card at NVML ``index`` (physical order, whatever CUDA_VISIBLE_DEVICES says)."""
    lib = nvml()
    return int(lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(index)).total)


def host_total_bytes() -> int:
    """Host MemTotal, lowered to the cgroup memory limit when one is set."""
    total = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if total <= 0:
        total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def detect_device(device_cfg: str = "auto") -> str:
    """'auto' -> 'cuda:0' when CUDA is available, else 'cpu'; 'cuda:N' is checked to exist."""
    if device_cfg == "auto":
        return "cuda:0" if _cuda_available() else "cpu"
    if device_cfg == "cpu":
        return "cpu"
    index = cuda_index(device_cfg)
    if not _cuda_available():
        raise RuntimeError(f"gpu.device is '{device_cfg}' but CUDA is not available here; use auto or cpu")
    import torch

    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"gpu.device is '{device_cfg}' but only {count} CUDA device(s) exist; use cuda:0..cuda:{count - 1}"
        )
    return f"cuda:{index}"


def device_name(device: object) -> str:
    """A device string ('cpu', 'cuda:N') from 'auto'/'cpu'/'cuda:N', an int index, or a config's
    gpu section (its ``device``); 'auto' is detected here."""
    if isinstance(device, int):
        return f"cuda:{device}"
    if not isinstance(device, str):
        device = getattr(device, "device", None)  # gpubroker.quotas.config.GpuSection
        if not isinstance(device, str):
            raise TypeError("expected a device string ('auto', 'cpu', 'cuda:N') or a gpu config section")
    return detect_device(device) if device == "auto" else device


def detect_capacity(device: object) -> int:
    """Total bytes of the CUDA card, or host MemTotal (cgroup-limited) on cpu.

    ``device``: 'cpu', 'cuda:N', 'auto', or the config's gpu section (its ``device`` is used).
    """
    name = device_name(device)
    if name == "cpu":
        return host_total_bytes()
    index = cuda_index(name)
    try:
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory)
    except Exception:
        return nvml_total_bytes(index)
