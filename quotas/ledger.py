"""Quota ledger: who holds how many bytes of the card, and the transfers between models.

Pure bookkeeping: stdlib only, no ray/torch/NVML, no clock (time comes in as ``now_s``).
The broker owns one ``QuotaLedger`` per card, asks it before it moves memory, applies what it
says to the replicas (``set_per_process_memory_fraction`` plus the batch cap), and
checkpoints it with ``to_dict`` / ``from_dict``.

Terms (all sizes are integer bytes)
-----------------------------------
usable
    What the card can hand out: capacity x (1 - reserve_frac) - CUDA context overhead
    (``FleetConfig.usable_bytes``).
min / base / max (``ModelQuota``)
    ``min`` is the working set a model never goes under, even when it lends; ``base`` is its
    guaranteed share, which it can always reclaim; ``max`` is the most it may borrow up to.
grant
    The cap a model runs under now. ``grant - base`` above base is a *loan*
    (``loan_bytes``, revocable); ``base - grant`` below base is *lent* (``lent_bytes``).
in flight
    Bytes that have left a donor's grant and not yet reached a recipient's
    (``in_flight_bytes``; per model ``incoming_bytes`` / ``outgoing_bytes``).
free
    ``usable - sum(grants) - in_flight``: memory nobody holds (``free_bytes``).

Two-phase transfer
------------------
Memory moves between models in two steps, so the sum of what models may hold never exceeds
usable, not even while a transfer is under way:

1. ``begin_transfer(donor, recipient, amount, now_s)`` lowers the donor's grant at once and
   records a pending ``Transfer``. The amount is *in flight*: it belongs to nobody and is not
   free either. The broker now lowers the donor's cap and leaves the recipient's alone.
2. ``confirm(donor, used_bytes, now_s)``: when the donor reports that it uses no more than
   its (lowered) grant, every transfer from it begun at or before ``now_s`` completes and
   each recipient's grant rises by its amount. A report whose ``used_bytes`` is still above
   the grant completes nothing; a report measured before a transfer began (``now_s`` earlier
   than ``started_s``) cannot confirm that transfer.
   ``abort(transfer_id)`` instead gives an in-flight amount back to its donor (donor never
   shrank, replica gone, config changed).

``kind`` is ``"lend"`` (an idle model gives what it does not need above its ``min``),
``"reclaim"`` (an owner takes back a loan; the donor must not be pushed under its own base,
so a reclaim moves at most ``loan_bytes(donor)``) or ``"release"`` (``begin_release(name,
amount, now_s)``: the grant drops now, the pool gets the bytes at ``confirm``; recipient
``""``). ``Transfer`` and these methods live in ``quotas.transfers``.

``grow`` and ``release`` are one phase: ``grow`` takes memory from the free pool, which
nobody holds, so it is safe at once; ``release`` returns part of a model's own grant to the
pool and is only for memory the model is known not to hold (it stopped). The broker uses
``begin_release`` for everything else: memory a model may still hold goes nowhere until it
is measured free.

Invariants (``check()`` raises ``LedgerInvariantError`` listing every broken one)
----------------------------------------------------------------------------------
I1  ``sum(grants) + in_flight <= usable``: what models may hold fits on the card, also
    mid-transfer.
I2  ``min <= grant`` for each model; and ``grant + incoming + outgoing <= max``: the grant
    the model would reach if everything in flight to it lands *and* every transfer from it is
    aborted stays within its max. (Counting ``outgoing`` is stricter than
    ``grant + incoming <= max``; without it, a donor that received or grew while its own
    transfer was in flight could be pushed over max by ``abort``.) Releases are not counted in
    ``outgoing`` here: a reconfigure that lowers max leaves the difference as a release, and
    the broker never aborts one.
I3  ``sum(base) <= usable``, so every owner's base can be reclaimed (below).
I4  every model has a grant; every lend or reclaim names two different known models, every
    release its donor and the pool; a positive amount and a known kind; no transfer id appears twice, and ids stay below
    the next id the ledger hands out (ids are never reused, also across ``reconfigure``).

Every operation checks its refusals before it changes anything, so a refused operation
(``LedgerError``) leaves the ledger exactly as it was.

Reclaim guarantee
-----------------
``reclaim_plan(owner)`` lists the moves that bring ``owner`` back to ``base``: the free pool
first (``("", amount)``: execute with ``grow``), then the biggest loans first
(``(borrower, amount)``: execute with ``begin_transfer(borrower, owner, amount, now_s,
kind="reclaim")`` and ``confirm``). With nothing in flight the plan always covers the whole
shortfall: by I1 and I3,
``free + sum(loans of others) >= usable - sum(grants) + sum(grants of others) - sum(base of others)
>= base_owner - grant_owner``.
Bytes in flight are nobody's to take: abort or confirm pending transfers first, otherwise the
plan may fall short by up to ``in_flight_bytes``.

Reconfigure and checkpoints
---------------------------
``reconfigure(usable, quotas)`` returns a *new* ledger for a new config: pending transfers
are aborted, kept models keep their grants clamped into ``[min, max]``, new models start at
``base``, dropped models' grants go back to the pool, and if the sum exceeds the new usable
the biggest loans shrink first (shrinking every loan to base always suffices because
``sum(base) <= usable``). ``reconfigure(usable, quotas, now_s)`` lowers first: each grant
the new config lowers becomes a pending release begun at ``now_s``, so the bytes are free
only once the model is measured under its new grant; it refuses (``LedgerError``) a config
whose usable is under what the models may then still hold. (Module split: errors and
``ModelQuota`` in ``quotas.ledger_base``, invariants in ``quotas.ledger_checks``, checkpoint
parsing in ``quotas.ledger_checkpoint``.) ``to_dict`` / ``from_dict`` give a JSON-safe checkpoint that round-trips
exactly (``from_dict`` runs ``check()``).

Errors
------
``LedgerError`` (a ``ValueError``) names the model, the bytes (human form, exact bytes when
the human form rounds) and the fix; ``.model`` holds the model's name where there is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from quotas.ledger_base import (
    FREE_POOL,
    LedgerError,
    LedgerInvariantError,
    ModelQuota,
    as_bytes,
    as_time,
    fmt,
    validate_quotas,
)
from quotas.ledger_checkpoint import parse_checkpoint
from quotas.ledger_checks import ledger_problems
from quotas.transfers import TRANSFER_KINDS, Transfer, TransferOps

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module free of pydantic at run time
    from quotas.config import FleetConfig

__all__ = [
    "CHECKPOINT_VERSION",
    "FREE_POOL",
    "TRANSFER_KINDS",
    "LedgerError",
    "LedgerInvariantError",
    "ModelQuota",
    "QuotaLedger",
    "Transfer",
]

CHECKPOINT_VERSION = 1
_fmt, _as_bytes, _as_time = fmt, as_bytes, as_time


class QuotaLedger(TransferOps):
    """Grants, loans and in-flight transfers of one card. See the module docstring."""

    __hash__ = None  # type: ignore[assignment]  # mutable; equality compares state

    def __init__(
        self,
        usable_bytes: int,
        quotas: Mapping[str, ModelQuota],
        grants: Mapping[str, int] | None = None,
    ):
        usable = _as_bytes(usable_bytes, "usable_bytes")
        if usable < 0:
            raise LedgerError(f"usable_bytes ({usable}) is negative; pass the card's usable memory in bytes")
        checked = validate_quotas(quotas)
        given = dict(grants or {})
        unknown = [name for name in given if name not in checked]
        if unknown:
            raise LedgerError(
                f"grants name unknown model(s) {', '.join(map(repr, unknown))}; "
                f"known models: {', '.join(checked) or 'none'}; drop them or add their quotas",
                str(unknown[0]),
            )
        self._usable = usable
        self._quotas = checked
        self._grants = {
            name: _as_bytes(given[name], "grant", name) if name in given else q.base_bytes
            for name, q in checked.items()
        }
        self._pending: dict[int, Transfer] = {}
        self._dupe_ids: list[int] = []  # only a bad checkpoint has any; check() reports them
        self._next_id = 1
        self.check()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: FleetConfig, usable_bytes: int) -> QuotaLedger:
        """Ledger with every model of ``config`` at its base; ``usable_bytes`` measured or configured."""
        quotas: dict[str, ModelQuota] = {}
        for name, spec in config.models.items():
            q = spec.quota
            try:
                quotas[name] = ModelQuota(min_bytes=int(q.min), base_bytes=int(q.base), max_bytes=int(q.max))
            except LedgerError as exc:
                raise LedgerError(f"models.{name}.quota: {exc}", name) from None
        return cls(usable_bytes, quotas)

    @classmethod
    def _restore(
        cls,
        usable_bytes: int,
        quotas: Mapping[str, ModelQuota],
        grants: Mapping[str, int],
        pending: tuple[Transfer, ...],
        next_id: int,
    ) -> QuotaLedger:
        """Build without checking (the caller runs check())."""
        ledger = cls.__new__(cls)
        ledger._usable = usable_bytes
        ledger._quotas = dict(quotas)
        ledger._grants = dict(grants)
        ledger._pending = {}
        ledger._dupe_ids = []
        for t in pending:
            if t.id in ledger._pending:
                ledger._dupe_ids.append(t.id)
            else:
                ledger._pending[t.id] = t
        ledger._next_id = next_id
        return ledger

    def copy(self) -> QuotaLedger:
        return QuotaLedger._restore(self._usable, self._quotas, self._grants, self.pending, self._next_id)

    # -- reading ----------------------------------------------------------------------------

    @property
    def usable_bytes(self) -> int:
        return self._usable

    @property
    def quotas(self) -> Mapping[str, ModelQuota]:
        return MappingProxyType(self._quotas)

    @property
    def grants(self) -> dict[str, int]:
        return dict(self._grants)

    def grant(self, name: str) -> int:
        try:  # the policy asks this a few times per model per tick: the error path only on a miss
            return self._grants[name]
        except (KeyError, TypeError):
            self._known(name, "grant")
            raise

    @property
    def pending(self) -> tuple[Transfer, ...]:
        return tuple(self._pending.values())

    @property
    def next_transfer_id(self) -> int:
        return self._next_id

    @property
    def in_flight_bytes(self) -> int:
        return sum(t.amount_bytes for t in self._pending.values())

    @property
    def free_bytes(self) -> int:
        return self._usable - sum(self._grants.values()) - self.in_flight_bytes

    def loan_bytes(self, name: str) -> int:
        """Grant above base: borrowed, revocable."""
        try:  # the planner asks this per model per tick: the error path only on a miss
            return max(0, self._grants[name] - self._quotas[name].base_bytes)
        except (KeyError, TypeError):
            self._known(name, "loan_bytes")
            raise

    def lent_bytes(self, name: str) -> int:
        """Base not held now: lent to others (or released to the pool)."""
        self._known(name, "lent_bytes")
        return max(0, self._quotas[name].base_bytes - self._grants[name])

    def incoming_bytes(self, name: str) -> int:
        """Bytes in flight to ``name`` (added to its grant at confirm)."""
        if not (isinstance(name, str) and name in self._quotas):
            self._known(name, "incoming_bytes")
        if not self._pending:
            return 0
        return sum(t.amount_bytes for t in self._pending.values() if t.recipient == name)

    def outgoing_bytes(self, name: str) -> int:
        """Bytes in flight from ``name`` (already out of its grant; back to it on abort)."""
        if not (isinstance(name, str) and name in self._quotas):
            self._known(name, "outgoing_bytes")
        if not self._pending:
            return 0
        return sum(t.amount_bytes for t in self._pending.values() if t.donor == name)

    def headroom_bytes(self, name: str) -> int:
        """How much more ``name`` may receive or grow: max - grant - incoming - outgoing (I2)."""
        self._known(name, "headroom_bytes")
        return self._quotas[name].max_bytes - self._grants[name] - self.incoming_bytes(name) - self.outgoing_bytes(name)

    # -- one-phase moves against the free pool -------------------------------------------------

    def grow(self, name: str, amount_bytes: int) -> int:
        """Raise ``name``'s grant from the free pool; returns the new grant."""
        self._known(name, "grow")
        amount = _as_bytes(amount_bytes, "amount_bytes", name)
        if amount <= 0:
            raise LedgerError(
                f"cannot grow '{name}' by {_fmt(amount)}: amount_bytes must be > 0; pass a positive number of bytes",
                name,
            )
        room = self.headroom_bytes(name)
        if amount > room:
            raise LedgerError(
                f"cannot grow '{name}' by {_fmt(amount)}: grant {_fmt(self._grants[name])} + in flight to/from it "
                f"{_fmt(self.incoming_bytes(name) + self.outgoing_bytes(name))} would exceed its max "
                f"{_fmt(self._quotas[name].max_bytes)}; grow by at most {_fmt(max(0, room))}, "
                f"or raise models.{name}.quota.max",
                name,
            )
        free = self.free_bytes
        if amount > free:
            raise LedgerError(
                f"cannot grow '{name}' by {_fmt(amount)}: only {_fmt(free)} is free (usable {_fmt(self._usable)}, "
                f"granted {_fmt(sum(self._grants.values()))}, in flight {_fmt(self.in_flight_bytes)}); grow by at most "
                f"{_fmt(free)}, or borrow with begin_transfer from an idle model",
                name,
            )
        self._grants[name] += amount
        return self._grants[name]

    def release(self, name: str, amount_bytes: int) -> int:
        """Lower ``name``'s own grant into the free pool (memory it no longer holds); returns the new grant."""
        self._known(name, "release")
        amount = _as_bytes(amount_bytes, "amount_bytes", name)
        if amount <= 0:
            raise LedgerError(
                f"cannot release {_fmt(amount)} from '{name}': amount_bytes must be > 0; pass a positive number of bytes",
                name,
            )
        grant, floor = self._grants[name], self._quotas[name].min_bytes
        if grant - amount < floor:
            raise LedgerError(
                f"cannot release {_fmt(amount)} from '{name}': its grant would fall to {_fmt(grant - amount)}, under "
                f"its min {_fmt(floor)}; release at most {_fmt(max(0, grant - floor))}, "
                f"or lower models.{name}.quota.min",
                name,
            )
        self._grants[name] = grant - amount
        return self._grants[name]

    # -- reclaim ------------------------------------------------------------------------------

    def reclaim_plan(self, owner: str) -> list[tuple[str, int]]:
        """Moves that bring ``owner`` back to its base: ``("", n)`` from the free pool first, then
        ``(borrower, n)`` from the biggest loans first (ties by name). Empty when the owner's
        grant plus what is in flight to it already reaches base. Covers the whole shortfall when
        nothing is in flight (module docstring); otherwise it may fall short."""
        self._known(owner, "reclaim_plan")
        need = self._quotas[owner].base_bytes - self._grants[owner] - self.incoming_bytes(owner)
        plan: list[tuple[str, int]] = []
        if need <= 0:
            return plan
        from_pool = min(need, max(0, self.free_bytes))
        if from_pool > 0:
            plan.append((FREE_POOL, from_pool))
            need -= from_pool
        loans = sorted(
            ((self.loan_bytes(name), name) for name in self._quotas if name != owner),
            key=lambda item: (-item[0], item[1]),
        )
        for loan, name in loans:
            if need <= 0 or loan <= 0:
                break
            take = min(loan, need)
            plan.append((name, take))
            need -= take
        return plan

    # -- invariants -----------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every broken invariant, as messages that name the model, the bytes and the fix."""
        return ledger_problems(self)

    def check(self) -> None:
        """Raise ``LedgerInvariantError`` listing every broken invariant (I1-I4)."""
        problems = self.problems()
        if problems:
            raise LedgerInvariantError(problems)

    # -- new config -----------------------------------------------------------------------------

    def reconfigure(
        self, usable_bytes: int, quotas: Mapping[str, ModelQuota], now_s: float | None = None
    ) -> QuotaLedger:
        """A new ledger for a new config (see module docstring); never changes ``self``. With
        ``now_s``, lowered grants are pending releases begun at ``now_s`` (lower first)."""
        usable = _as_bytes(usable_bytes, "usable_bytes")
        if usable < 0:
            raise LedgerError(f"usable_bytes ({usable}) is negative; pass the card's usable memory in bytes")
        new_quotas = validate_quotas(quotas)
        for what, attr in (("min", "min_bytes"), ("base", "base_bytes")):
            total = sum(getattr(q, attr) for q in new_quotas.values())
            if total > usable:
                biggest = max(new_quotas, key=lambda n: (getattr(new_quotas[n], attr), n))
                listed = ", ".join(f"{n} {_fmt(getattr(q, attr))}" for n, q in new_quotas.items())
                raise LedgerError(
                    f"sum of quota.{what} ({_fmt(total)}: {listed}) exceeds usable {_fmt(usable)} by "
                    f"{_fmt(total - usable)}; lower some models' quota.{what} (largest: '{biggest}') "
                    "or raise gpu.capacity",
                    biggest,
                )
        held = dict(self._grants)
        for t in self._pending.values():  # abort every pending transfer
            held[t.donor] = held.get(t.donor, 0) + t.amount_bytes
        grants: dict[str, int] = {}
        for name, q in new_quotas.items():
            grants[name] = min(q.max_bytes, max(q.min_bytes, held.get(name, q.base_bytes)))
        excess = sum(grants.values()) - usable
        if excess > 0:
            loans = sorted(
                ((grants[n] - q.base_bytes, n) for n, q in new_quotas.items() if grants[n] > q.base_bytes),
                key=lambda item: (-item[0], item[1]),
            )
            for loan, name in loans:
                if excess <= 0:
                    break
                cut = min(loan, excess)
                grants[name] -= cut
                excess -= cut
        if now_s is None:
            ledger = QuotaLedger._restore(usable, new_quotas, grants, (), self._next_id)
        else:
            ledger = self._staged(usable, new_quotas, held, grants, _as_time(now_s))
        ledger.check()
        return ledger

    def _staged(
        self, usable: int, quotas: dict[str, ModelQuota], held: dict[str, int], grants: dict[str, int], now_s: float
    ) -> QuotaLedger:
        """Lower first: each lowered grant's difference is a pending release begun at ``now_s``."""
        pending, next_id = [], self._next_id
        for name, target in grants.items():
            was = held.get(name)
            if was is not None and target < was:
                pending.append(Transfer(next_id, name, FREE_POOL, was - target, "release", now_s))
                next_id += 1
        holding = sum(grants.values()) + sum(t.amount_bytes for t in pending)
        if holding > usable:
            rising = [n for n in grants if grants[n] > held.get(n, 0)]
            raise LedgerError(
                f"the new config leaves usable {_fmt(usable)} under what models may still hold, {_fmt(holding)} "
                f"(grants {_fmt(sum(grants.values()))} + {_fmt(holding - sum(grants.values()))} on its way back to the "
                f"pool{'; rising: ' + ', '.join(rising) if rising else ''}); apply a config that lowers the loans "
                "first and shrink usable (gpu.capacity, reserve_frac) once they are back",
                rising[0] if rising else None,
            )
        return QuotaLedger._restore(usable, quotas, grants, tuple(pending), next_id)

    # -- checkpoints ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state; ``from_dict(to_dict())`` round-trips exactly."""
        return {
            "version": CHECKPOINT_VERSION,
            "usable_bytes": self._usable,
            "quotas": {name: q.to_dict() for name, q in self._quotas.items()},
            "grants": dict(self._grants),
            "pending": [t.to_dict() for t in self._pending.values()],
            "next_id": self._next_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuotaLedger:
        """Restore a checkpoint written by ``to_dict``; runs ``check()``."""
        usable, quotas, grants, pending, next_id = parse_checkpoint(d, CHECKPOINT_VERSION)
        ledger = cls._restore(usable, quotas, grants, pending, next_id)
        ledger.check()
        return ledger

    # -- misc -------------------------------------------------------------------------------------

    def _known(self, name: str, what: str) -> None:
        if not isinstance(name, str) or name not in self._quotas:
            raise LedgerError(
                f"{what}: unknown model '{name}'; known models: {', '.join(self._quotas) or 'none'}; "
                "use one of them or add it under models: in the config",
                name if isinstance(name, str) else None,
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuotaLedger):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        grants = ", ".join(f"{n}={_fmt(g)}" for n, g in self._grants.items())
        return (
            f"QuotaLedger(usable={_fmt(self._usable)}, grants[{grants}], in_flight={_fmt(self.in_flight_bytes)}, "
            f"pending={len(self._pending)})"
        )
