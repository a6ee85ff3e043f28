"""Broker checkpoints: the state that must survive a broker restart, as one JSON file.

What is saved (``Checkpoint``): the config text and its hash, the hash of the config the
broker was launched with, the policy state (``PolicyState.to_dict()``, which carries the
quota ledger), the versioned settings table, calibrated memory models and the tail of the
decision log. Writes are atomic (write a temp file in the same directory, fsync, rename),
so a broker killed mid-write leaves either the old checkpoint or the new one, never half.

No Ray here: the actor decides when to save and what to do with what it loads.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    config_text: str  # the config the broker runs now (after any `apply`)
    config_hash: str  # FleetConfig.config_hash() of config_text
    launch_hash: str  # hash of the config the broker actor was created with
    policy_state: dict[str, Any]  # PolicyState.to_dict(): ledger, delay counters, versions
    settings: dict[str, dict[str, Any]]  # model -> ModelSettings.to_dict()
    memory_models: dict[str, list[float]] = field(default_factory=dict)  # model -> [weights_bytes, bytes_per_unit]
    cost_units: dict[str, str] = field(default_factory=dict)  # model -> "requests" | "tokens"
    decisions: list[dict[str, Any]] = field(default_factory=list)  # decision log tail
    decision_seq: int = 0  # last decision sequence number handed out
    saved_at_s: float = 0.0  # epoch seconds of the write
    llm_state: dict[str, Any] = field(default_factory=dict)  # broker.llm_window.LlmControl.to_dict(): LLM rule state
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Checkpoint:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint format {data.get('format_version')!r} is not {FORMAT_VERSION}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Atomically replace ``path`` with ``checkpoint`` (temp file + fsync + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    blob = json.dumps(checkpoint.to_dict(), sort_keys=True, default=_json_default)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_checkpoint(path: str | Path) -> Checkpoint | None:
    """The checkpoint at ``path``, or None when there is none. Raises ValueError if it is corrupt."""
    target = Path(path)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return Checkpoint.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"checkpoint {target} is unreadable: {exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
