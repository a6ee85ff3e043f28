"""The model adapter protocol (docs/models.md) and the errors the replica relies on.

Nothing here imports torch at module import time: ``is_oom`` looks torch up only if it is
already loaded (an exception can only be a torch OOM when torch is imported).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, ClassVar


class InputError(ValueError):
    """A request input the model refuses; the HTTP layer answers 422 naming ``field``."""

    def __init__(self, field: str, message: str):
        self.field = field  # the input field at fault, e.g. "text" or "image"; "body" for the whole item
        self.message = message  # what is wrong and how to fix it
        super().__init__(f"{field}: {message}")


class OutputCountError(RuntimeError):
    """``predict`` returned a different number of outputs than it was given inputs: the model broke
    its contract, no input is at fault (a failing batch is not split for it); the text holds the
    counts only, never an input."""


class EmulatedOOM(MemoryError):
    """Raised by emulated models (``profiled``) when weights + batch exceed the memory limit."""


def is_oom(exc: BaseException) -> bool:
    """True for CUDA/torch out-of-memory errors, MemoryError and EmulatedOOM, and the host
    allocation failures past an RLIMIT_DATA limit (torch's "can't allocate memory", ENOMEM)."""
    if isinstance(exc, MemoryError):  # includes EmulatedOOM
        return True
    if isinstance(exc, OSError) and exc.errno == 12:  # ENOMEM, e.g. mmap past RLIMIT_DATA
        return True
    if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):  # torch DefaultCPUAllocator
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    kinds = []
    for owner, name in ((torch, "OutOfMemoryError"), (getattr(torch, "cuda", None), "OutOfMemoryError")):
        kind = getattr(owner, name, None) if owner is not None else None
        if isinstance(kind, type):
            kinds.append(kind)
    if kinds and isinstance(exc, tuple(kinds)):
        return True
    # Older torch builds raise a plain RuntimeError with this text.
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class ModelAdapter:
    """Base class of every model the replica serves.

    Subclasses list their keyword options and defaults in ``OPTIONS``; ``__init__`` refuses
    any other name and stores each option as an attribute of the same name.
    """

    cost_unit: ClassVar[str] = "requests"  # or "tokens": what cost() counts
    name: ClassVar[str] = "model"  # shown in error messages
    OPTIONS: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            known = ", ".join(sorted(self.OPTIONS)) or "none"
            raise TypeError(
                f"model '{self.name}': unknown option(s) {', '.join(repr(u) for u in unknown)}; "
                f"known options: {known}. Remove or rename it under models.<name>.options"
            )
        # All options in ``self.options``; each also as an attribute unless that would hide a
        # method (profiled's ``weights_bytes`` option vs the ``weights_bytes()`` method).
        self.options = {key: options.get(key, default) for key, default in self.OPTIONS.items()}
        for key, value in self.options.items():
            if not callable(getattr(type(self), key, None)):
                setattr(self, key, value)
        self.device = "cpu"
        self.memory_limit_bytes: int | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def load(self, device: str) -> None:
        self.device = device

    def set_memory_limit(self, grant_bytes: int | None) -> None:
        """Record the replica's grant; real models are capped by the probe, not here."""
        self.memory_limit_bytes = grant_bytes

    # -- requests --------------------------------------------------------------------------
    def validate(self, item: Any) -> Any:
        """Return the normalised item or raise InputError naming the field."""
        return item

    def cost(self, item: Any) -> int:
        return 1

    def predict(self, items: list) -> list:
        raise NotImplementedError(f"{type(self).__name__}.predict(items) is not implemented")

    def example_input(self, cost: int | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.example_input() is not implemented")

    # -- embeddings (POST /v1/embeddings) --------------------------------------------------
    def embeds(self) -> bool:
        """Whether the model embeds text: its class defines ``embedding_input``."""
        return type(self).embedding_input is not ModelAdapter.embedding_input

    def embedding_input(self, text: str) -> Any:
        """The item ``predict`` takes to embed ``text``; a model that embeds defines it."""
        raise NotImplementedError(f"model '{self.name}' does not embed text (it has no embedding_input)")

    def embedding(self, output: Any) -> list[float]:
        """The vector in one of ``predict``'s outputs (``default_embedding`` unless overridden)."""
        return default_embedding(self.name, output)

    # -- memory ----------------------------------------------------------------------------
    def torch_module(self) -> Any:
        """The torch.nn.Module behind the adapter (every module among its attributes, whatever
        they are called), or None (used by calibration hooks)."""
        return attribute_module(self)

    def weights_bytes(self) -> int:
        """Bytes of parameters and buffers; 0 when unknown."""
        return module_bytes(self.torch_module())

    def declared_memory(self) -> tuple[int, float] | None:
        """(weights_bytes, bytes_per_unit) when the model knows it exactly (emulations)."""
        return None


def default_embedding(name: str, output: Any) -> list[float]:
    """An embedding model's output as its vector: the output itself (a list of numbers, a numpy
    array, a tensor) or its ``"embedding"`` entry; anything else names the fix."""
    value = output.get("embedding") if isinstance(output, Mapping) else output
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return [float(v) for v in value]
    raise ValueError(
        f"model '{name}': an output of predict is not a vector (a list of numbers or {{'embedding': [...]}}); "
        "define embedding(output) to return its vector"
    )


# ---------------------------------------------------------------------------------------------
# Helpers shared by the built-ins.


def _is_torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and obj is not None and isinstance(obj, torch.nn.Module)


def attribute_module(obj: Any) -> Any:
    """The torch modules among ``obj``'s attributes (directly, or in a list, tuple or dict), as
    one module: the module itself when there is one, an ``nn.ModuleList`` of them when there
    are several, None when there is none. Names do not matter: ``self.encoder`` counts as much
    as ``self.model``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    found: dict[int, Any] = {}
    for value in list(vars(obj).values()) if hasattr(obj, "__dict__") else []:
        members = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for member in members:
            if _is_torch_module(member):
                found.setdefault(id(member), member)
    modules = list(found.values())
    if len(modules) <= 1:
        return modules[0] if modules else None
    return torch.nn.ModuleList(modules)


def module_bytes(module: Any) -> int:
    """Parameter + buffer bytes of a torch module (0 for None or non-modules)."""
    if not _is_torch_module(module):
        return 0
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return int(total)


def require_fields(item: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """Check the item is a JSON object with exactly these fields."""
    allowed = required + optional
    if not isinstance(item, Mapping):
        want = ", ".join(f"'{f}'" for f in allowed) or "no fields"
        raise InputError("body", f"expected a JSON object with {want}, got {type(item).__name__}")
    for field in required:
        if field not in item:
            raise InputError(field, "required field is missing; add it")
    for key in item:
        if key not in allowed:
            raise InputError(str(key), f"unknown field; expected only {', '.join(allowed) or 'an empty object'}")
    return dict(item)


def as_float(value: Any, where: str) -> float:
    """One finite number (int/float, not bool) as float; InputError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(where.split("[")[0], f"expected a number at {where}, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise InputError(where.split("[")[0], f"expected a finite number at {where}, got {value!r}")
    return out


def as_float_list(value: Any, field: str, length: int) -> list[float]:
    """A flat list of ``length`` numbers, refusing anything else with a message naming the field."""
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise InputError(field, f"expected a list of {length} numbers, got {type(value).__name__}")
    if len(value) != length:
        raise InputError(field, f"expected shape [{length}], got [{len(value)}]")
    return [as_float(v, f"{field}[{i}]") for i, v in enumerate(value)]


def nested_shape(value: Any, field: str, expected: tuple[int, ...]) -> list:
    """Check nested lists have exactly ``expected`` shape and hold numbers.

    Returns the value as nested lists of floats. Errors say e.g.
    "image: expected shape [3, 32, 32], got [3, 32]".
    """
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    want = "[" + ", ".join(str(d) for d in expected) + "]"
    # Shape as seen by descending the first element at each level.
    shape: list[int] = []
    probe = value
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    if tuple(shape) != tuple(expected):
        got = "[" + ", ".join(str(d) for d in shape) + "]"
        if not shape:
            got = f"a {type(value).__name__}"
        raise InputError(field, f"expected shape {want}, got {got}")

    def walk(node: Any, depth: int, path: str) -> list:
        if depth == len(expected):
            return as_float(node, f"{field}{path}")  # type: ignore[return-value]
        if not isinstance(node, (list, tuple)) or len(node) != expected[depth]:
            got = len(node) if isinstance(node, (list, tuple)) else type(node).__name__
            raise InputError(
                field, f"expected shape {want}: {field}{path} should hold {expected[depth]} values, got {got}"
            )
        return [walk(child, depth + 1, f"{path}[{i}]") for i, child in enumerate(node)]

    return walk(value, 0, "")


def seeded_build(seed: int, build):
    """Build a torch module under a fixed seed without touching the global RNG stream."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return build()


class TorchAdapter(ModelAdapter):
    """A small torch model built under a fixed seed (so every replica has the same weights).

    Subclasses implement ``build()`` (returns an nn.Module) and ``batch_tensor(items)``;
    the module runs in eval mode under ``torch.inference_mode``.
    """

    module: Any = None

    def build(self):  # -> torch.nn.Module
        raise NotImplementedError

    def batch_tensor(self, items: list):  # -> torch.Tensor on CPU
        raise NotImplementedError

    def load(self, device: str) -> None:
        super().load(device)
        module = seeded_build(getattr(self, "seed", 0), self.build)
        self.module = module.to(device).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)

    def predict(self, items: list) -> list:
        import torch

        if not items:
            return []
        if self.module is None:
            raise RuntimeError(f"model '{self.name}' is not loaded; call load(device) first")
        with torch.inference_mode():
            logits = self.module(self.batch_tensor(items).to(self.device))
        return [{"logits": row} for row in logits.float().cpu().tolist()]
