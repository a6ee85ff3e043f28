"""``cnn``: a small conv net, {"image": 3x32x32 nested lists} -> {"logits": [10 floats]}."""

from __future__ import annotations

from typing import Any

from gpubroker.deployments.models.base import TorchAdapter, nested_shape, require_fields

IMAGE_SHAPE = (3, 32, 32)


class CnnAdapter(TorchAdapter):
    """Two conv/ReLU/max-pool blocks and a linear head; random weights from a fixed seed."""

    name = "cnn"
    OPTIONS = {"channels": 16, "out_dim": 10, "seed": 0}

    def build(self):
        from torch import nn

        c = int(self.channels)
        return nn.Sequential(
            nn.Conv2d(3, c, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x16
            nn.Conv2d(c, 2 * c, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8
            nn.Flatten(),
            nn.Linear(2 * c * 8 * 8, int(self.out_dim)),
        )

    def validate(self, item: Any) -> dict:
        import torch

        data = require_fields(item, ("image",))
        image = nested_shape(data["image"], "image", IMAGE_SHAPE)
        return {"image": torch.tensor(image, dtype=torch.float32)}

    def batch_tensor(self, items: list):
        import torch

        return torch.stack([torch.as_tensor(item["image"], dtype=torch.float32) for item in items])

    def example_input(self, cost: int | None = None) -> dict:
        c, h, w = IMAGE_SHAPE
        return {
            "image": [[[((k * 131 + y * 17 + x) % 29) / 29.0 for x in range(w)] for y in range(h)] for k in range(c)]
        }
