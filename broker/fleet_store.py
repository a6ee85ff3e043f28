"""What a many-card fleet broker keeps on disk (``gpubroker.broker.fleet_core``), beside the placement.

Every card's checkpoint goes into one file (``gpubroker.broker.checkpoint.CardCheckpoints``), written once
after a tick, and the decision log the cards share is journaled once
(``gpubroker.broker.checkpoint.DecisionJournal``), appending only what was logged since the last save: a
file and a log tail per card every tick cost far more than the tick (the figures:
bench/notes/2026-12-04-design-notes.md). A one-card fleet keeps its core's own checkpoint file.
Files next to ``checkpoint_path`` (``x.checkpoint.json``): ``x.checkpoint.cards.json``,
``x.checkpoint.decisions.jsonl``; a card the cards file lacks is read from
``x.checkpoint.<card>.json`` (older brokers).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from gpubroker.broker.checkpoint import CHECKPOINT_DECISIONS, CardCheckpoints, CardSlot, DecisionJournal
from gpubroker.broker.control.decision_log import DecisionLog


class FleetStore:
    """The fleet's checkpoints and its journaled decision log; nothing when ``path`` is None."""

    def __init__(self, path: Path | None, *, single: bool, launch_hash: str, log: DecisionLog) -> None:
        self.path, self.log = path, log
        self._cards = (
            None
            if path is None or single
            else CardCheckpoints(path.with_suffix(".cards.json"), lambda cid: path.with_suffix(f".{cid}.json"))
        )
        self._journal = (
            None
            if path is None
            else DecisionJournal(path.with_suffix(".decisions.jsonl"), launch_hash, CHECKPOINT_DECISIONS)
        )
        self._saved_seq = 0

    def core_path(self) -> Path | None:
        """The checkpoint file of a one-card fleet's core (a card of many has a slot instead)."""
        return self.path if self._cards is None else None

    def slot(self, card_id: str) -> CardSlot | None:
        return None if self._cards is None else self._cards.slot(card_id)

    def restore_log(self) -> str:
        """Into ``log``, before anything is appended to it (restored entries keep their seq), the
        entries this fleet journaled. Returns a problem for the log once the fleet can log, or ""."""
        if self._journal is None:
            return ""
        try:
            entries, seq = self._journal.load()
        except ValueError as exc:
            return f"{exc}; starting a new decision journal"
        self.log.restore(entries, seq)
        self._saved_seq = self.log.seq
        return ""

    def save(self, cards: Iterable[str]) -> float:
        """After every tick, apply, re-placement and checkpoint: the cards' checkpoints in one
        write (``cards``: the fleet's cards now), then the entries logged since the last save.
        Returns the seconds it took (``gpubroker_checkpoint_write_seconds``)."""
        started = time.perf_counter()
        if self._cards is not None:
            self._cards.flush(cards)
        if self._journal is not None and self.log.seq != self._saved_seq:
            self._journal.append(self.log.since(None, self._saved_seq), self.log.entries)
            self._saved_seq = self.log.seq
        return time.perf_counter() - started
