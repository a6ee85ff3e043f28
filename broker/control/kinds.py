"""Model kinds: what the policy asks of a model, answered by the model's kind.

A kind is a plug-in of the one pure ``decide`` (``gpubroker.broker.control.policy``): it answers
its step (rules and anti-oscillation), its need, its working set, when it is idle, when and after
how long it takes its base back, whether a loan buys it anything, and its settings (an engine's
bounds included). The lending steps (``gpubroker.broker.control.lending``) ask the kind and never
test which one they have. Two kinds: request batching (``kind_batch``: batch cap and wait) and
LLM engines (``kind_llm``: sequence and token bounds, KV cache). A third kind is a module with a
class that answers ``ModelKind`` and one line in ``kind_for``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from gpubroker.broker.control.kind_batch import BATCH
from gpubroker.broker.control.kind_llm import LlmKind
from gpubroker.broker.control.lending import LendingKind
from gpubroker.broker.control.llm_rules import EngineRecord
from gpubroker.broker.control.model_step import KindBounds, ModelStep, TickView
from gpubroker.broker.wire import ModelSettings
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.ledger import QuotaLedger

if TYPE_CHECKING:
    from gpubroker.broker.control.state import PolicyState


class ModelKind(LendingKind, Protocol):
    """What the policy asks of one model: the lending steps' questions (``LendingKind``), its step,
    its settings and its bounds."""

    def step(self, view: TickView, name: str, spec: ModelSpec) -> ModelStep:
        """Its rules and anti-oscillation on this tick's load (before the quota plan)."""
        ...

    def settings(self, state: PolicyState, name: str, config: FleetConfig) -> ModelSettings:
        """Its versioned settings in ``state``."""
        ...

    def bounds(self, view: TickView, name: str, spec: ModelSpec, ledger: QuotaLedger) -> KindBounds:
        """After the quota plan: the bounds it runs inside its new grant, what its settings carry
        of them, and their log entry (``NO_BOUNDS``: the kind sets nothing there)."""
        ...


def kind_for(spec: ModelSpec, engine: EngineRecord | None) -> ModelKind:
    """The kind of a model of ``spec`` (``engine``: what its engine rules decided last)."""
    if spec.kind == "llm":
        return LlmKind(engine)
    return BATCH


def kinds_of(config: FleetConfig, engines: Mapping[str, EngineRecord]) -> dict[str, ModelKind]:
    return {name: kind_for(spec, engines.get(name)) for name, spec in config.models.items()}


__all__ = ["ModelKind", "kind_for", "kinds_of"]
