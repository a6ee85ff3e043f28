"""``mlp``: a small multi-layer perceptron, {"x": [in_dim floats]} -> {"logits": [out_dim floats]}."""

from __future__ import annotations

from typing import Any

from gpubroker.deployments.models.base import TorchAdapter, as_float_list, require_fields


class MlpAdapter(TorchAdapter):
    """Linear -> ReLU -> Linear, random weights from a fixed seed (replicas agree)."""

    name = "mlp"
    OPTIONS = {"in_dim": 64, "hidden": 256, "out_dim": 10, "seed": 0}

    def __init__(self, **options: Any):
        super().__init__(**options)
        for key in ("in_dim", "hidden", "out_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model 'mlp': option {key} must be a positive integer, got {value!r}")

    def build(self):
        from torch import nn

        return nn.Sequential(nn.Linear(self.in_dim, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.out_dim))

    def validate(self, item: Any) -> dict:
        data = require_fields(item, ("x",))
        return {"x": as_float_list(data["x"], "x", self.in_dim)}

    def batch_tensor(self, items: list):
        import torch

        return torch.tensor([list(item["x"]) for item in items], dtype=torch.float32)

    def example_input(self, cost: int | None = None) -> dict:
        return {"x": [((i * 37) % 17) / 17.0 - 0.5 for i in range(self.in_dim)]}
