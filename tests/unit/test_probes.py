"""Memory probes (``gpubroker.deployments.enforce.probes``): host RSS and the NVML path against a fake
pynvml; the device and capacity detection they share with the broker (``gpubroker.broker.capacity``)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import FrozenInstanceError

import pytest

from gpubroker.broker import capacity
from gpubroker.broker.capacity import detect_capacity, detect_device
from gpubroker.deployments.enforce.probes import (
    HostProbe,
    MemoryReading,
    NvmlProbe,
    make_probe,
    rss_bytes,
)


def test_host_probe_reads_positive_rss():
    reading = HostProbe().read()
    assert isinstance(reading, MemoryReading)
    assert reading.process_bytes > 0
    assert reading.used_bytes == reading.process_bytes
    assert reading.total_bytes > reading.used_bytes
    assert 0.0 < reading.free_frac < 1.0
    assert reading.sm_util_frac is None
    with pytest.raises(FrozenInstanceError):
        reading.used_bytes = 0  # type: ignore[misc]


def test_host_probe_capacity_and_registered_pids():
    code = "import sys, time; print('ready', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"  # RSS settled: the interpreter is up
        probe = HostProbe(capacity_bytes=10 * 1024**3)
        probe.register(os.getpid())
        probe.register(child.pid)
        probe.register(2**22 + 12345)  # no such process: ignored
        reading = probe.read()
        assert reading.total_bytes == 10 * 1024**3
        child_rss = rss_bytes(child.pid)
        assert child_rss and child_rss > 0
        assert reading.used_bytes >= 0.9 * (reading.process_bytes + child_rss)
        assert reading.free_frac == pytest.approx(1 - reading.used_bytes / reading.total_bytes)
    finally:
        child.kill()
        child.wait()


def test_host_probe_enforce_records_the_limit():
    probe = HostProbe(capacity_bytes=1024**3)
    probe.enforce(1)
    assert probe.limit_bytes == 1 and probe.over_limit()
    probe.enforce(None)
    assert not probe.over_limit()


def test_rss_of_missing_process_is_none():
    assert rss_bytes(2**22 + 12345) is None


def test_detection_on_cpu():
    assert detect_device("cpu") == "cpu"
    assert detect_capacity("cpu") > 0
    assert isinstance(make_probe("cpu", 123456), HostProbe)
    assert make_probe("cpu", 123456).read().total_bytes == 123456
    with pytest.raises(ValueError):
        detect_device("tpu:0")


def test_detect_device_auto_and_missing_cuda(monkeypatch):
    monkeypatch.setattr(capacity, "_cuda_available", lambda: False)
    assert detect_device("auto") == "cpu"
    assert detect_capacity("auto") == detect_capacity("cpu")
    assert detect_capacity(types.SimpleNamespace(device="auto")) == detect_capacity("cpu")  # a GpuSection
    assert isinstance(make_probe("auto"), HostProbe)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        detect_device("cuda:0")


@pytest.mark.parametrize("module", ["gpubroker.broker.capacity", "gpubroker.deployments.enforce.probes"])
def test_probes_and_capacity_import_neither_torch_nor_pynvml(module: str):
    code = f"import sys, {module}; print('torch' in sys.modules, 'pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd())
    assert out.stdout.split() == ["False", "False"]


class _Err(Exception):
    pass


def fake_pynvml(processes):
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _Err
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
    mod.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=80 * 1024**3, used=20 * 1024**3, free=60 * 1024**3
    )
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: processes
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=10)
    return mod


def test_nvml_probe_with_fake_nvml(monkeypatch):
    procs = [
        types.SimpleNamespace(pid=4242, usedGpuMemory=3 * 1024**3),
        types.SimpleNamespace(pid=1, usedGpuMemory=5 * 1024**3),
        types.SimpleNamespace(pid=4242, usedGpuMemory=None),
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(procs))
    monkeypatch.setattr(capacity, "_nvml_ready", False)
    probe = NvmlProbe(0, pid=4242)
    reading = probe.read()
    assert reading == MemoryReading(80 * 1024**3, 20 * 1024**3, 3 * 1024**3, 0.75, 0.37)
    probe.enforce(10)
    assert probe.limit_bytes == 10
    assert NvmlProbe(0, pid=7).read().process_bytes == 0


def test_nvml_probe_tolerates_errors(monkeypatch):
    mod = fake_pynvml([])

    def boom(_h):
        raise _Err("not supported")

    mod.nvmlDeviceGetComputeRunningProcesses = boom
    mod.nvmlDeviceGetUtilizationRates = boom
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.setattr(capacity, "_nvml_ready", False)
    reading = NvmlProbe(0).read()
    assert reading.process_bytes == 0 and reading.sm_util_frac is None
