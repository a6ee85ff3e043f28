"""Two-phase transfers of the quota ledger: ``Transfer`` and the ledger's begin/confirm/abort.

``QuotaLedger`` (``quotas.ledger``) takes these methods from ``TransferOps``; the module
docstring there describes the protocol. Kinds:

``lend``
    an idle model gives what it does not need above its ``min`` to another model;
``reclaim``
    an owner takes back a loan (never pushes the donor under its own base);
``release``
    a model hands part of its grant back to the free pool (``recipient`` is ``""``). Until it
    confirms, the bytes are in flight: nobody may grow into memory the model may still hold.

Every method checks its refusals before it changes anything. Stdlib only, no clock.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from quotas.ledger_base import FREE_POOL, LedgerError, ModelQuota, as_bytes, as_time, fmt

TRANSFER_KINDS = ("lend", "reclaim", "release")
MODEL_TRANSFER_KINDS = ("lend", "reclaim")  # kinds begin_transfer takes (release: begin_release)


@dataclass(frozen=True)
class Transfer:
    """Bytes that left ``donor``'s grant and have not yet been added to ``recipient``'s."""

    id: int  # unique within the ledger, never reused
    donor: str  # model whose grant was lowered at begin_transfer / begin_release
    recipient: str  # model whose grant rises at confirm; "" (the free pool) for kind "release"
    amount_bytes: int  # bytes in flight
    kind: str  # "lend", "reclaim" or "release"
    started_s: float  # now_s at begin; only reports measured after it can confirm it

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "donor": self.donor,
            "recipient": self.recipient,
            "amount_bytes": self.amount_bytes,
            "kind": self.kind,
            "started_s": self.started_s,
        }


class TransferOps:
    """begin_transfer / begin_release / confirm / abort, mixed into ``QuotaLedger``."""

    _grants: dict[str, int]
    _quotas: dict[str, ModelQuota]
    _pending: dict[int, Transfer]
    _next_id: int

    def _known(self, name: str, what: str) -> None:  # pragma: no cover - QuotaLedger defines it
        raise NotImplementedError

    def headroom_bytes(self, name: str) -> int:  # pragma: no cover - QuotaLedger defines it
        raise NotImplementedError

    def incoming_bytes(self, name: str) -> int:  # pragma: no cover - QuotaLedger defines it
        raise NotImplementedError

    def outgoing_bytes(self, name: str) -> int:  # pragma: no cover - QuotaLedger defines it
        raise NotImplementedError

    def _add_pending(self, donor: str, recipient: str, amount: int, kind: str, started_s: float) -> Transfer:
        transfer = Transfer(
            id=self._next_id, donor=donor, recipient=recipient, amount_bytes=amount, kind=kind, started_s=started_s
        )
        self._next_id += 1
        self._grants[donor] -= amount
        self._pending[transfer.id] = transfer
        return transfer

    def _check_floor(self, donor: str, amount: int, kind: str) -> None:
        if amount <= 0:
            raise LedgerError(
                f"cannot {kind} {fmt(amount)} from '{donor}': amount_bytes must be > 0; pass a positive number of bytes",
                donor,
            )
        grant, floor = self._grants[donor], self._quotas[donor].min_bytes
        if grant - amount < floor:
            raise LedgerError(
                f"cannot {kind} {fmt(amount)} from '{donor}': its grant would fall to {fmt(grant - amount)}, "
                f"under its min {fmt(floor)}; move at most {fmt(max(0, grant - floor))}, "
                f"or lower models.{donor}.quota.min",
                donor,
            )

    def begin_transfer(
        self, donor: str, recipient: str, amount_bytes: int, now_s: float, kind: str = "lend"
    ) -> Transfer:
        """Phase 1: lower ``donor``'s grant by ``amount_bytes`` now; the amount is in flight."""
        self._known(donor, "begin_transfer donor")
        self._known(recipient, "begin_transfer recipient")
        amount = as_bytes(amount_bytes, "amount_bytes", donor)
        started_s = as_time(now_s)
        if kind not in MODEL_TRANSFER_KINDS:
            raise LedgerError(
                f"transfer kind {kind!r} from '{donor}' to '{recipient}' is unknown; use 'lend' or 'reclaim' "
                "(begin_release hands bytes back to the pool)",
                donor,
            )
        if donor == recipient:
            raise LedgerError(
                f"cannot transfer {fmt(amount)} from '{donor}' to itself; pick a different recipient", donor
            )
        if amount <= 0:
            raise LedgerError(
                f"cannot transfer {fmt(amount)} from '{donor}' to '{recipient}': amount_bytes must be > 0; "
                "pass a positive number of bytes",
                donor,
            )
        self._check_floor(donor, amount, kind)
        grant = self._grants[donor]
        q_donor = self._quotas[donor]
        if kind == "reclaim":
            loan = max(0, grant - q_donor.base_bytes)
            if amount > loan:
                raise LedgerError(
                    f"cannot reclaim {fmt(amount)} from '{donor}': only {fmt(loan)} of its grant "
                    f"{fmt(grant)} is a loan above its base {fmt(q_donor.base_bytes)}; reclaim at most "
                    f"{fmt(loan)} (see reclaim_plan) or use kind='lend'",
                    donor,
                )
        room = self.headroom_bytes(recipient)
        if amount > room:
            q_rec = self._quotas[recipient]
            raise LedgerError(
                f"cannot {kind} {fmt(amount)} to '{recipient}': its grant {fmt(self._grants[recipient])} "
                f"+ in flight to/from it {fmt(self.incoming_bytes(recipient) + self.outgoing_bytes(recipient))} "
                f"+ {fmt(amount)} would exceed its max {fmt(q_rec.max_bytes)}; move at most {fmt(max(0, room))}, "
                f"or raise models.{recipient}.quota.max",
                recipient,
            )
        return self._add_pending(donor, recipient, amount, kind, started_s)

    def begin_release(self, name: str, amount_bytes: int, now_s: float) -> Transfer:
        """Phase 1 of a release: lower ``name``'s grant now; the pool gets the bytes at ``confirm``."""
        self._known(name, "begin_release")
        amount = as_bytes(amount_bytes, "amount_bytes", name)
        started_s = as_time(now_s)
        self._check_floor(name, amount, "release")
        return self._add_pending(name, FREE_POOL, amount, "release", started_s)

    def confirm(self, donor: str, used_bytes: float, now_s: float) -> tuple[Transfer, ...]:
        """Phase 2: ``donor`` reports ``used_bytes`` measured at ``now_s``.

        If ``used_bytes <= grant(donor)``, every pending transfer from it begun at or before
        ``now_s`` completes (recipients' grants rise; a release's bytes become free) and is
        returned; otherwise nothing changes and ``()`` is returned.
        """
        self._known(donor, "confirm")
        measured = isinstance(used_bytes, numbers.Real) and not isinstance(used_bytes, bool)
        if not measured or not math.isfinite(used_bytes) or used_bytes < 0:
            raise LedgerError(
                f"used_bytes reported by '{donor}' is {used_bytes!r}; pass the measured bytes (a number >= 0)", donor
            )
        at = as_time(now_s)
        if used_bytes > self._grants[donor]:
            return ()
        done = tuple(t for t in self._pending.values() if t.donor == donor and t.started_s <= at)
        for t in done:
            del self._pending[t.id]
            if t.recipient != FREE_POOL:
                self._grants[t.recipient] += t.amount_bytes
        return done

    def abort(self, transfer_id: int) -> Transfer:
        """Give a pending transfer's amount back to its donor; returns the aborted transfer."""
        if isinstance(transfer_id, bool) or not isinstance(transfer_id, numbers.Integral):
            raise LedgerError(f"transfer id {transfer_id!r} is not an int; pass Transfer.id")
        transfer = self._pending.get(operator.index(transfer_id))
        if transfer is None:
            shown = ", ".join(str(i) for i in self._pending) or "none"
            raise LedgerError(
                f"transfer {transfer_id} is not pending (pending ids: {shown}); it was already confirmed or "
                "aborted, or never begun; pass an id from ledger.pending"
            )
        del self._pending[transfer.id]
        self._grants[transfer.donor] += transfer.amount_bytes
        return transfer
