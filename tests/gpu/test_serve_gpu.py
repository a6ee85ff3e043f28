"""Real Ray Serve on a CUDA card (skipped without CUDA or Ray): the serving path end to end.

Two fleets, one after the other, on one local Ray (the card's GPU counted by Ray):

- **one card** (``gpu: {device: cuda:0}``): a model that allocates what it is sent
  (``tests.gpu.cuda_alloc_model``) under ``quota: {base: 512MiB, max: 640MiB}`` beside an mlp.
  Its replica caps torch's allocator at its grant (``CudaFractionLimiter``) before the model
  loads: what fits is answered, an item that cannot fit alone gets 507 naming its need and the
  grant, torch's peak reserved bytes (``max_memory_reserved``, read in the replica) stay within
  the largest grant, the OOMs reach the broker, and the neighbour answers every request meanwhile.
- **gpus: auto**: the broker finds the card through Ray (its ``GPU`` resource) and NVML on its
  node (a task pinned by node id), places two mlp replicas on it, which hold half of the
  card's ``num_gpus`` each (Ray's available GPU reads 0 of 1) and run on CUDA (the model's
  measured use on the card is above 0); ``status`` shows the card with NVML's capacity.

``scripts/gpu-check --serve`` runs this module; CI has no GPU and skips it.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

torch = pytest.importorskip("torch")
pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1024**2
MAX_GRANT_BYTES = 640 * MiB

ONE_CARD = """
broker: {name: gpubroker-gpu, namespace: gpubroker-gpu, control_interval_s: 0.5,
         report_interval_s: 0.25, transfer_timeout_s: 10, metrics_port: 0, http_host: 127.0.0.1,
         http_port: 8000}
gpu: {device: "cuda:0", reserve_frac: 0.0, emergency_free_frac: 0.02}
models:
  hog:
    model: tests.gpu.cuda_alloc_model:CudaAllocModel
    options: {hold_ms: 100}
    quota: {min: 256MiB, base: 512MiB, max: 640MiB}
    batch: {floor: 1, ceiling: 16, initial: 8}
    wait: {min_ms: 0, max_ms: 50}
    slo_p95_ms: 5000
    request_timeout_s: 120
    control: {window_s: 20, min_samples: 5}
  mlp:
    model: mlp
    quota: {min: 1GiB, base: 1GiB, max: 1GiB}
    batch: {floor: 2, ceiling: 32}
    slo_p95_ms: 2000
    control: {window_s: 20, min_samples: 5}
"""

AUTO = """
broker: {name: gpubroker-gpu-auto, namespace: gpubroker-gpu-auto, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, http_host: 127.0.0.1, http_port: 8000}
gpu: {reserve_frac: 0.05, emergency_free_frac: 0.02}
gpus: auto
models:
  mlp:
    model: mlp
    replicas: 2
    quota: {min: 512MiB, base: 1GiB, max: 2GiB}
    batch: {floor: 2, ceiling: 32}
    slo_p95_ms: 2000
"""


def _nvml_process_bytes() -> dict[int, int]:
    """Bytes each process holds on card 0, by pid, as NVML counts them ({} where it cannot)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {p.pid: int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:  # noqa: BLE001 - a reading for the printout only
        return {}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _deploy(text: str):
    from gpubroker.deployments.cluster.fleet import deploy, wait_serving
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.quotas.config import parse_config_text

    cfg = parse_config_text(text)
    port = free_port()
    broker = deploy(cfg, text, http_port=port, timeout_s=300)
    url = f"http://127.0.0.1:{port}"
    wait_serving(cfg, url, timeout_s=240)
    return cfg, broker, url


def test_one_cuda_card_grant_holds_and_neighbour_answers(ray_local):
    from gpubroker.deployments.cluster.fleet import APP_NAME, teardown
    from tests.integration._fleet import burst, replica_status
    from tests.integration._load import open_loop_bg

    cfg, broker, url = _deploy(ONE_CARD)
    try:
        hog = replica_status(APP_NAME, "hog")
        limit = hog["memory_limit"]
        assert limit["kind"] == "cuda_fraction" and limit["grant_bytes"] == 512 * MiB, limit

        mlp_thread, mlp_codes = open_loop_bg(url, "mlp", 8.0, 12.0, {"input": {"x": [0.1] * 64}}, seed=3, timeout_s=60)
        bodies = [("fits", {"input": {"mb": 64}})] * 48 + [("oversize", {"input": {"mb": 1024}})] * 6
        results = asyncio.run(burst(url, "hog", bodies))
        mlp_thread.join(timeout=120)

        codes = Counter((kind, status) for kind, status, _ in results)
        st = ray_local.get(broker.status.remote(), timeout=30)
        # after the burst: the same process still serves, and says the most its allocator reserved
        again = httpx.post(f"{url}/v1/models/hog/infer", json={"input": {"mb": 8}}, timeout=60)
        after = replica_status(APP_NAME, "hog")
        peak = again.json()["output"]["peak_reserved_bytes"] if again.status_code == 200 else None
        nvml = _nvml_process_bytes().get(after["pid"])
        summary = (dict(codes), peak, after["memory_limit"], st["models"]["hog"], dict(mlp_codes))
        print(
            f"hog: {dict(codes)}; torch peak reserved {peak / MiB if peak else 0:.0f} MiB (largest grant "
            f"{MAX_GRANT_BYTES / MiB:.0f} MiB); NVML now {'n/a' if nvml is None else f'{nvml / MiB:.0f} MiB'} "
            f"for pid {after['pid']} (its CUDA context included); mlp: {dict(mlp_codes)}; "
            f"grants {[(m, s['grant_bytes'] >> 20) for m, s in st['models'].items()]} MiB; "
            f"hog cap {st['models']['hog']['max_batch_size']}, oom_splits {st['models']['hog']['oom_splits']}"
        )
        assert again.status_code == 200 and after["pid"] == hog["pid"], (again.text, after["pid"], hog["pid"])
        assert codes[("fits", 200)] == 48, summary
        assert codes[("oversize", 507)] == 6, summary
        oom = next(body for kind, status, body in results if kind == "oversize")
        assert oom["attempted_bytes"] == 1024 * MiB and 0 < oom["grant_bytes"] <= MAX_GRANT_BYTES, oom
        ok = [body["output"] for kind, status, body in results if status == 200]
        assert all(o["held_bytes"] == 64 * MiB and o["device"].startswith("cuda") for o in ok), ok[:2]
        # torch's allocator never reserved more than the largest grant (the fraction is its cap),
        # and the cap was not idle: batches of several 64 MiB items ran under it
        assert 128 * MiB <= peak <= MAX_GRANT_BYTES, summary
        assert st["models"]["hog"]["oom_splits"] > 0, summary
        assert set(mlp_codes) == {200}, summary
        assert st["granted_bytes"] <= st["usable_bytes"], st
    finally:
        teardown(cfg, name=cfg.broker.name, namespace=cfg.broker.namespace)


def test_gpus_auto_finds_the_card_and_places_replicas_on_it(ray_local):
    from gpubroker.deployments.cluster.fleet import teardown

    total = int(torch.cuda.get_device_properties(0).total_memory)
    cfg, broker, url = _deploy(AUTO)
    try:
        for _ in range(20):
            r = httpx.post(f"{url}/v1/models/mlp/infer", json={"input": {"x": [0.1] * 64}}, timeout=60)
            assert r.status_code == 200, r.text
        st = ray_local.get(broker.status.remote(), timeout=30)
        cards = st["cards"]
        print(f"cards: {[(c['id'], c['node'], c['device'], c['capacity_bytes'] >> 20, c['models']) for c in cards]}")
        assert len(cards) == torch.cuda.device_count(), cards
        card = cards[0]
        assert card["device"] == "cuda" and card["live"], card
        # NVML's total on the node, as the discovery task read it, is torch's within 1%
        assert abs(card["capacity_bytes"] - total) / total < 0.01, (card["capacity_bytes"], total)
        placed = sum(c["models"].get("mlp", {}).get("replicas", 0) for c in cards)
        assert placed == 2, cards
        # each replica asked Ray for its share of the card's GPU (1000 // 2 units: num_gpus 0.5)
        held_gpus = ray_local.cluster_resources().get("GPU", 0.0) - ray_local.available_resources().get("GPU", 0.0)
        print(f"GPU held by the fleet: {held_gpus:g} of {ray_local.cluster_resources().get('GPU', 0.0):g}")
        assert held_gpus == pytest.approx(1.0), held_gpus
        assert card["granted_bytes"] <= card["usable_bytes"], card
        assert st["models"]["mlp"]["used_bytes"] > 0, st["models"]["mlp"]
    finally:
        teardown(cfg, name=cfg.broker.name, namespace=cfg.broker.namespace)
