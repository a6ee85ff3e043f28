"""GPU checks (skipped without CUDA). ``scripts/gpu-check`` runs the same ``CHECKS`` without pytest.

Each check is a plain function that returns a one-line detail or raises AssertionError; it
restores the process memory fraction it changes.
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


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def check_nvml_torch_total() -> str:
    """NVML and torch agree on the card's total memory within 1%."""
    from gpubroker.broker.capacity import detect_capacity
    from gpubroker.deployments.enforce.probes import NvmlProbe

    nvml_total = NvmlProbe.for_torch_device(0).read().total_bytes
    torch_total = int(torch.cuda.get_device_properties(0).total_memory)
    diff = abs(nvml_total - torch_total) / nvml_total
    assert diff < 0.01, f"NVML total {nvml_total} vs torch {torch_total}: {diff:.2%} apart"
    assert detect_capacity(DEVICE) == torch_total
    return f"nvml {nvml_total / MiB:.0f} MiB, torch {torch_total / MiB:.0f} MiB ({diff:.3%} apart)"


def check_make_probe_reads() -> str:
    """The combined probe reads the card, this process and SM utilisation."""
    from gpubroker.deployments.enforce.probes import CudaProbe, make_probe

    probe = make_probe(DEVICE, None)
    assert isinstance(probe, CudaProbe)
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device=DEVICE)
    reading = probe.read()
    del keep
    assert reading.total_bytes > 0 and 0 < reading.used_bytes <= reading.total_bytes
    assert reading.process_bytes >= 64 * MiB, reading
    assert 0.0 <= reading.free_frac <= 1.0
    nvml = "nvml" if probe.nvml is not None else "torch only (NVML did not initialise)"
    return f"{nvml}; used {reading.used_bytes / MiB:.0f} MiB, process {reading.process_bytes / MiB:.0f} MiB, sm {reading.sm_util_frac}"


def check_fraction_caps_process() -> str:
    """TorchCudaProbe.enforce caps the allocator: past the grant raises OOM, under it works."""
    from gpubroker.deployments.enforce.probes import TorchCudaProbe
    from gpubroker.deployments.models import is_oom

    probe = TorchCudaProbe(0)
    torch.cuda.empty_cache()
    grant = torch.cuda.memory_reserved(0) + 256 * MiB
    probe.enforce(grant)
    try:
        small = torch.empty(64 * MiB, dtype=torch.uint8, device=DEVICE)
        del small
        raised = None
        try:
            big = torch.empty(512 * MiB, dtype=torch.uint8, device=DEVICE)
            del big
        except Exception as exc:  # torch.OutOfMemoryError
            raised = exc
        assert raised is not None, f"allocating 512 MiB under a {grant / MiB:.0f} MiB grant did not raise"
        assert is_oom(raised), f"raised {type(raised).__name__}, which is_oom does not recognise"
        name = type(raised).__name__
    finally:
        probe.enforce(None)
        torch.cuda.empty_cache()
    ok = torch.empty(512 * MiB, dtype=torch.uint8, device=DEVICE)  # cap lifted again
    del ok
    torch.cuda.empty_cache()
    return f"grant {grant / MiB:.0f} MiB: 64 MiB ok, 512 MiB -> {name}; cap lifted after"


def _check_calibration(ref: str, options: dict) -> str:
    from gpubroker.deployments.models import load_adapter
    from gpubroker.deployments.replica.calibration import calibrate

    adapter = load_adapter(ref, options, DEVICE)
    try:
        params = _param_bytes(adapter.torch_module())
        cal = calibrate(adapter, device=DEVICE)
        err = abs(cal.weights_bytes - params) / params
        assert cal.method == "cuda", cal.method
        assert err < 0.10, (
            f"fitted weights {cal.weights_bytes} vs parameters {params} ({err:.1%} off); points {cal.points}"
        )
        assert cal.bytes_per_unit > 0, f"bytes_per_unit {cal.bytes_per_unit}; points {cal.points}"
        return (
            f"weights {cal.weights_bytes / MiB:.1f} MiB vs params {params / MiB:.1f} MiB ({err:.2%}), "
            f"{cal.bytes_per_unit / 1024:.1f} KiB per {cal.unit[:-1]}, {cal.seconds:.2f}s"
        )
    finally:
        del adapter
        torch.cuda.empty_cache()


def check_calibration_mlp() -> str:
    """Calibration on cuda: weights within 10% of parameter bytes, positive bytes per item (mlp)."""
    return _check_calibration("mlp", {"in_dim": 1024, "hidden": 8192})


def check_calibration_minilm() -> str:
    """Calibration on cuda: weights within 10% of parameter bytes, positive bytes per token (minilm)."""
    return _check_calibration("minilm", {})


def check_oom_split_retry() -> str:
    """A real CUDA OOM inside a batch is split and retried; every result comes back in order."""
    from gpubroker.deployments.enforce.probes import TorchCudaProbe
    from gpubroker.deployments.replica.oom import split_retry

    item_bytes = 64 * MiB
    probe = TorchCudaProbe(0)
    torch.cuda.empty_cache()
    probe.enforce(torch.cuda.memory_reserved(0) + int(3.5 * item_bytes))
    calls: list[int] = []

    def run_batch(items):
        calls.append(len(items))
        buf = torch.empty(len(items) * item_bytes, dtype=torch.uint8, device=DEVICE)
        buf.fill_(1)
        total = int(buf[::item_bytes].sum().item())  # touches one byte per item
        assert total == len(items)
        return [x * 2 for x in items]

    splits: list[int] = []
    try:
        out = split_retry(run_batch, list(range(8)), on_split=splits.append)
    finally:
        probe.enforce(None)
        torch.cuda.empty_cache()
    assert out == [x * 2 for x in range(8)], out
    assert splits, "no batch was split: the cap did not bite"
    return f"8 items under a 3.5-item cap: calls {calls}, splits {splits}, all 8 results in order"


CHECKS = [
    ("nvml vs torch total", check_nvml_torch_total),
    ("make_probe reads", check_make_probe_reads),
    ("memory fraction caps", check_fraction_caps_process),
    ("calibration mlp", check_calibration_mlp),
    ("calibration minilm", check_calibration_minilm),
    ("oom split-retry", check_oom_split_retry),
]


def test_nvml_and_torch_agree_on_total():
    check_nvml_torch_total()


def test_make_probe_reads():
    check_make_probe_reads()


def test_memory_fraction_caps_process():
    check_fraction_caps_process()


def test_calibration_mlp_on_cuda():
    check_calibration_mlp()


def test_calibration_minilm_on_cuda():
    check_calibration_minilm()


def test_oom_split_retry_on_cuda():
    check_oom_split_retry()
