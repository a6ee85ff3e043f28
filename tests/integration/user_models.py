"""User models written from the README's protocol, for tests/integration/test_first_use.py
(imported by path by the replicas, like an operator's model)."""

from gpubroker.deployments.models import InputError


class StrictModel:
    """``validate`` and no ``example_input`` (it is optional): ``up`` must not wait on it."""

    def __init__(self, scale: float = 2.0):
        self.scale = scale

    def load(self, device: str) -> None:
        self.device = device

    def validate(self, item):
        if not isinstance(item, dict) or not isinstance(item.get("x"), (int, float)):
            raise InputError("x", "expected a number")
        return item

    def predict(self, items: list) -> list:
        return [{"y": float(item["x"]) * self.scale} for item in items]


class WrongExampleModel(StrictModel):
    """An ``example_input`` its own ``validate`` refuses: ``up`` must stop, naming it."""

    def example_input(self, cost=None):
        return {"x": "one"}
