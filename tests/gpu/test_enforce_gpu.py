"""The CUDA enforcement path on a real card (skipped without CUDA); ``scripts/gpu-check`` runs
the same ``CHECKS`` without pytest, beside tests/gpu/test_gpu.py's.

``gpubroker.deployments.enforce.limits.CudaFractionLimiter`` as the replica uses it: the fraction set before the
model loads, an allocation past it raising ``torch.cuda.OutOfMemoryError`` (caught, the process
goes on), a shrink that empties the cache and re-measures under the new grant, NVML's bytes for
this pid against torch's reserved bytes, this pid's SM share, and an oversize item failing
alone inside a batch. Each check lifts the cap again when it ends.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda:0"
MiB = 1024**2


def _limiter():
    from gpubroker.deployments.enforce.limits import CudaFractionLimiter

    torch.cuda.empty_cache()
    return CudaFractionLimiter(0)


def _lift(lim) -> None:
    lim.set_grant(None)
    torch.cuda.empty_cache()


def check_fraction_before_load_refuses_past_grant() -> str:
    """Fraction set before the model loads; the model fits, one allocation past the grant raises
    torch.cuda.OutOfMemoryError, caught; the process still allocates under the grant."""
    from gpubroker.deployments.models import is_oom, load_adapter

    lim = _limiter()
    grant = torch.cuda.memory_reserved(0) + 384 * MiB
    first = lim.set_grant(grant)
    try:
        assert first.fraction is not None and abs(first.limit_bytes - grant) <= lim.total_bytes * 1e-6 + 1, first
        adapter = load_adapter("mlp", {"in_dim": 256, "hidden": 1024}, DEVICE)  # ~1 MiB of weights: fits
        raised = None
        try:
            big = torch.empty(512 * MiB, dtype=torch.uint8, device=DEVICE)
            del big
        except torch.cuda.OutOfMemoryError as exc:
            raised = exc
        assert raised is not None, f"512 MiB under a {grant / MiB:.0f} MiB grant did not raise"
        assert is_oom(raised)
        out = adapter.predict([{"x": [0.1] * 256}] * 4)  # still serving after the caught OOM
        assert len(out) == 4
        del adapter
    finally:
        _lift(lim)
    return f"fraction {first.fraction:.5f} (grant {grant / MiB:.0f} MiB): model loaded, 512 MiB -> OutOfMemoryError, served after"


def check_shrink_empties_cache_and_remeasures() -> str:
    """A shrink sets the new fraction, empties the cache and re-measures: cached blocks left by
    a batch no longer keep the process above its new grant."""
    lim = _limiter()
    base = torch.cuda.memory_reserved(0)
    lim.set_grant(base + 512 * MiB)
    try:
        scratch = torch.empty(256 * MiB, dtype=torch.uint8, device=DEVICE)
        scratch.fill_(1)
        del scratch  # freed to torch's cache: still reserved
        cached = torch.cuda.memory_reserved(0)
        assert cached >= base + 256 * MiB, f"reserved {cached} after freeing 256 MiB: nothing cached?"
        new_grant = base + 64 * MiB
        after = lim.set_grant(new_grant)
        assert after.used_bytes <= new_grant, (
            f"reserved {after.used_bytes / MiB:.0f} MiB > new grant {new_grant / MiB:.0f} MiB"
        )
    finally:
        _lift(lim)
    return f"cached {cached / MiB:.0f} MiB -> shrink to {new_grant / MiB:.0f} MiB -> re-measured {after.used_bytes / MiB:.0f} MiB reserved"


def check_nvml_process_memory_vs_torch() -> str:
    """NVML's bytes for this pid (nvmlDeviceGetComputeRunningProcesses) hold at least torch's
    reserved bytes; the difference is the CUDA context. SM share from
    nvmlDeviceGetProcessUtilization where the driver has it."""
    lim = _limiter()
    lim.set_grant(None)
    if lim._nvml is None:  # noqa: SLF001 - the limiter's own NVML probe
        return "NVML did not initialise: torch's numbers only"
    keep = torch.empty(128 * MiB, dtype=torch.uint8, device=DEVICE)
    a = torch.randn(4096, 4096, device=DEVICE)
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
    reading = lim.read()
    del keep, a
    torch.cuda.empty_cache()
    if reading.resident_bytes == 0:
        return f"this pid ({os.getpid()}) is not in NVML's process list (another pid namespace?): torch reserved {reading.used_bytes / MiB:.0f} MiB"
    context = reading.resident_bytes - reading.used_bytes
    assert reading.resident_bytes >= reading.used_bytes, reading
    assert context < 4096 * MiB, (
        f"NVML {reading.resident_bytes} vs torch reserved {reading.used_bytes}: {context / MiB:.0f} MiB apart"
    )
    sm = "n/a (driver has no per-process samples)" if reading.sm_util_frac is None else f"{reading.sm_util_frac:.0%}"
    return f"NVML {reading.resident_bytes / MiB:.0f} MiB vs torch reserved {reading.used_bytes / MiB:.0f} MiB (context {context / MiB:.0f} MiB); SM {sm}"


def check_oversize_item_fails_alone_on_cuda() -> str:
    """Under a real CUDA cap, an item that cannot fit alone fails alone; the rest of its batch runs."""
    from gpubroker.deployments.replica.oom import run_items

    lim = _limiter()
    lim.set_grant(torch.cuda.memory_reserved(0) + 256 * MiB)

    def run_batch(items):
        bufs = [torch.ones(mb * MiB, dtype=torch.uint8, device=DEVICE) for mb in items]
        return [int(b[::MiB].sum().item()) for b in bufs]

    try:
        result = run_items(run_batch, [32, 32, 1024, 32], release=lim.release_caches)
    finally:
        _lift(lim)
    assert result.outputs[0] == 32 and result.outputs[1] == 32 and result.outputs[3] == 32, result.outputs
    (failed,) = result.failed
    assert failed.index == 2 and failed.attempted_bytes == 1024 * MiB, failed
    return f"[32, 32, 1024, 32] MiB under 256 MiB: 1024 failed alone ({failed.attempted_bytes / MiB:.0f} MiB attempted), 3 answered"


CUDA_GROWER = """
import sys, time, torch
torch.zeros(1, device="cuda:0")  # the CUDA context first: the watchdog's baseline
print("ready", flush=True)
sys.stdin.readline()
held = [torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]  # 512 MiB, no cap
torch.cuda.synchronize()
print("grown", flush=True)
time.sleep(120)
"""


def check_nvml_watchdog_ends_a_cuda_violator() -> str:
    """The watchdog process (``python -m gpubroker.deployments.enforce.watch --device cuda:0``, cgroup off: NVML's
    reading alone) ends a child that allocates 512 MiB of CUDA memory against a 64 MiB grant, past
    the grace and the drain; the bound is ``watch.END_BOUND_S``."""
    import json
    import subprocess
    import sys
    import time

    from gpubroker.deployments.enforce.watch import END_BOUND_S

    child = subprocess.Popen(
        [sys.executable, "-c", CUDA_GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        base = _nvml_bytes_of(child.pid)
        if base is None:
            return f"child pid {child.pid} is not in NVML's process list (another pid namespace?): not run"
        cmd = [
            sys.executable,
            "-m",
            "gpubroker.deployments.enforce.watch",
            "--pid",
            str(child.pid),
            "--model",
            "grower",
        ]
        cmd += ["--device", DEVICE, "--baseline", str(base), "--grant", str(64 * MiB), "--slack", str(64 * MiB)]
        cmd += ["--grace", "1", "--drain", "1"]
        dog = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GPUBROKER_CGROUP": "off"},
        )
        json.loads(dog.stdout.readline())
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "grown"
        t0 = time.monotonic()
        code = child.wait(timeout=60)
        took = time.monotonic() - t0
        dog.wait(timeout=30)
        log = dog.stderr.read()
    finally:
        child.kill()
    assert code == -9, (code, log)
    assert f"pid {child.pid}: SIGKILL" in log, log
    assert took <= END_BOUND_S + 2.0, f"ended {took:.1f} s after it grew; bound {END_BOUND_S:.1f} s"
    return (
        f"512 MiB of CUDA against 64 MiB + 64 MiB slack: SIGKILL {took:.1f} s after it grew (bound {END_BOUND_S:.1f} s)"
    )


def _nvml_bytes_of(pid: int) -> int | None:
    """NVML's bytes for ``pid`` on card 0 (None: NVML away or the pid not listed)."""
    from gpubroker.deployments.enforce.probes import NvmlProbe

    try:
        got = NvmlProbe(0, pid).process_bytes()
    except Exception:  # noqa: BLE001 - NVML missing or the pid not visible
        return None
    return got or None


CHECKS = [
    ("fraction before load", check_fraction_before_load_refuses_past_grant),
    ("shrink: empty_cache + re-measure", check_shrink_empties_cache_and_remeasures),
    ("nvml per-process vs torch", check_nvml_process_memory_vs_torch),
    ("oversize item fails alone", check_oversize_item_fails_alone_on_cuda),
    ("NVML watchdog ends a CUDA violator", check_nvml_watchdog_ends_a_cuda_violator),
]


def test_fraction_before_load_refuses_past_grant():
    check_fraction_before_load_refuses_past_grant()


def test_shrink_empties_cache_and_remeasures():
    check_shrink_empties_cache_and_remeasures()


def test_nvml_process_memory_vs_torch():
    check_nvml_process_memory_vs_torch()


def test_oversize_item_fails_alone_on_cuda():
    check_oversize_item_fails_alone_on_cuda()


def test_nvml_watchdog_ends_a_cuda_violator():
    check_nvml_watchdog_ends_a_cuda_violator()
