"""Broker checkpoints: the state that must survive a broker restart, as one JSON file.

``Checkpoint`` holds the config text and hashes, the policy state (with the quota ledger), the
versioned settings table, the calibrated memory models and the tail of the decision log. Writes
are atomic (temp file, fsync, rename): a broker killed mid-write leaves the old checkpoint or
the new one, never half. A fleet's shared decision log is an append-only journal
(``DecisionJournal``), not a tail copied into every card's checkpoint. No Ray here.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gpubroker.broker.wire import DecisionRecord

FORMAT_VERSION = 1
CHECKPOINT_DECISIONS = 300  # decision-log entries kept for a restart (a checkpoint's tail, a journal's)


@dataclass
class Checkpoint:
    config_text: str  # the config the broker runs now (after any `apply`)
    config_hash: str  # FleetConfig.config_hash() of config_text
    launch_hash: str  # hash of the config the broker actor was created with
    policy_state: dict[str, Any]  # PolicyState.to_dict(): ledger, delay counters, versions
    settings: dict[str, dict[str, Any]]  # model -> ModelSettings.to_dict()
    memory_models: dict[str, list[float]] = field(default_factory=dict)  # model -> [weights_bytes, bytes_per_unit]
    cost_units: dict[str, str] = field(default_factory=dict)  # model -> "requests" | "tokens"
    decisions: list[DecisionRecord] = field(default_factory=list)  # decision log tail
    decision_seq: int = 0  # last decision sequence number handed out
    saved_at_s: float = 0.0  # epoch seconds of the write
    llm_state: dict[str, Any] = field(
        default_factory=dict
    )  # LLM rule state of an older checkpoint (now policy_state["engines"]; still read on restore)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        # shallow: json.dumps walks the nested values; ``asdict`` deep-copied them first
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Checkpoint:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint format {data.get('format_version')!r} is not {FORMAT_VERSION}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Atomically replace ``path`` with ``checkpoint`` (temp file + fsync + rename)."""
    _write_atomic(Path(path), checkpoint.to_dict())


class CheckpointFile:
    """Where one core's checkpoint lives: a file of its own (a one-card fleet, tests, the simulator)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> Checkpoint | None:
        return load_checkpoint(self.path)

    def save(self, checkpoint: Checkpoint) -> None:
        save_checkpoint(self.path, checkpoint)


class CardCheckpoints:
    """Every card's checkpoint of a many-card fleet in one file (``gpubroker.broker.fleet_core``): each
    core saves into its card's slot, and the fleet writes the file once (``flush``) after a tick,
    an apply or a re-placement: one atomic write (temp file, fsync, rename) a tick, not one per
    card, and every card's state in it from the same tick. A card the file lacks is looked up in
    the file of its own that brokers before this one wrote (``legacy(card_id)``)."""

    def __init__(self, path: str | Path, legacy: Callable[[str], Path]) -> None:
        self.path, self._legacy = Path(path), legacy
        self._cards: dict[str, dict[str, Any]] | None = None  # card -> Checkpoint.to_dict(); None: not read yet
        self._unreadable: str | None = None  # why the file could not be read: every card's load says so
        self._dirty = False

    def slot(self, card_id: str) -> CardSlot:
        return CardSlot(self, card_id)

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._cards is None:
            self._cards = {}
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                return self._cards
            except json.JSONDecodeError as exc:
                self._unreadable = f"checkpoint {self.path} is unreadable: {exc}"
            else:
                if isinstance(data, dict) and data.get("format_version") == FORMAT_VERSION:
                    self._cards = dict(data.get("cards") or {})
                else:
                    self._unreadable = f"checkpoint {self.path}: format is not {FORMAT_VERSION}"
        if self._unreadable:  # every card starts fresh, none from an older file of its own
            raise ValueError(self._unreadable)
        return self._cards

    def load(self, card_id: str) -> Checkpoint | None:
        saved = self._read().get(card_id)
        if saved is None:
            return load_checkpoint(self._legacy(card_id))
        return Checkpoint.from_dict(saved)

    def save(self, card_id: str, checkpoint: Checkpoint) -> None:
        if self._cards is None:
            self._cards = {}
        self._cards[card_id] = checkpoint.to_dict()
        self._dirty = True

    def flush(self, cards: Iterable[str]) -> bool:
        """Write the file if a card saved since the last write; ``cards``: the fleet's cards now
        (a card dropped by a re-placement leaves the file)."""
        if not self._dirty or self._cards is None:
            return False
        keep = set(cards)
        self._cards = {c: d for c, d in self._cards.items() if c in keep}
        _write_atomic(self.path, {"format_version": FORMAT_VERSION, "cards": self._cards})
        self._dirty = False
        self._unreadable = None  # the file is whole again
        return True


class CardSlot:
    """One card's place in a ``CardCheckpoints`` file: what its core loads from and saves to."""

    def __init__(self, fleet: CardCheckpoints, card_id: str) -> None:
        self.fleet, self.card_id, self.path = fleet, card_id, fleet.path

    def load(self) -> Checkpoint | None:
        return self.fleet.load(self.card_id)

    def save(self, checkpoint: Checkpoint) -> None:
        self.fleet.save(self.card_id, checkpoint)


class DecisionJournal:
    """A fleet's shared decision log on disk (``gpubroker.broker.fleet_core``): JSON lines, appended as
    entries come, so a tick writes what it decided and not the whole tail again. The first line
    names the fleet config the broker was launched with; a broker launched with another config
    starts a new journal, as its cores start their state afresh. When the file holds
    ``4 x keep`` entries it is rewritten atomically to its newest ``keep``. A broker killed
    mid-append leaves a torn last line, which ``load`` skips. Appends are not fsynced: this is
    history for ``gpubroker decisions``, not state a restart needs to be safe (the cards'
    checkpoints are, and they are)."""

    def __init__(self, path: str | Path, launch_hash: str, keep: int) -> None:
        self.path, self.launch_hash, self.keep = Path(path), launch_hash, keep
        self._lines = 0  # entries in the file now

    def load(self) -> tuple[list[DecisionRecord], int]:
        """The newest ``keep`` entries of this fleet's journal and the last sequence number
        (``[], 0`` when there is none or it is another config's). ValueError if its header is unreadable."""
        try:
            with self.path.open(encoding="utf-8") as fh:
                header, rows = fh.readline(), fh.readlines()
        except FileNotFoundError:
            return [], 0
        try:
            head = json.loads(header)
        except json.JSONDecodeError as exc:
            raise ValueError(f"decision journal {self.path} is unreadable: {exc}") from None
        if not isinstance(head, dict) or head.get("journal") != FORMAT_VERSION:
            raise ValueError(
                f"decision journal {self.path}: header {header.strip()[:80]!r} is not format {FORMAT_VERSION}"
            )
        if head.get("launch_hash") != self.launch_hash:
            return [], 0
        entries: list[DecisionRecord] = []
        for row in rows:
            try:
                entry = json.loads(row)
            except json.JSONDecodeError:
                continue  # a torn line from a kill mid-append
            if isinstance(entry, dict) and isinstance(entry.get("seq"), int):
                entries.append(cast(DecisionRecord, entry))  # as DecisionLog.append wrote it
        # a torn line would swallow the next append: rewrite the file on the next one instead
        self._lines = len(rows) if len(entries) == len(rows) else 0
        return entries[-self.keep :], max((e["seq"] for e in entries), default=0)

    def append(self, entries: list[DecisionRecord], log: Iterable[DecisionRecord]) -> None:
        """Add ``entries``; ``log`` (the whole log, oldest first, ``entries`` last) gives the newest
        ``keep`` a rewrite keeps when the file has grown to ``4 x keep`` entries (or has no header yet)."""
        if self._lines == 0 or self._lines + len(entries) > 4 * self.keep:
            self._rewrite(list(log)[-self.keep :])
            return
        blob = "".join(json.dumps(e, sort_keys=True, default=_json_default) + "\n" for e in entries)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(blob)
        self._lines += len(entries)

    def _rewrite(self, tail: list[DecisionRecord]) -> None:
        head = json.dumps({"journal": FORMAT_VERSION, "launch_hash": self.launch_hash})
        body = "".join(json.dumps(e, sort_keys=True, default=_json_default) + "\n" for e in tail)
        _write_text_atomic(self.path, head + "\n" + body)
        self._lines = len(tail)


def _write_atomic(target: Path, data: dict[str, Any]) -> None:
    """Replace ``target`` with ``data`` as JSON: temp file in the same directory, fsync, rename."""
    _write_text_atomic(target, json.dumps(data, sort_keys=True, default=_json_default))


def _write_text_atomic(target: Path, blob: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
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
