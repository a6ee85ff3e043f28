"""Latency and memory profiles of the models the simulator emulates.

A model reads its profile from its ``profile:`` key (``gpubroker.quotas.config.ModelProfile``;
``gpubroker calibrate`` measures and writes it); a model without one, from its ``options``
(those of the ``profiled`` emulation, or of a class that takes the same figures):

- ``a_ms``: fixed cost of one batch (kernel launches, transfers), ms
- ``c_ms``: cost per batch unit (request, or token for token models), ms
- ``token_ms``: extra cost per token whatever the unit, ms (default 0; a request without a
  length counts 1 token, as in the adapter)
- ``weights_bytes``: memory held by the weights (a size: "2GiB")
- ``bytes_per_item``: memory per batch unit (per request, or per token for token models)
- ``unit``: "requests" or "tokens" (default: the model's ``batch.unit``)

so one batch of cost ``b`` (requests, or tokens) holding ``tokens`` tokens runs for
``a_ms + c_ms·b + token_ms·tokens`` ms (alone on the card) and needs
``weights_bytes + bytes_per_item·b`` bytes -- the same model ``deployments/models/profiled.py``
sleeps and allocates, so the broker sees the same behaviour live as in simulation.

A model with neither (minilm, mlp, cnn, a user class) gets the DEFAULT profile: a_ms 5,
c_ms 1 (token models: c_ms 0.01 per token), weights = half of ``quota.min``, and
``bytes_per_item`` such that a batch at ``batch.ceiling`` fills ``quota.base`` (also the
memory a profile leaves out). It is a placeholder to exercise the policy, not a measurement.

Token models also need request lengths when the arrivals carry none (Poisson, gamma):
``mean_tokens`` (default 128) and lognormal lengths with CV ``tokens_cv`` (default
0.5), clipped to [1, 8·mean]. The trace carries its own lengths (ContextTokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpubroker.quotas.config import ModelSpec
from gpubroker.quotas.sizes import parse_size

DEFAULT_A_MS = 5.0
DEFAULT_C_MS = 1.0
DEFAULT_TOKEN_C_MS = 0.01
DEFAULT_MEAN_TOKENS = 128.0
DEFAULT_TOKENS_CV = 0.5


@dataclass(frozen=True)
class Profile:
    """What one emulated model costs in time and memory."""

    a_ms: float  # fixed cost per batch, ms
    c_ms: float  # cost per batch unit (request or token), ms
    token_ms: float  # extra cost per token whatever the unit, ms
    weights_bytes: int  # resident weights
    bytes_per_item: float  # memory per batch unit (request or token)
    unit: str  # "requests" or "tokens"
    mean_tokens: float = DEFAULT_MEAN_TOKENS  # token models: mean request length without a trace
    tokens_cv: float = DEFAULT_TOKENS_CV  # token models: CV of request lengths without a trace
    profiled: bool = True  # False: the documented default profile stood in

    def latency_ms(self, cost: float, tokens: float = 0) -> float:
        """Batch latency alone on the card: a + c·cost (+ token_ms·tokens)."""
        return self.a_ms + self.c_ms * cost + self.token_ms * tokens

    def memory_bytes(self, cost: float) -> float:
        """Memory of a batch of ``cost`` units: weights + bytes_per_item·cost."""
        return self.weights_bytes + self.bytes_per_item * cost

    def saturation_rps(self, batch: int) -> float:
        """Back-to-back throughput of batches of ``batch`` requests (token models: of mean length)."""
        per = self.mean_tokens if self.unit == "tokens" else 1.0
        return 1000.0 * batch / self.latency_ms(batch * per, batch * per)


def _num(options: dict[str, Any], key: str, default: float, where: str) -> float:
    value = options.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.{key} ({value!r}) is not a number; write e.g. {key}: {default:g}") from None
    if out < 0:
        raise ValueError(f"{where}.{key} ({value!r}) is negative; it must be >= 0")
    return out


def _figures(spec: ModelSpec) -> tuple[dict[str, Any], str]:
    """The figures that define the profile and the key they are under in the config."""
    if spec.profile is not None:  # validated, sizes in bytes
        figures = {k: getattr(spec.profile, k) for k in type(spec.profile).model_fields}
        return {k: v for k, v in figures.items() if v is not None}, "profile"
    return dict(spec.options), "options"  # the profiled emulation's (or a class that takes them)


def profile_for(name: str, spec: ModelSpec) -> Profile:
    """The profile of one model: its ``profile:`` (or a profiled model's options), else the documented default."""
    opts, key = _figures(spec)
    unit = str(opts.get("unit", spec.batch.unit))
    if unit not in ("requests", "tokens"):
        raise ValueError(f"models.{name}.{key}.unit ({unit!r}) is not a unit; use requests or tokens")
    profiled = spec.profile is not None or spec.model == "profiled"
    tokens = unit == "tokens"
    where = f"models.{name}.{key}"
    a_ms = _num(opts, "a_ms", DEFAULT_A_MS, where)
    c_ms = _num(opts, "c_ms", DEFAULT_TOKEN_C_MS if tokens else DEFAULT_C_MS, where)
    token_ms = _num(opts, "token_ms", 0.0, where)
    if "weights_bytes" in opts:
        weights = parse_size(opts["weights_bytes"])
    else:
        weights = spec.quota.min // 2
    if "bytes_per_item" in opts:
        per = float(parse_size(opts["bytes_per_item"]))
    else:
        per = max(0.0, (spec.quota.base - weights) / max(1, spec.batch.ceiling))
    mean_tokens = _num(opts, "mean_tokens", DEFAULT_MEAN_TOKENS, where) or DEFAULT_MEAN_TOKENS
    tokens_cv = _num(opts, "tokens_cv", DEFAULT_TOKENS_CV, where)
    if a_ms + c_ms + token_ms <= 0:
        raise ValueError(f"models.{name}: a_ms, c_ms and token_ms are all 0; give the batch some cost (e.g. a_ms: 5)")
    return Profile(
        a_ms=a_ms,
        c_ms=c_ms,
        token_ms=token_ms,
        weights_bytes=int(weights),
        bytes_per_item=per,
        unit=unit,
        mean_tokens=mean_tokens,
        tokens_cv=tokens_cv,
        profiled=profiled,
    )
