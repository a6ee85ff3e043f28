"""User model classes for resolve_model tests (imported by path, like an operator's model)."""

from deployments.models import InputError, ModelAdapter


class EchoModel:
    """Duck-typed: only __init__ and predict; everything else gets defaults."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def predict(self, items):
        return [{"y": float(item["x"]) * self.scale} for item in items]


class TokenModel:
    """Duck-typed with the optional methods."""

    cost_unit = "tokens"

    def __init__(self):
        self.device = None

    def load(self, device):
        self.device = device

    def validate(self, item):
        if not isinstance(item.get("words"), list):
            raise InputError("words", "expected a list of strings")
        return item

    def cost(self, item):
        return len(item["words"])

    def example_input(self, cost=None):
        return {"words": ["w"] * (cost or 4)}

    def predict(self, items):
        return [len(item["words"]) for item in items]


class SubclassModel(ModelAdapter):
    name = "subclass"
    OPTIONS = {"bias": 0.0}

    def predict(self, items):
        return [self.bias for _ in items]


class NoPredict:
    def run(self, items):
        return items


not_a_class = 42
