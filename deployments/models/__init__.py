"""Model adapters: the protocol the replica serves, the built-ins, and user-model resolution.

``resolve_model(ref)`` takes a built-in name (minilm, mlp, cnn, profiled) or an import path
'pkg.module:Class' and returns a ModelAdapter subclass. A user class need not subclass
ModelAdapter: it only needs ``predict(items)``; it is wrapped so that the optional methods
(load, validate, cost, example_input, set_memory_limit, weights_bytes) get defaults.
Built-ins are imported lazily, so importing this package does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deployments.models.base import (
    EmulatedOOM,
    InputError,
    ModelAdapter,
    is_oom,
    module_bytes,
)


def _minilm() -> type:
    from deployments.models.minilm import MiniLmAdapter

    return MiniLmAdapter


def _mlp() -> type:
    from deployments.models.mlp import MlpAdapter

    return MlpAdapter


def _cnn() -> type:
    from deployments.models.cnn import CnnAdapter

    return CnnAdapter


def _profiled() -> type:
    from deployments.models.profiled import ProfiledAdapter

    return ProfiledAdapter


# Built-in name -> its class, imported statically inside a function (so torch loads only when used).
BUILTINS: dict[str, Callable[[], type]] = {"minilm": _minilm, "mlp": _mlp, "cnn": _cnn, "profiled": _profiled}

__all__ = [
    "BUILTINS",
    "EmulatedOOM",
    "InputError",
    "ModelAdapter",
    "ModelRefError",
    "is_oom",
    "load_adapter",
    "resolve_model",
]


class ModelRefError(ValueError):
    """A model reference that cannot be resolved to a usable class."""


class DuckAdapter(ModelAdapter):
    """Wraps a user class that follows the protocol by shape only (no ModelAdapter base).

    ``user_class`` is set on the subclass that ``resolve_model`` creates for each user class.
    """

    user_class: type = object

    def __init__(self, **options: Any):
        self.options = dict(options)
        self.device = "cpu"
        self.memory_limit_bytes = None
        self.inner = self.user_class(**options)  # Python's TypeError names an unexpected keyword
        unit = getattr(self.inner, "cost_unit", "requests")
        if unit not in ("requests", "tokens"):
            raise ValueError(f"model '{self.name}': cost_unit must be 'requests' or 'tokens', got {unit!r}")
        self.cost_unit = unit

    def _call(self, method: str, *args: Any) -> tuple[bool, Any]:
        fn = getattr(self.inner, method, None)
        if fn is None or not callable(fn):
            return False, None
        return True, fn(*args)

    def load(self, device: str) -> None:
        super().load(device)
        self._call("load", device)

    def set_memory_limit(self, grant_bytes: int | None) -> None:
        super().set_memory_limit(grant_bytes)
        self._call("set_memory_limit", grant_bytes)

    def validate(self, item: Any) -> Any:
        found, out = self._call("validate", item)
        return out if found else item

    def cost(self, item: Any) -> int:
        found, out = self._call("cost", item)
        return int(out) if found else 1

    def predict(self, items: list) -> list:
        out = list(self.inner.predict(list(items)))
        if len(out) != len(items):
            raise RuntimeError(f"model '{self.name}': predict returned {len(out)} outputs for {len(items)} inputs")
        return out

    def example_input(self, cost: int | None = None) -> Any:
        fn = getattr(self.inner, "example_input", None)
        if fn is None:
            raise NotImplementedError(f"model '{self.name}' has no example_input(); calibration cannot run it")
        return fn(cost)

    def torch_module(self) -> Any:
        found, out = self._call("torch_module")
        if found:
            return out
        for attr in ("module", "model", "net"):
            candidate = getattr(self.inner, attr, None)
            if module_bytes(candidate) > 0:
                return candidate
        return None

    def weights_bytes(self) -> int:
        found, out = self._call("weights_bytes")
        return int(out or 0) if found else module_bytes(self.torch_module())

    def declared_memory(self) -> tuple[int, float] | None:
        found, out = self._call("declared_memory")
        return tuple(out) if found and out is not None else None  # type: ignore[return-value]


def _import_ref(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ModelRefError(
            f"model '{ref}' is neither a built-in ({', '.join(BUILTINS)}) nor an import path; "
            "write a built-in name or 'pkg.module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ModelRefError(
                f"model '{ref}': module '{module_name}' not found (no module named '{missing}'); "
                "check the path and that the package is installed or on PYTHONPATH"
            ) from exc
        raise ModelRefError(
            f"model '{ref}': module '{module_name}' failed to import: it needs '{missing}', which is not installed"
        ) from exc
    except Exception as exc:
        raise ModelRefError(f"model '{ref}': importing module '{module_name}' failed: {exc!r}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        hint = f" (classes there: {', '.join(classes)})" if classes else ""
        raise ModelRefError(f"model '{ref}': no class '{attr}' in module '{module_name}'{hint}") from None


def model_source(ref: str) -> bytes | None:
    """The source of a user model's module (``pkg.module:Class``), read from where Python would
    import it without importing it; None for a built-in or a module that cannot be found."""
    module = ref.partition(":")[0] if isinstance(ref, str) and ":" in ref else ""
    if not module:
        return None
    try:
        spec = importlib.util.find_spec(module)
        return Path(spec.origin).read_bytes() if spec is not None and spec.origin else None
    except (ImportError, ValueError, OSError):
        return None


def resolve_model(ref: str) -> type[ModelAdapter]:
    """Built-in name or 'pkg.module:Class' -> a ModelAdapter subclass (user classes wrapped)."""
    if not isinstance(ref, str) or not ref:
        raise ModelRefError(f"model reference must be a non-empty string, got {ref!r}")
    builtin = ref in BUILTINS
    obj = BUILTINS[ref]() if builtin else _import_ref(ref)
    if not isinstance(obj, type):
        raise ModelRefError(f"model '{ref}': '{ref.partition(':')[2]}' is a {type(obj).__name__}, not a class")
    if not callable(getattr(obj, "predict", None)):
        raise ModelRefError(
            f"model '{ref}': class {obj.__name__} has no predict(items) method; "
            "a model class needs predict(items) -> list (and optionally load(device), validate, cost)"
        )
    if issubclass(obj, ModelAdapter) or builtin:
        return obj
    return type(f"{obj.__name__}Adapter", (DuckAdapter,), {"user_class": obj, "name": ref, "__module__": __name__})


def load_adapter(ref: str, options: Mapping[str, Any] | None = None, device: str = "cpu") -> ModelAdapter:
    """Resolve, construct with ``options`` and load on ``device``."""
    cls = resolve_model(ref)
    adapter = cls(**dict(options or {}))
    adapter.load(device)
    return adapter
