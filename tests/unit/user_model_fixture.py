"""User model classes for resolve_model tests (imported by path, like an operator's model)."""

from gpubroker.deployments.models import InputError, ModelAdapter


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


class AsyncModel:
    """``async def`` predict and load, as a user writes them."""

    def __init__(self):
        self.loaded = False

    async def load(self, device):
        self.loaded = True

    async def predict(self, items):
        import asyncio

        await asyncio.sleep(0)
        return [{"y": item["x"] + 1, "loaded": self.loaded} for item in items]


class EncoderModel:
    """Its torch module is an attribute called ``encoder``, and a second one ``heads[0]``."""

    def __init__(self):
        import torch

        self.encoder = torch.nn.Linear(64, 32)  # 64*32 + 32 float32 = 8,320 bytes
        self.heads = [torch.nn.Linear(32, 2)]  # 32*2 + 2 = 264 bytes

    def predict(self, items):
        import torch

        with torch.no_grad():
            out = self.heads[0](self.encoder(torch.zeros(len(items), 64)))
        return list(out)


def protocol_subclass():
    """A class that subclasses the public ``gpubroker.Model`` (defined in a function: the
    fixture module must import without gpubroker's top package for the older tests)."""
    from gpubroker import Model

    class Scorer(Model):
        def __init__(self, k: int = 2):
            self.k = k

        def predict(self, items):
            return [item * self.k for item in items]

    return Scorer
