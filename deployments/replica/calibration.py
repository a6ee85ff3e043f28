"""Start-up memory calibration: bytes(b) ~ weights + bytes_per_unit * b.

``calibrate`` runs the model on a few batches (``costs`` copies of ``example_input()``; the
x value of a point is the batch's cost in the model's unit, so token models are fitted per
token) and measures the memory of each run:

- ``declared``: the adapter declares its memory model (``profiled`` emulation): no run needed.
- ``cuda``: resident bytes + (``max_memory_allocated`` - allocated before the run), with the
  peak counter reset before each run, after one warm-up run (cuBLAS workspaces etc. are then
  resident and not counted as activations). Resident = parameter bytes when known.
- ``hooks`` (cpu): weights + the bytes of every distinct tensor the torch modules output during
  the run (forward hooks). That is the total activation volume, an upper bound of the peak --
  the safe side for a batch ceiling.
- ``probe``: no torch module to hook, a probe given: growth of the process's memory.
- ``none``: nothing to measure: weights only, bytes_per_unit 0.

A least-squares line through the points gives the model, clamped to >= 0 (STYLE.md #5).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpubroker.deployments.models.base import ModelAdapter


@dataclass(frozen=True)
class Calibration:
    weights_bytes: int  # fitted intercept: weights + fixed per-batch overhead
    bytes_per_unit: float  # fitted slope: bytes per batch unit (request or token)
    points: tuple[tuple[float, float], ...] = ()  # (batch cost, measured bytes)
    unit: str = "requests"  # the model's cost unit
    method: str = "none"  # declared | cuda | hooks | probe | none
    seconds: float = 0.0  # wall time calibration took

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["points"] = [list(p) for p in self.points]
        return data


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clamped to >= 0."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var <= 0:
        return max(0.0, my), 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    if slope < 0:
        return max(0.0, my), 0.0
    intercept = my - slope * mx
    if intercept < 0:  # refit through the origin
        slope = sum(x * y for x, y in points) / max(sum(x * x for x, _ in points), 1e-12)
        return 0.0, max(0.0, slope)
    return intercept, slope


def _tensor_bytes(obj: Any, seen: set, torch) -> int:
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.dtype)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict) or hasattr(obj, "values") and callable(obj.values):
        try:
            return sum(_tensor_bytes(v, seen, torch) for v in obj.values())
        except Exception:
            return 0
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, torch) for v in obj)
    return 0


def _hooked_bytes(module, run) -> int:
    """Bytes of distinct tensors output by ``module``'s submodules while ``run()`` executes."""
    import torch

    seen: set = set()
    total = [0]

    def hook(_mod, _inp, out):
        total[0] += _tensor_bytes(out, seen, torch)

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return total[0]


def calibrate(
    adapter: ModelAdapter,
    probe: Any = None,
    costs: Sequence[int] = (1, 2, 4, 8),
    device: str = "cpu",
) -> Calibration:
    """Fit the adapter's memory model (see the module docstring). The adapter must be loaded."""
    started = time.perf_counter()
    unit = getattr(adapter, "cost_unit", "requests")

    def done(weights: float, slope: float, points, method: str) -> Calibration:
        return Calibration(
            int(round(max(0.0, weights))),
            float(max(0.0, slope)),
            tuple((float(x), float(y)) for x, y in points),
            unit,
            method,
            time.perf_counter() - started,
        )

    declared = adapter.declared_memory()
    if declared is not None:
        weights, per_unit = declared
        example = _example(adapter)
        unit_cost = adapter.cost(example) if example is not None else 1
        points = [(c * unit_cost, weights + per_unit * c * unit_cost) for c in costs]
        return done(weights, per_unit, points, "declared")

    weights = adapter.weights_bytes()
    example = _example(adapter)
    if example is None:
        return done(weights, 0.0, [], "none")
    example = adapter.validate(example)
    batches = [[example] * int(c) for c in costs if int(c) > 0]
    xs = [float(sum(adapter.cost(item) for item in batch)) for batch in batches]
    module = adapter.torch_module()

    if device.startswith("cuda"):
        import torch

        adapter.predict(batches[0])  # warm-up: kernels, cuBLAS workspace, allocator pools
        torch.cuda.synchronize(device)
        resident = weights or torch.cuda.memory_allocated(device)
        points = []
        for x, batch in zip(xs, batches):
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            adapter.predict(batch)
            torch.cuda.synchronize(device)
            points.append((x, resident + torch.cuda.max_memory_allocated(device) - before))
        intercept, slope = fit_line(points)
        return done(intercept, slope, points, "cuda")

    if module is not None:
        points = [
            (x, weights + _hooked_bytes(module, lambda b=batch: adapter.predict(b))) for x, batch in zip(xs, batches)
        ]
        intercept, slope = fit_line(points)
        return done(intercept, slope, points, "hooks")

    if probe is not None:
        base = probe.read().process_bytes
        points = []
        for x, batch in zip(xs, batches):
            adapter.predict(batch)
            points.append((x, weights + max(0, probe.read().process_bytes - base)))
        intercept, slope = fit_line(points)
        return done(max(intercept, weights), slope, points, "probe")

    return done(weights, 0.0, [], "none")


def _example(adapter: ModelAdapter) -> Any:
    try:
        return adapter.example_input()
    except NotImplementedError:
        return None


def replica_calibration(adapter: Any, probe: Any, device: str, token_priced: bool, name: str) -> dict[str, Any]:
    """What a replica registers with: its measured memory model, else the adapter's declared
    sizes (a failed calibration serves uncalibrated rather than not at all)."""
    out: dict[str, Any] = {"cost_unit": "tokens" if token_priced else "requests"}
    try:
        result = calibrate(adapter, probe, device=device)
        out.update(result.to_dict() if hasattr(result, "to_dict") else dict(result))
        return out
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("ray.serve").warning(
            "gpubroker: calibration of %s failed (%r); using declared sizes", name, exc
        )
    declared = adapter.declared_memory()
    if declared is not None:
        out["weights_bytes"], out["bytes_per_unit"] = int(declared[0]), float(declared[1])
    else:
        out["weights_bytes"], out["bytes_per_unit"] = int(adapter.weights_bytes()), 0.0
    return out
