"""Memory limits outside the model's goodwill (deployments/enforce/limits.py).

CPU: a real ``RLIMIT_DATA`` in a child process (a limit set in pytest's own process would
outlive the test): a torch allocation past the grant raises a catchable RuntimeError, the
process survives, and raising the soft limit lets the same allocation succeed; the ``profiled``
emulation is refused by the same limit. CUDA: the fraction / ``empty_cache`` sequence against a
FAKE ``torch.cuda`` object and a FAKE ``pynvml`` module (no GPU here; scripts/gpu-check runs the
real path on a GPU machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from gpubroker.broker import capacity
from gpubroker.deployments.enforce import probes
from gpubroker.deployments.enforce.limits import (
    CpuRlimitLimiter,
    CudaFractionLimiter,
    LimiterKind,
    UnenforcedLimiter,
    make_limiter,
)

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repo root; it prints one JSON line last."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"child failed ({out.returncode}): {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_torch_allocation_past_the_limit_raises_and_raising_the_limit_lets_it_run():
    result = run_child("""
        import json, resource, torch
        from gpubroker.deployments.enforce.limits import CpuRlimitLimiter
        from gpubroker.deployments.models import is_oom
        MiB = 1024 ** 2
        hard0 = resource.getrlimit(resource.RLIMIT_DATA)[1]
        lim = CpuRlimitLimiter(slack_bytes=0)
        lim.start()
        lim.set_grant(64 * MiB)
        out = {"soft_over_baseline": resource.getrlimit(resource.RLIMIT_DATA)[0] - lim.baseline_data_bytes,
               "hard_kept": resource.getrlimit(resource.RLIMIT_DATA)[1] == hard0}
        try:
            t = torch.ones(128 * MiB, dtype=torch.uint8)
            out["error"] = None
        except RuntimeError as exc:  # catchable: the process goes on
            out["error"] = str(exc)
            out["is_oom"] = is_oom(exc)
        small = torch.ones(16 * MiB, dtype=torch.uint8)  # under the grant: still works
        out["small_ok"] = int(small.max()) == 1 and small.numel() == 16 * MiB  # (sum() would upcast to int64)
        del small
        lim.set_grant(256 * MiB)  # raising soft back up (hard unchanged) needs no privilege
        t = torch.ones(128 * MiB, dtype=torch.uint8)
        out["after_raise_ok"] = int(t.max()) == 1 and t.numel() == 128 * MiB
        out["used_over_grant"] = lim.read().used_bytes > 64 * MiB
        del t
        lim.set_grant(32 * MiB)  # a shrink (the 128 MiB were freed): an allocation over the new grant fails
        try:
            torch.ones(64 * MiB, dtype=torch.uint8)
            out["after_shrink"] = "ran"
        except RuntimeError:
            out["after_shrink"] = "refused"
        print(json.dumps(out))
    """)
    assert result["soft_over_baseline"] >= 64 * MiB and result["hard_kept"]
    assert result["error"] is not None and "can't allocate memory" in result["error"] and result["is_oom"]
    assert result["small_ok"]
    assert result["after_raise_ok"] and result["used_over_grant"]
    assert result["after_shrink"] == "refused"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_profiled_emulation_is_refused_by_the_same_limit():
    result = run_child("""
        import json
        from gpubroker.deployments.enforce.limits import CpuRlimitLimiter
        from gpubroker.deployments.models import EmulatedOOM, load_adapter
        from gpubroker.deployments.replica.oom import run_items
        MiB = 1024 ** 2
        lim = CpuRlimitLimiter(slack_bytes=0)
        lim.start()
        lim.set_grant(96 * MiB)
        adapter = load_adapter("profiled", {"a_ms": 0, "c_ms": 0, "weights_bytes": 16 * MiB, "bytes_per_item": 16 * MiB})
        items = [adapter.validate({}) for _ in range(8)]  # 16 + 8 x 16 MiB: over the 96 MiB grant
        try:
            adapter.predict(items)
            whole = "ran"
        except EmulatedOOM as exc:
            whole = str(exc)
        result = run_items(adapter.predict, items, release=lim.release_caches)
        print(json.dumps({"whole": whole, "ok": sum(1 for o in result.outputs if isinstance(o, dict)),
                          "biggest": max(o["batch"] for o in result.outputs), "oom_costs": list(result.oom_costs)}))
    """)
    assert "can't allocate memory" in result["whole"]
    assert result["ok"] == 8 and result["biggest"] <= 4  # every item ran, in batches that fit
    assert result["oom_costs"] and min(result["oom_costs"]) > result["biggest"]


class FakeResource:
    """The ``resource`` module's RLIMIT_DATA calls, recorded (a FAKE: nothing is limited)."""

    RLIMIT_DATA, RLIMIT_STACK, RLIM_INFINITY = 2, 3, -1

    def __init__(self, hard: int = -1):
        self.limits = {self.RLIMIT_DATA: (-1, hard), self.RLIMIT_STACK: (8 * MiB, -1)}
        self.calls: list[tuple[int, int]] = []

    def getrlimit(self, which):
        return self.limits[which]

    def setrlimit(self, which, pair):
        self.limits[which] = tuple(pair)
        self.calls.append(tuple(pair))


def test_cpu_limiter_soft_over_baseline_hard_kept_threads_credited():
    res = FakeResource(hard=10_000 * MiB)
    status = {"VmData": 300 * MiB, "VmRSS": 200 * MiB}
    threads = [5]
    trims = []
    lim = CpuRlimitLimiter(
        8 * MiB, resource_mod=res, status=lambda: dict(status), threads=lambda: threads[0], trim=lambda: trims.append(1)
    )
    reading = lim.set_grant(256 * MiB)  # starts itself: the baseline is measured first
    assert lim.baseline_data_bytes == 300 * MiB
    assert res.calls[-1] == (300 * MiB + 256 * MiB + 8 * MiB, 10_000 * MiB)
    assert reading.kind is LimiterKind.RLIMIT_DATA and reading.headroom_bytes == 256 * MiB
    threads[0] = 7  # two threads started since: their stacks count in VmData, not against the grant
    status["VmData"] += 2 * 8 * MiB + 40 * MiB
    lim.refresh()
    assert res.calls[-1][0] == 300 * MiB + 256 * MiB + 8 * MiB + 16 * MiB
    assert lim.read().used_bytes == 40 * MiB
    lim.set_grant(128 * MiB)  # a shrink releases caches (gc + malloc_trim)
    assert trims == [1] and res.calls[-1][0] == 300 * MiB + 128 * MiB + 8 * MiB + 16 * MiB
    lim.set_grant(100_000 * MiB)  # never above the original hard limit
    assert res.calls[-1] == (10_000 * MiB, 10_000 * MiB)
    lim.set_grant(None)
    assert res.calls[-1] == (-1, 10_000 * MiB) and lim.read().headroom_bytes is None
    with pytest.raises(ValueError, match="grant_bytes"):
        lim.set_grant(-1)


def test_a_soft_limit_lifted_by_the_model_is_found_at_the_next_report_and_set_again():
    """Any code in the process can raise its own soft RLIMIT_DATA up to hard (issue 37): the
    limiter reads it back at every report (getrlimit), sets it again, and says it was lifted."""
    res = FakeResource(hard=10_000 * MiB)
    status = {"VmData": 300 * MiB, "VmRSS": 200 * MiB}
    lim = CpuRlimitLimiter(8 * MiB, resource_mod=res, status=lambda: dict(status), threads=lambda: 1, trim=lambda: None)
    lim.set_grant(256 * MiB)
    limit = lim.limit_bytes
    assert lim.reassert() == ""  # as set: nothing to say, nothing set
    calls = len(res.calls)
    res.limits[res.RLIMIT_DATA] = (10_000 * MiB, 10_000 * MiB)  # the model: setrlimit(soft=hard)
    lifted = lim.reassert()
    assert lifted.startswith("the limit was lifted") and "found at 10000.0 MiB" in lifted, lifted
    assert res.calls[calls:] == [(limit, 10_000 * MiB)] and res.limits[res.RLIMIT_DATA][0] == limit
    res.limits[res.RLIMIT_DATA] = (res.RLIM_INFINITY, 10_000 * MiB)
    assert "found at unlimited" in lim.reassert()
    res.limits[res.RLIMIT_DATA] = (limit - MiB, 10_000 * MiB)  # lowered: set again, not a violation
    assert lim.reassert() == "" and res.limits[res.RLIMIT_DATA][0] == limit
    assert UnenforcedLimiter("test").reassert() == ""


def test_cpu_limiter_never_sets_soft_under_what_is_held():
    """A process over its grant (grown into the slack, or a grant lowered under what it holds):
    soft stays at what is held + slack (else every allocation of the process fails, the runtime's
    too), lowered as the process frees, never raised, and back to baseline + grant + slack once the
    process is under its grant."""
    res = FakeResource()
    status = {"VmData": 100 * MiB, "VmRSS": 80 * MiB}
    lim = CpuRlimitLimiter(8 * MiB, resource_mod=res, status=lambda: dict(status), threads=lambda: 1, trim=lambda: None)
    lim.set_grant(512 * MiB)
    status["VmData"] += 518 * MiB  # grown 6 MiB into the slack: the runtime would have 2 MiB left
    lim.refresh()  # after a batch that nothing refused: not measured
    assert lim.held_over is None and res.calls[-1][0] == 100 * MiB + 512 * MiB + 8 * MiB
    lim.refresh(after_oom=True)  # the model was refused: measured
    assert lim.held_over == 6 * MiB and res.calls[-1][0] == 618 * MiB + 8 * MiB
    status["VmData"] -= 218 * MiB  # the model holds 300 MiB of its loan
    lim.refresh()
    assert lim.held_over is None and res.calls[-1][0] == 100 * MiB + 512 * MiB + 8 * MiB
    lim.set_grant(128 * MiB)  # reclaimed under what it holds
    assert lim.held_over == 172 * MiB
    assert res.calls[-1][0] == 400 * MiB + 8 * MiB  # not 100 + 128 + 8: the runtime keeps its slack
    status["VmData"] += 4 * MiB  # the runtime took some of the slack: the floor is not raised
    lim.refresh()
    assert res.calls[-1][0] == 400 * MiB + 8 * MiB and lim.held_over == 176 * MiB
    status["VmData"] -= 104 * MiB  # the model freed some: the floor follows down
    lim.refresh()
    assert res.calls[-1][0] == 300 * MiB + 8 * MiB and lim.held_over == 72 * MiB
    status["VmData"] = 100 * MiB + 100 * MiB  # under the grant: the grant's limit again
    lim.refresh()
    assert lim.held_over is None and res.calls[-1][0] == 100 * MiB + 128 * MiB + 8 * MiB
    status["VmData"] = 100 * MiB + 300 * MiB
    lim.set_grant(64 * MiB)
    assert lim.held_over == 236 * MiB
    lim.set_grant(512 * MiB)  # raised over what is held: the floor goes
    assert lim.held_over is None and res.calls[-1][0] == 100 * MiB + 512 * MiB + 8 * MiB
    lim.set_grant(64 * MiB)
    lim.set_grant(None)
    assert lim.held_over is None and res.calls[-1] == (-1, -1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_a_grant_lowered_under_held_memory_leaves_the_runtime_its_slack():
    result = run_child("""
        import json, resource
        import numpy as np
        from gpubroker.deployments.enforce.limits import CpuRlimitLimiter
        MiB = 1024 ** 2
        lim = CpuRlimitLimiter(slack_bytes=16 * MiB)
        lim.start()
        lim.set_grant(256 * MiB)
        held = [np.ones(8 * MiB, dtype=np.uint8) for _ in range(12)]  # 96 MiB the model keeps
        lim.set_grant(32 * MiB)
        out = {"held_over": lim.held_over, "soft_over_vmdata": resource.getrlimit(resource.RLIMIT_DATA)[0]
               - lim._status()["VmData"]}
        runtime = bytearray(4 * MiB)  # the runtime's own next allocation, under the slack
        out["runtime_ok"] = len(runtime) == 4 * MiB
        try:
            more = np.ones(64 * MiB, dtype=np.uint8)
            out["more"] = "ran"
        except MemoryError:
            out["more"] = "refused"
        del held, runtime
        lim.refresh()
        out["after_free"] = lim.held_over
        out["soft_after"] = resource.getrlimit(resource.RLIMIT_DATA)[0] - lim.soft_for(32 * MiB)
        print(json.dumps(out))
    """)
    assert 60 * MiB <= result["held_over"] <= 100 * MiB
    assert 8 * MiB <= result["soft_over_vmdata"] <= 16 * MiB
    assert result["runtime_ok"] and result["more"] == "refused"
    assert result["after_free"] is None and result["soft_after"] == 0


def test_make_limiter_picks_the_mechanism():
    assert isinstance(make_limiter("cpu"), CpuRlimitLimiter if sys.platform.startswith("linux") else UnenforcedLimiter)
    cuda = make_limiter("cuda:1")
    assert isinstance(cuda, CudaFractionLimiter) and cuda.index == 1


# ---------------------------------------------------------------------------------------------
# CUDA against FAKES


class FakeCuda:
    """A FAKE ``torch.cuda``: records the calls the limiter makes, holds a reserved count."""

    def __init__(self, total: int):
        self.total = total
        self.reserved = 0
        self.cached = 0
        self.calls: list[tuple] = []

    def get_device_properties(self, index):
        self.calls.append(("props", index))
        return types.SimpleNamespace(total_memory=self.total, uuid=None)

    def set_per_process_memory_fraction(self, fraction, index):
        self.calls.append(("fraction", round(fraction, 6), index))

    def empty_cache(self):
        self.calls.append(("empty_cache",))
        self.reserved -= self.cached
        self.cached = 0

    def memory_reserved(self, index):
        self.calls.append(("reserved", index))
        return self.reserved


def fake_pynvml(pid: int, used: int, sm: int):
    """A FAKE ``pynvml`` module: one card, this pid listed with ``used`` bytes and ``sm`` % SM."""

    class NVMLError(Exception):
        pass

    proc = types.SimpleNamespace
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetHandleByIndex = lambda i: f"card{i}"
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        proc(pid=pid, usedGpuMemory=used),
        proc(pid=pid + 1, usedGpuMemory=10 * MiB),
    ]
    mod.nvmlDeviceGetProcessUtilization = lambda h, since: [
        proc(pid=pid, smUtil=sm, timeStamp=since + 7),
        proc(pid=pid + 1, smUtil=99, timeStamp=since + 9),
    ]
    return mod


def test_cuda_fraction_set_before_load_shrink_empties_cache_and_remeasures(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(pid=4242, used=900 * MiB, sm=35))
    monkeypatch.setattr(capacity, "_nvml_ready", False)
    cuda = FakeCuda(total=80_000 * MiB)
    lim = CudaFractionLimiter(0, cuda=cuda, nvml=probes.NvmlProbe(0, pid=4242))
    first = lim.set_grant(8_000 * MiB)  # before the model loads: nothing reserved yet
    assert ("fraction", 0.1, 0) in cuda.calls and ("empty_cache",) not in cuda.calls
    assert first.fraction == pytest.approx(0.1) and first.limit_bytes == 8_000 * MiB and first.used_bytes == 0
    cuda.reserved, cuda.cached = 6_000 * MiB, 2_500 * MiB  # the model ran: blocks cached above its need
    cuda.calls.clear()
    lim.set_grant(16_000 * MiB)  # a raise: no cache release
    assert [c[0] for c in cuda.calls] == ["fraction", "reserved"]
    cuda.calls.clear()
    after = lim.set_grant(4_000 * MiB)  # a shrink: new fraction, empty_cache, then the re-measure
    assert [c[0] for c in cuda.calls] == ["fraction", "empty_cache", "reserved"]
    assert after.used_bytes == 3_500 * MiB and after.fraction == pytest.approx(0.05)
    assert after.resident_bytes == 900 * MiB  # NVML's number for this pid only (context included)
    assert after.sm_util_frac == pytest.approx(0.35)  # this pid's SM share, not the neighbour's 99%
    lim.set_grant(None)
    assert cuda.calls[-2] == ("fraction", 1.0, 0)


def test_nvml_process_sm_util_reads_only_new_samples_and_none_when_unsupported(monkeypatch):
    mod = fake_pynvml(pid=7, used=0, sm=50)
    seen = []
    mod.nvmlDeviceGetProcessUtilization = lambda h, since: (
        seen.append(since),
        [types.SimpleNamespace(pid=7, smUtil=50, timeStamp=since + 5)],
    )[1]
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.setattr(capacity, "_nvml_ready", False)
    probe = probes.NvmlProbe(0, pid=7)
    assert probe.process_sm_util_frac() == 0.5 and probe.process_sm_util_frac() == 0.5
    assert seen == [0, 5]  # the second read asks only for samples after the first's

    def unsupported(h, since):
        raise mod.NVMLError("not supported")

    mod.nvmlDeviceGetProcessUtilization = unsupported
    assert probe.process_sm_util_frac() is None


def test_proc_status_reads_what_rlimit_data_counts():
    st = probes.proc_status_bytes()
    if not st:
        pytest.skip("no /proc/self/status here")
    assert st["VmData"] > 0 and st["VmRSS"] > 0 and st["VmRSS"] <= st["VmSize"]
    assert probes.thread_count() >= 1
    assert probes.proc_status_bytes(2**22 + 12345) == {}
