"""``gpubroker up``'s first requests: one real request per model, each model's last answer
shown, and a model that keeps refusing stopped with the reason and the fix.

No I/O and no clock here: ``gpubroker.deployments.cluster.fleet.wait_serving`` posts the requests and passes
the answers and the time in. Per model:

- its adapter's ``example_input()`` is the request. A model without one (it is optional in
  the README's protocol) is not asked: the first real request is its first (calibration then
  measured the weights only, and the broker's memory model learns from live reports);
- 200: up. 503/504/408/429 or no answer: still starting, ask again;
- any other answer (422 from its own ``validate``, 413, 500...) is a refusal: after
  ``REFUSALS_TO_STOP`` refusals in a row over at least ``REFUSING_S`` seconds, ``up`` stops
  with a message naming the model, the answer and the fix (``example_input``);
- no 200 for ``wait_s`` seconds (``WAIT_S``; ``gpubroker up --wait``) since its first request,
  whatever the answers (a memory emergency's 503, a crash loop, no answer at all): ``up``
  stops with the model's name, its last answer and what to do about that answer.
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
WAIT_S = 60.0  # a model without a 200 this long after its first request stops `up`


class FirstState(StrEnum):
    """Where one model's first request stands."""

    ASKING = "asking"  # no answer yet, or still starting
    UP = "up"  # answered 200
    SKIPPED = "skipped"  # no example_input: not asked
    REFUSED = "refused"  # kept refusing: up stops
    STUCK = "stuck"  # no 200 for wait_s: up stops


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
    asked_since_s: float | None = None  # when its first answer came back (any answer)
    note: str = ""  # why it was skipped


@dataclass
class FirstRequests:
    """Every model's first request; ``record`` each answer, ``label`` for the progress bar."""

    models: dict[str, ModelFirst] = field(default_factory=dict)
    wait_s: float = WAIT_S  # a model with no 200 this long after its first answer stops `up`

    @classmethod
    def for_examples(cls, examples: dict[str, tuple[bool, Any, str]], wait_s: float = WAIT_S) -> FirstRequests:
        """``examples``: model -> (has an example_input, the input, why not)."""
        out = cls(wait_s=wait_s)
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
        if m.asked_since_s is None:
            m.asked_since_s = now_s
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
        if m.state is FirstState.ASKING and now_s - m.asked_since_s >= self.wait_s:
            m.state = FirstState.STUCK
        return m.state

    def refused(self) -> str | None:
        """The message ``up`` stops with, when a model kept refusing or never answered 200 within
        ``wait_s``; None otherwise."""
        for m in self.models.values():
            if m.state is FirstState.STUCK:
                answer = "no answer" if m.last_code == 0 else f"HTTP {m.last_code}"
                return (
                    f"model '{m.name}' did not answer its first request with 200 in {self.wait_s:.0f}s; "
                    f"its last answer: {answer} {m.last_text}. {what_to_do(m.name, m.last_code or 0, m.last_text)}; "
                    "or give it longer with `gpubroker up --wait SECONDS`. `gpubroker down` stops what `up` started"
                )
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


def what_to_do(name: str, code: int, text: str) -> str:
    """The fix for a first request that keeps failing, read from its last answer."""
    logs = "the replica's log (/tmp/ray/session_latest/logs/serve/, or the Ray dashboard) has the traceback"
    if code == 0:
        return f"Nothing answered at all: check that Ray and Serve run (`ray status`, `serve status`); {logs}"
    if code == 503 and "memory emergency" in text:
        return (
            f"Fix: the card ran short of memory while '{name}' started: give it more (models.{name}.quota "
            f"base/max, or gpu.capacity), or lower models.{name}.batch.ceiling; "
            f"`gpubroker decisions --model {name}` shows each step"
        )
    if code == 503:
        return (
            f"Fix: '{name}' keeps refusing for back-pressure or memory (over its grant): raise models.{name}.quota "
            f"or max_queued; `gpubroker decisions --model {name}` shows why"
        )
    if code in (408, 504):
        return (
            f"Fix: its first request did not finish in time: a slow load or predict, or a replica that keeps "
            f"restarting; raise models.{name}.request_timeout_s, or see {logs}"
        )
    return f"Fix: '{name}' fails on its first request; the answer above says how, and {logs}"


def example_of(adapter: Any) -> tuple[bool, Any, str]:
    """(has an example, the input, why not) from an adapter's optional ``example_input``."""
    try:
        return True, adapter.example_input(None), ""
    except NotImplementedError:
        return False, None, "no example_input; the first real request calibrates"
    except Exception as exc:  # noqa: BLE001 - a broken example is reported, not fatal
        return False, None, f"example_input() raised {exc!r}"
