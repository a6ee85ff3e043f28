"""``gpubroker up``'s first requests: one real request per model, each model's last answer
shown, and a model that keeps refusing stopped with the reason and the fix.

No I/O and no clock here: ``deployments.fleet.wait_serving`` posts the requests and passes
the answers and the time in. Per model:

- its adapter's ``example_input()`` is the request. A model without one (it is optional in
  the README's protocol) is not asked: the first real request is its first (calibration then
  measured the weights only, and the broker's memory model learns from live reports);
- 200: up. 503/504/408/429 or no answer: still starting, ask again;
- any other answer (422 from its own ``validate``, 413, 500...) is a refusal: after
  ``REFUSALS_TO_STOP`` refusals in a row over at least ``REFUSING_S`` seconds, ``up`` stops
  with a message naming the model, the answer and the fix (``example_input``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

REFUSALS_TO_STOP = 3  # refusals in a row ...
REFUSING_S = 5.0  # ... spanning at least this long (a replica mid-restart answers 503, not a refusal)
RETRY_CODES = frozenset({0, 408, 429, 503, 504})  # not an answer yet: starting, busy, or unreachable
ANSWER_CHARS = 160


class FirstState(StrEnum):
    """Where one model's first request stands."""

    ASKING = "asking"  # no answer yet, or still starting
    UP = "up"  # answered 200
    SKIPPED = "skipped"  # no example_input: not asked
    REFUSED = "refused"  # kept refusing: up stops


@dataclass
class ModelFirst:
    """One model's first-request record (mutable: updated per answer)."""

    name: str
    example: Any = None
    has_example: bool = True
    state: FirstState = FirstState.ASKING
    last_code: int | None = None
    last_text: str = ""
    refusals: int = 0  # in a row
    refusing_since_s: float | None = None
    note: str = ""  # why it was skipped


@dataclass
class FirstRequests:
    """Every model's first request; ``record`` each answer, ``label`` for the progress bar."""

    models: dict[str, ModelFirst] = field(default_factory=dict)

    @classmethod
    def for_examples(cls, examples: dict[str, tuple[bool, Any, str]]) -> FirstRequests:
        """``examples``: model -> (has an example_input, the input, why not)."""
        out = cls()
        for name, (has, value, why) in examples.items():
            m = ModelFirst(name, value, has)
            if not has:
                m.state, m.note = FirstState.SKIPPED, why
            out.models[name] = m
        return out

    def asking(self) -> list[str]:
        return [n for n, m in self.models.items() if m.state is FirstState.ASKING]

    def settled(self) -> int:
        return sum(1 for m in self.models.values() if m.state in (FirstState.UP, FirstState.SKIPPED))

    def record(self, name: str, code: int, text: str, now_s: float) -> FirstState:
        m = self.models[name]
        m.last_code, m.last_text = code, " ".join(text.split())[:ANSWER_CHARS]
        if code == 200:
            m.state, m.refusals, m.refusing_since_s = FirstState.UP, 0, None
        elif code in RETRY_CODES:
            m.refusals, m.refusing_since_s = 0, None
        else:
            m.refusals += 1
            if m.refusing_since_s is None:
                m.refusing_since_s = now_s
            if m.refusals >= REFUSALS_TO_STOP and now_s - m.refusing_since_s >= REFUSING_S:
                m.state = FirstState.REFUSED
        return m.state

    def refused(self) -> str | None:
        """The message ``up`` stops with, when a model kept refusing; None otherwise."""
        for m in self.models.values():
            if m.state is FirstState.REFUSED:
                return (
                    f"model '{m.name}' refused its first request {m.refusals} times: HTTP {m.last_code} "
                    f"{m.last_text}; the request was {json.dumps({'input': m.example}, default=repr)[:200]} "
                    "from its example_input(). "
                    "Fix: make example_input() return an input the model's validate accepts, or leave "
                    "example_input() out (it is optional: `up` then skips the first request and the first "
                    "real request calibrates)"
                )
        return None

    def label(self) -> str:
        """``First requests`` and each model's last answer (the progress bar's description)."""
        parts = []
        for m in self.models.values():
            if m.state is FirstState.UP:
                parts.append(f"{m.name} 200")
            elif m.state is FirstState.SKIPPED:
                parts.append(f"{m.name} skipped ({m.note})")
            elif m.last_code is None:
                parts.append(f"{m.name} asking")
            else:
                answer = "no answer" if m.last_code == 0 else str(m.last_code)
                parts.append(f"{m.name} {answer} {m.last_text[:60]}".rstrip())
        return "First requests: " + "; ".join(parts)


def example_of(adapter: Any) -> tuple[bool, Any, str]:
    """(has an example, the input, why not) from an adapter's optional ``example_input``."""
    try:
        return True, adapter.example_input(None), ""
    except NotImplementedError:
        return False, None, "no example_input; the first real request calibrates"
    except Exception as exc:  # noqa: BLE001 - a broken example is reported, not fatal
        return False, None, f"example_input() raised {exc!r}"
