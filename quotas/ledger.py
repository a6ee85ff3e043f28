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
``""``).

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
whose usable is under what the models may then still hold. ``to_dict`` / ``from_dict`` give a
JSON-safe checkpoint that round-trips exactly (``from_dict`` runs ``check()``).

Errors
------
``LedgerError`` (a ``ValueError``) names the model, the bytes (human form, exact bytes when
the human form rounds) and the fix; ``.model`` holds the model's name where there is one.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpubroker.quotas.sizes import format_size, parse_size

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module free of pydantic at run time
    from gpubroker.quotas.config import FleetConfig

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


FREE_POOL = ""  # the name that stands for the free pool (reclaim_plan, release transfers)


class LedgerError(ValueError):
    """A refused ledger operation or bad ledger input; the message names model, bytes and fix."""

    def __init__(self, message: str, model: str | None = None):
        super().__init__(message)
        self.model = model


class LedgerInvariantError(LedgerError):
    """The ledger's state breaks one or more invariants; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"quota ledger breaks {len(self.problems)} invariant(s):\n{lines}")


def fmt(num_bytes: int) -> str:
    """Human size, with the exact byte count when the human form rounds."""
    text = format_size(num_bytes)
    try:
        exact = parse_size(text.lstrip("-")) == abs(num_bytes)
    except ValueError:  # pragma: no cover - format_size always parses
        exact = False
    return text if exact else f"{text} ({num_bytes} bytes)"


def as_bytes(value: Any, what: str, model: str | None = None) -> int:
    """An integer byte count (ints and numpy-style integers; not bools, not floats)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        where = f" for '{model}'" if model else ""
        raise LedgerError(f"{what}{where} is {value!r}, not a whole number of bytes; pass an int", model)
    return operator.index(value)


def as_time(value: Any, what: str = "now_s") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LedgerError(f"{what} is {value!r}; pass a finite number of seconds")
    return float(value)


@dataclass(frozen=True)
class ModelQuota:
    """One model's quota; validated on construction (integers, 0 <= min <= base <= max)."""

    min_bytes: int  # working set the model never goes under, even when it lends
    base_bytes: int  # guaranteed share: the owner can always reclaim it
    max_bytes: int  # most the model may borrow up to

    def __post_init__(self) -> None:
        for f in fields(self):
            value = as_bytes(getattr(self, f.name), f.name)
            if value < 0:
                raise LedgerError(f"{f.name} ({value}) is negative; quota sizes must be >= 0")
            object.__setattr__(self, f.name, value)
        if self.min_bytes > self.base_bytes:
            raise LedgerError(
                f"min_bytes ({fmt(self.min_bytes)}) is above base_bytes ({fmt(self.base_bytes)}); "
                "lower min or raise base"
            )
        if self.base_bytes > self.max_bytes:
            raise LedgerError(
                f"base_bytes ({fmt(self.base_bytes)}) is above max_bytes ({fmt(self.max_bytes)}); "
                "lower base or raise max"
            )

    def to_dict(self) -> dict[str, int]:
        return {"min_bytes": self.min_bytes, "base_bytes": self.base_bytes, "max_bytes": self.max_bytes}


def validate_quotas(quotas: Mapping[str, ModelQuota]) -> dict[str, ModelQuota]:
    if not isinstance(quotas, Mapping):
        raise LedgerError(f"quotas is {type(quotas).__name__}; pass a mapping of model name -> ModelQuota")
    out: dict[str, ModelQuota] = {}
    for name, quota in quotas.items():
        if not isinstance(name, str) or not name:
            raise LedgerError(f'model name {name!r} is not allowed; use a non-empty string ("" means the free pool)')
        if not isinstance(quota, ModelQuota):
            raise LedgerError(
                f"quota for '{name}' is {type(quota).__name__}; pass ModelQuota(min_bytes, base_bytes, max_bytes)", name
            )
        out[name] = quota
    return out


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


class QuotaLedger:
    """Grants, loans and in-flight transfers of one card. See the module docstring."""

    __hash__ = None  # type: ignore[assignment]  # mutable; equality compares state

    def __init__(
        self,
        usable_bytes: int,
        quotas: Mapping[str, ModelQuota],
        grants: Mapping[str, int] | None = None,
    ):
        usable = as_bytes(usable_bytes, "usable_bytes")
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
            name: as_bytes(given[name], "grant", name) if name in given else q.base_bytes for name, q in checked.items()
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
        amount = as_bytes(amount_bytes, "amount_bytes", name)
        if amount <= 0:
            raise LedgerError(
                f"cannot grow '{name}' by {fmt(amount)}: amount_bytes must be > 0; pass a positive number of bytes",
                name,
            )
        room = self.headroom_bytes(name)
        if amount > room:
            raise LedgerError(
                f"cannot grow '{name}' by {fmt(amount)}: grant {fmt(self._grants[name])} + in flight to/from it "
                f"{fmt(self.incoming_bytes(name) + self.outgoing_bytes(name))} would exceed its max "
                f"{fmt(self._quotas[name].max_bytes)}; grow by at most {fmt(max(0, room))}, "
                f"or raise models.{name}.quota.max",
                name,
            )
        free = self.free_bytes
        if amount > free:
            raise LedgerError(
                f"cannot grow '{name}' by {fmt(amount)}: only {fmt(free)} is free (usable {fmt(self._usable)}, "
                f"granted {fmt(sum(self._grants.values()))}, in flight {fmt(self.in_flight_bytes)}); grow by at most "
                f"{fmt(free)}, or borrow with begin_transfer from an idle model",
                name,
            )
        self._grants[name] += amount
        return self._grants[name]

    def release(self, name: str, amount_bytes: int) -> int:
        """Lower ``name``'s own grant into the free pool (memory it no longer holds); returns the new grant."""
        self._known(name, "release")
        amount = as_bytes(amount_bytes, "amount_bytes", name)
        if amount <= 0:
            raise LedgerError(
                f"cannot release {fmt(amount)} from '{name}': amount_bytes must be > 0; pass a positive number of bytes",
                name,
            )
        grant, floor = self._grants[name], self._quotas[name].min_bytes
        if grant - amount < floor:
            raise LedgerError(
                f"cannot release {fmt(amount)} from '{name}': its grant would fall to {fmt(grant - amount)}, under "
                f"its min {fmt(floor)}; release at most {fmt(max(0, grant - floor))}, "
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

    # -------------------------------------------------------------- two-phase transfers
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

    # -------------------------------------------------------------- invariants and checkpoints
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
        usable = as_bytes(usable_bytes, "usable_bytes")
        if usable < 0:
            raise LedgerError(f"usable_bytes ({usable}) is negative; pass the card's usable memory in bytes")
        new_quotas = validate_quotas(quotas)
        for what, attr in (("min", "min_bytes"), ("base", "base_bytes")):
            total = sum(getattr(q, attr) for q in new_quotas.values())
            if total > usable:
                biggest = max(new_quotas, key=lambda n: (getattr(new_quotas[n], attr), n))
                listed = ", ".join(f"{n} {fmt(getattr(q, attr))}" for n, q in new_quotas.items())
                raise LedgerError(
                    f"sum of quota.{what} ({fmt(total)}: {listed}) exceeds usable {fmt(usable)} by "
                    f"{fmt(total - usable)}; lower some models' quota.{what} (largest: '{biggest}') "
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
            ledger = self._staged(usable, new_quotas, held, grants, as_time(now_s))
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
                f"the new config leaves usable {fmt(usable)} under what models may still hold, {fmt(holding)} "
                f"(grants {fmt(sum(grants.values()))} + {fmt(holding - sum(grants.values()))} on its way back to the "
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
        grants = ", ".join(f"{n}={fmt(g)}" for n, g in self._grants.items())
        return (
            f"QuotaLedger(usable={fmt(self._usable)}, grants[{grants}], in_flight={fmt(self.in_flight_bytes)}, "
            f"pending={len(self._pending)})"
        )


def _transfer_problems(ledger: QuotaLedger) -> list[str]:
    out: list[str] = []
    known = ledger._quotas
    for t in ledger._pending.values():
        if t.donor not in known:
            out.append(f"transfer {t.id} names unknown donor '{t.donor}'; abort it or add the model")
        if t.kind == "release":
            if t.recipient != FREE_POOL:
                out.append(
                    f"release transfer {t.id} from '{t.donor}' names recipient '{t.recipient}'; releases go to the pool ('')"
                )
        elif t.recipient not in known:
            out.append(f"transfer {t.id} names unknown recipient '{t.recipient}'; abort it or add the model")
        if t.donor == t.recipient:
            out.append(f"transfer {t.id} moves {fmt(t.amount_bytes)} from '{t.donor}' to itself; abort it")
        if t.amount_bytes <= 0:
            out.append(f"transfer {t.id} from '{t.donor}' has amount {fmt(t.amount_bytes)}; amounts must be > 0")
        if t.kind not in TRANSFER_KINDS:
            out.append(f"transfer {t.id} from '{t.donor}' has kind {t.kind!r}; use 'lend', 'reclaim' or 'release'")
        elif t.kind in MODEL_TRANSFER_KINDS and t.recipient == FREE_POOL:
            out.append(f"{t.kind} transfer {t.id} from '{t.donor}' names the pool as recipient; use kind 'release'")
        if t.id >= ledger._next_id:
            out.append(f"transfer {t.id} from '{t.donor}' is not below the next id {ledger._next_id}; raise next_id")
    return out


def ledger_problems(ledger: QuotaLedger) -> list[str]:
    """Every broken invariant of ``ledger``."""
    quotas, grants = ledger._quotas, ledger._grants
    pending = ledger._pending.values()
    out = [f"transfer id {i} appears twice; checkpoints must list each pending transfer once" for i in ledger._dupe_ids]
    usable = ledger.usable_bytes
    for name in quotas:
        if name not in grants:
            out.append(f"'{name}' has a quota but no grant; give it a grant (its base {fmt(quotas[name].base_bytes)})")
    for name in grants:
        if name not in quotas:
            out.append(f"'{name}' has a grant but no quota; drop its grant or add its quota")
    out.extend(_transfer_problems(ledger))
    incoming: dict[str, int] = {}
    outgoing: dict[str, int] = {}
    for t in pending:
        if t.recipient != FREE_POOL:
            incoming[t.recipient] = incoming.get(t.recipient, 0) + t.amount_bytes
        if t.kind != "release":  # a release never comes back (the broker escalates, not aborts)
            outgoing[t.donor] = outgoing.get(t.donor, 0) + t.amount_bytes
    in_flight = sum(t.amount_bytes for t in pending)
    granted = sum(grants.values())
    if granted + in_flight > usable:
        out.append(
            f"sum of grants {fmt(granted)} + in flight {fmt(in_flight)} = {fmt(granted + in_flight)} exceeds "
            f"usable {fmt(usable)} by {fmt(granted + in_flight - usable)}; lower some grants or abort transfers"
        )
    total_base = sum(q.base_bytes for q in quotas.values())
    if total_base > usable:
        out.append(
            f"sum of base quotas {fmt(total_base)} exceeds usable {fmt(usable)}, so not every owner can reclaim "
            "its base; lower some models' quota.base or raise gpu.capacity"
        )
    for name, q in quotas.items():
        grant = grants.get(name)
        if grant is None:
            continue
        if grant < q.min_bytes:
            out.append(
                f"'{name}': grant {fmt(grant)} is under its min {fmt(q.min_bytes)}; raise it by "
                f"{fmt(q.min_bytes - grant)} or lower models.{name}.quota.min"
            )
        moving = incoming.get(name, 0) + outgoing.get(name, 0)
        ceiling = grant + moving
        if ceiling > q.max_bytes:
            out.append(
                f"'{name}': grant {fmt(grant)} + in flight to/from it {fmt(moving)} = {fmt(ceiling)} exceeds its max "
                f"{fmt(q.max_bytes)}; lower it by {fmt(ceiling - q.max_bytes)} or raise models.{name}.quota.max"
            )
    return out


def parse_checkpoint(
    d: Mapping[str, Any], version: int
) -> tuple[int, dict[str, ModelQuota], dict[str, int], tuple[Transfer, ...], int]:
    """(usable, quotas, grants, pending, next_id) of a checkpoint; raises ``LedgerError`` naming the bad part."""
    if not isinstance(d, Mapping):
        raise LedgerError(f"checkpoint is {type(d).__name__}; pass the dict that QuotaLedger.to_dict() wrote")
    missing = [k for k in ("version", "usable_bytes", "quotas", "grants", "pending", "next_id") if k not in d]
    if missing:
        raise LedgerError(f"checkpoint lacks {', '.join(missing)}; pass the dict that QuotaLedger.to_dict() wrote")
    if d["version"] != version:
        raise LedgerError(
            f"checkpoint version {d['version']!r} is not {version}; start from the config "
            "(QuotaLedger.from_config) instead of this checkpoint"
        )
    usable = as_bytes(d["usable_bytes"], "usable_bytes")
    quotas: dict[str, ModelQuota] = {}
    if not isinstance(d["quotas"], Mapping):
        raise LedgerError("checkpoint quotas is not a mapping; pass the dict that QuotaLedger.to_dict() wrote")
    for name, q in d["quotas"].items():
        try:
            quotas[name] = ModelQuota(q["min_bytes"], q["base_bytes"], q["max_bytes"])
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"checkpoint quota for '{name}' is malformed ({exc}); it needs min_bytes, base_bytes, max_bytes",
                name,
            ) from None
        except LedgerError as exc:
            raise LedgerError(f"checkpoint quota for '{name}': {exc}", name) from None
    quotas = validate_quotas(quotas)
    if not isinstance(d["grants"], Mapping):
        raise LedgerError("checkpoint grants is not a mapping; pass the dict that QuotaLedger.to_dict() wrote")
    grants = {name: as_bytes(g, "grant", name) for name, g in d["grants"].items()}
    pending = []
    for raw in d["pending"]:
        try:
            pending.append(
                Transfer(
                    id=as_bytes(raw["id"], "transfer id"),
                    donor=str(raw["donor"]),
                    recipient=str(raw["recipient"]),
                    amount_bytes=as_bytes(raw["amount_bytes"], "amount_bytes", str(raw["donor"])),
                    kind=str(raw["kind"]),
                    started_s=as_time(raw["started_s"], "started_s"),
                )
            )
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"checkpoint transfer {raw!r} is malformed ({exc}); each needs id, donor, recipient, "
                "amount_bytes, kind, started_s"
            ) from None
    return usable, quotas, grants, tuple(pending), as_bytes(d["next_id"], "next_id")
