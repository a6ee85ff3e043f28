"""Quota moves for one tick: lend from idle models to memory-bound busy ones, reclaim base.

The ledger (``gpubroker.quotas.ledger``) keeps the arithmetic safe; this module decides which moves to make
and when one completes, in seven steps a tick: abort lends not confirmed in time; confirm a donor
only on fresh reports from all its live replicas on the new settings, memory within the grant;
escalate an unhonoured reclaim (``RECLAIM_STEPS``: release caches, drain, restart once); reclaim
base after ``reclaim_hold_s``; release idle loans; lend only to a model its memory holds back, only
what raises its ceiling, lenders keeping their peak need; restore base from the pool. Every grow is
also bounded by measured free memory. ``plan_quota`` changes nothing: it returns a ``QuotaPlan``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple, Protocol

from gpubroker.broker.control.batch_rules import cap_top
from gpubroker.broker.control.latency_model import LatencyFit
from gpubroker.broker.control.memory_model import MemoryModel
from gpubroker.broker.control.state import BatchWant, ModelState
from gpubroker.broker.control.types import FleetSnapshot, ModelLoad, QuotaMove
from gpubroker.broker.control.vocab import MoveKind
from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.holding import measured_free_bytes
from gpubroker.quotas.ledger import LedgerError, QuotaLedger, Transfer
from gpubroker.quotas.sizes import format_size

ESCALATING = ("reclaim", "release")  # transfer kinds that escalate instead of aborting


# Escalation of a reclaim (or release) the borrower has not honoured, in order (QuotaMove.kind):
# after T release caches, after 2 T pause admission and drain, after 3 T restart (once).
RECLAIM_STEPS = (MoveKind.RECLAIM_CACHE, MoveKind.RECLAIM_DRAIN, MoveKind.RECLAIM_RESTART)


def step_kind(step: int) -> MoveKind:
    """The move kind of escalation step ``step`` (1, 2 or 3)."""
    return RECLAIM_STEPS[min(step, len(RECLAIM_STEPS)) - 1]


class QuotaPlan(NamedTuple):
    """What ``plan_quota`` decided for one tick; its inputs are left as they were."""

    ledger: QuotaLedger  # the ledger after this tick's moves (a copy; the caller's is untouched)
    moves: tuple[QuotaMove, ...]  # ledger steps taken, in order (for the decision log)
    confirm_after: Mapping[str, int]  # donor -> settings version it must run before its transfers complete
    notes: tuple[str, ...]  # refusals and other remarks
    new_donors: frozenset[str]  # models whose grant dropped this tick (the caller records their new version)
    reclaim_steps: Mapping[str, int]  # borrower -> escalation step reached (1 cache, 2 drain, 3 restart)
    restart_tokens: Mapping[str, int]  # model -> restart token (only ever rises)
    lend_scale: Mapping[str, float]  # model -> idle-hold multiplier (lend regret)
    lent_at: Mapping[str, float]  # model -> when it last lent (this loan spell)


class ConfirmGate(NamedTuple):
    """Whether a donor's reports may confirm its transfers, and why (``confirm_gate``)."""

    ok: bool
    used_bytes: int  # measured use summed over the live replicas
    measured_s: float  # the oldest of their latest reports: transfers begun before it may complete
    why: str


def min_move_bytes(ledger: QuotaLedger) -> int:
    """Moves smaller than this are dust: not worth a transfer. 1/256 of the card (4 MiB from a 1 GiB
    card up), at least 64 KiB: a fixed 4 MiB floor made every move on a card of a few MiB dust."""
    return max(64 * 1024, ledger.usable_bytes // 256)


def confirm_gate(load: ModelLoad, replicas: int, version: int, started_s: float) -> ConfirmGate:
    """A donor confirms only on reports from every live replica (at least ``replicas``), each
    received after ``started_s`` and running settings ``version`` or later.

    ``used_bytes`` is what the donor may hold once confirmed: each replica is held to its share
    of the grant (grant / ``replicas``: gpubroker.deployments.enforce.limits), so one replica above its share while
    another is below it must not pass on their sum (the one below may still grow to its share):
    the larger of the sum and ``replicas`` x the most one replica holds."""
    seen = load.replica_reports
    used = sum(r.mem_used_bytes for r in seen)
    if seen:
        used = max(used, max(1, replicas) * max(r.mem_used_bytes for r in seen))
    if len(seen) < max(1, replicas):
        return ConfirmGate(False, used, 0.0, f"{len(seen)} of {max(1, replicas)} replicas reporting")
    late = [r.replica_id for r in seen if r.last_report_s <= started_s]
    if late:
        return ConfirmGate(False, used, 0.0, f"no report since the transfer began from {', '.join(late)}")
    old = [f"{r.replica_id} v{r.settings_version}" for r in seen if r.settings_version < version]
    if old:
        return ConfirmGate(False, used, 0.0, f"not yet on settings v{version}: {', '.join(old)}")
    return ConfirmGate(True, used, min(r.last_report_s for r in seen), f"{len(seen)} replicas reported on v{version}")


_Order = tuple[tuple[str, ModelSpec], ...]


def _orders(config: FleetConfig) -> tuple[_Order, _Order]:
    """The models by priority (ties in config order), and by priority then name."""
    items = list(config.models.items())
    return (
        tuple(sorted(items, key=lambda kv: -kv[1].priority)),
        tuple(sorted(items, key=lambda kv: (-kv[1].priority, kv[0]))),
    )


# ------------------------------------------------------------------ what a model needs
# a lender lowered to batch b must keep its window's P99, scaled to b, within this share of its SLO:
# the window is a sample, and the tail the lender has not seen yet needs room too
LEND_TAIL_FRAC = 0.7


def peak_batch(load: ModelLoad, spec: ModelSpec, fit: LatencyFit | None) -> int:
    """The smallest batch a lender may be lowered to: what its own demand at the window's peak
    needs within its SLO (a lender keeps the memory for it, up to its base).

    The window's peak ran batches of up to ``max_batch`` (``peak``). A model that missed its SLO
    in the window (attainment under 1) needed all of them. Otherwise a smaller batch ``b`` is
    enough when the window's P99 stays within the SLO at the rate ``b`` drains a queue: a queue
    of requests takes ``L(b) / b`` per request instead of ``L(peak) / peak`` (the latency fit;
    with none, ``1 / b``: no fixed cost to share, the largest slowdown), so the P99 scales by
    their ratio. No latency samples in the window: the floor."""
    floor = max(1, spec.batch.floor)
    peak = max(floor, math.ceil(load.max_batch))
    if load.attainment is not None and load.attainment < 1.0:
        return peak
    if load.p99_ms is None or load.latency_samples == 0:
        return floor

    def per_request_ms(b: int) -> float:
        return (fit.predict_ms(b) if fit is not None else 1.0) / b

    for b in range(floor, peak):
        if load.p99_ms * per_request_ms(b) / per_request_ms(peak) <= LEND_TAIL_FRAC * spec.slo_p95_ms:
            return b
    return peak


class Unpressed(StrEnum):
    """Why a model that wants more memory should not borrow it (``pressed``)."""

    NO_CEILING = "memory does not limit its batch"
    UNDER_CEILING = "its biggest batch in the window is under its memory ceiling"
    NOT_BEHIND = "not behind: its backlog drains at its ceiling within its SLO and its recent P95 is within it"


def drain_ms(load: ModelLoad, ceiling: int, fit: LatencyFit | None) -> float | None:
    """How long its queue takes to drain at its memory ceiling: batches of ``ceiling`` per replica,
    one after another, each as long as the latency fit says (measured on the shared card). None
    without a fit or a ceiling above nought."""
    if fit is None or ceiling < 1:
        return None
    batches = math.ceil(load.queue_depth / (ceiling * max(1, load.replicas)))
    return batches * fit.predict_ms(ceiling)


def pressed(load: ModelLoad, spec: ModelSpec, ceiling: int | None, fit: LatencyFit | None = None) -> Unpressed | None:
    """Why a model that wants more memory should not borrow it (None: it should).

    A batch cap that wants more than the grant holds is not a need by itself (with lazy
    formation every model wants a large cap). A borrower must be held back by its memory now:
    its window's biggest batch reached the ceiling its grant holds, and it is behind: its recent
    P95 over its SLO, or a backlog that will be: the recent P95 plus the time its queue takes to
    drain at the ceiling (``drain_ms``, from the latency fit) over its SLO. A queue of a few
    batches that drains well within the SLO costs no goodput, and a loan taken for it costs its
    lender when the lender's load comes back (the load matrix, bench/notes/load-matrix.md).
    Without a fit, a backlog is a queue its ceiling cannot take in one batch per replica. Or it
    refuses requests because it holds over its grant (``held_over``: it runs no batch)."""
    if ceiling is None:
        return Unpressed.NO_CEILING
    if load.held_over:
        return None
    if load.max_batch < ceiling:
        return Unpressed.UNDER_CEILING
    p95 = load.recent_p95_ms or 0.0
    drain = drain_ms(load, ceiling, fit)
    if drain is None:
        backlog = load.queue_depth > ceiling * max(1, load.replicas)
    else:
        backlog = p95 + drain > spec.slo_p95_ms
    late = load.recent_p95_ms is not None and load.recent_p95_ms > spec.slo_p95_ms
    return None if backlog or late else Unpressed.NOT_BEHIND


# ------------------------------------------------------------------ one tick's plan
class LendingKind(Protocol):
    """What the lending steps ask of a model, answered by its kind (``gpubroker.broker.control.kinds``;
    ``r``: the tick's quota round). The steps never ask which kind they have."""

    def need(self, r: QuotaRound, name: str) -> int | None:
        """The grant it wants (None: not known, it keeps its base)."""
        ...

    def working_set(self, r: QuotaRound, name: str) -> int:
        """What it keeps when it lends or releases."""
        ...

    def idle(self, r: QuotaRound, name: str) -> bool:
        """Whether it lends now (quiet for its idle hold, or handing its memory over)."""
        ...

    def hands_over(self, r: QuotaRound, name: str) -> bool:
        """Whether it lends on at once because the load moved to a neighbour."""
        ...

    def reclaims(self, r: QuotaRound, owner: str) -> bool:
        """Whether, under its base and busy for its reclaim hold, it takes its base back."""
        ...

    def reclaim_hold(self, r: QuotaRound, owner: str, spec: ModelSpec) -> float:
        """How long its load must stay back before it reclaims."""
        ...

    def wants_why(self, r: QuotaRound, name: str, wanted: int) -> str:
        """The reason it asks for ``wanted``."""
        ...

    def borrow_reason(self, r: QuotaRound, name: str, why: str) -> str | None:
        """Why it borrows from idle neighbours (None: it takes only the free pool)."""
        ...

    def loan_buys(self, r: QuotaRound, name: str, offers: list[tuple[str, int]]) -> bool:
        """Whether what the idle models offer buys it anything."""
        ...


class QuotaInputs(NamedTuple):
    """What one tick's quota plan reads of the tick: the load and each model's batch step."""

    snapshot: FleetSnapshot
    config: FleetConfig
    states: Mapping[str, ModelState]  # each model's state after its batch step this tick
    wants: Mapping[str, BatchWant]  # each model's wanted cap after anti-oscillation
    memory: Mapping[str, MemoryModel]  # each model's ``MemoryModel.from_load`` of this snapshot
    kinds: Mapping[str, LendingKind]  # each model's kind: what it needs, keeps, and when it lends (kinds.py)


class LendingBook(NamedTuple):
    """What the quota plan carries from tick to tick (``gpubroker.broker.control.policy.PolicyState`` keeps it)."""

    ledger: QuotaLedger
    confirm_after: Mapping[str, int]  # donor -> version its confirm waits for
    reclaim_steps: Mapping[str, int]  # borrower -> escalation step reached
    restart_tokens: Mapping[str, int]  # model -> restart token
    lend_scale: Mapping[str, float]  # model -> idle-hold multiplier (lend regret)
    lent_at: Mapping[str, float]  # model -> when it last lent


def plan_quota(inputs: QuotaInputs, book: LendingBook) -> QuotaPlan:
    """One tick of quota moves: the seven steps of the module docstring, in order, on a copy of
    the ledger; returns a ``QuotaPlan`` and changes nothing it is given."""
    r = QuotaRound(inputs, book)
    abort_stale_lends(r)
    confirm_donors(r)
    escalate_reclaims(r)
    by_priority, by_priority_name = _orders(inputs.config)
    reclaim_base(r, by_priority)
    release_idle_loans(r)
    for name, _spec in by_priority_name:
        lend_to(r, name)
    restore_base(r, by_priority_name)
    return QuotaPlan(
        ledger=r.ledger,
        moves=tuple(r.moves),
        confirm_after=r.confirm_after,
        notes=tuple(r.notes),
        new_donors=frozenset(r.new_donors),
        reclaim_steps=r.reclaim_steps,
        restart_tokens=r.tokens,
        lend_scale=r.scale,
        lent_at=r.lent,
    )


class QuotaRound:
    """One tick's planning: the inputs, the ledger copy the steps move, what they record, and the
    questions every step asks of a model (its need, its working set, whether it is idle)."""

    def __init__(self, inputs: QuotaInputs, book: LendingBook) -> None:
        self.inputs, self.book = inputs, book
        self.config = config = inputs.config
        self.now_s = inputs.snapshot.now_s
        self.ledger = book.ledger.copy()
        self.scale = dict(book.lend_scale)
        self.lent = dict(book.lent_at)
        self.tokens = dict(book.restart_tokens)
        self.moves: list[QuotaMove] = []
        self.notes: list[str] = []
        self.new_donors: set[str] = set()
        self.confirm_after: dict[str, int] = {}  # the book's, for donors still pending after the confirms
        self.reclaim_steps: dict[str, int] = {}
        self.timeout_s = config.broker.transfer_timeout_s
        self.dust = min_move_bytes(self.ledger)
        self.loads = {n: inputs.snapshot.models.get(n) or ModelLoad(name=n, replicas=0) for n in config.models}
        self.used = {n: load.mem_used_bytes for n, load in self.loads.items()}
        # replicas a model's need is spread over: those reporting, else the config's count
        self._replicas = {n: max(1, load.replicas or config.models[n].replicas) for n, load in self.loads.items()}
        self.memory: dict[str, MemoryModel] = dict(inputs.memory)
        self.kinds = inputs.kinds

    def mm(self, name: str) -> MemoryModel:
        if name not in self.memory:
            self.memory[name] = MemoryModel.from_load(self.loads[name])
        return self.memory[name]

    def replicas(self, name: str) -> int:
        return self._replicas[name]

    def gate(self, donor: str, version: int, started_s: float) -> ConfirmGate:
        return confirm_gate(self.loads[donor], self.config.models[donor].replicas, version, started_s)

    def need(self, name: str) -> int | None:
        """The grant ``name`` wants (None: not known, it keeps its base): its kind's answer."""
        return self.kinds[name].need(self, name)

    def working_set(self, name: str) -> int:
        """What an idle lender keeps: its kind's answer."""
        return self.kinds[name].working_set(self, name)

    def idle(self, name: str) -> bool:
        """Whether it lends now: its kind's answer (``quiet_for`` its idle hold, as a rule)."""
        return self.kinds[name].idle(self, name)

    def quiet_for(self, name: str, hold_s: float) -> bool:
        """Quiet for ``hold_s``, and, if it borrows, idle at the batch its base holds too (``busy_at_base``)."""
        st = self.inputs.states[name]
        if st.quiet_since_s is None or self.now_s - st.quiet_since_s < hold_s:
            return False
        return not self.ledger.loan_bytes(name) or not self.busy_at_base(name)

    def busy_at_base(self, name: str) -> bool:
        """A loan can make its borrower look idle: at the bigger batches it buys, the same requests
        keep the replicas busy under idle_util_frac. Released or lent on, the memory leaves it at
        the batch its base holds, busy again and behind (or missing its SLO on clumps of
        requests), and it borrows the memory back: grants flap. So a borrower is idle only if its
        arrivals would keep it under idle_util_frac at its base's batch too (its latency fit)."""
        load, spec, fit = self.loads[name], self.config.models[name], self.inputs.states[name].latency_fit
        if fit is None or load.arrival_rate_rps <= 0:
            return False
        base_cap = cap_top(spec.batch, self.mm(name).cap_for(spec.quota.base / self.replicas(name)))
        units_per_s = load.arrival_rate_rps * max(load.cost_per_request, 1.0) / self.replicas(name)
        return units_per_s / fit.saturated_rate(base_cap) >= spec.control.idle_util_frac

    def busy_for(self, name: str) -> float:
        st = self.inputs.states[name]
        return 0.0 if st.loaded_since_s is None else self.now_s - st.loaded_since_s

    def holds(self, name: str) -> int:
        """Its grant and what is on its way to it."""
        return self.ledger.grant(name) + self.ledger.incoming_bytes(name)

    def transfer(self, donor: str, recipient: str, amount: int, kind: MoveKind, why: str) -> None:
        """A two-phase move from ``donor`` (a refusal is noted, not raised)."""
        try:
            t = self.ledger.begin_transfer(donor, recipient, amount, self.now_s, kind)
        except LedgerError as exc:
            self.notes.append(f"{kind} {donor}->{recipient} refused: {exc}")
            return
        self.new_donors.add(donor)
        if kind == MoveKind.LEND:
            self.lent[donor] = self.now_s
        self.moves.append(QuotaMove(kind, donor, recipient, t.amount_bytes, why))

    def grow(self, name: str, amount: int, kind: MoveKind, why: str) -> int:
        """Grow ``name`` from the free pool, within its headroom and the measured free bytes."""
        ledger = self.ledger
        amount = min(amount, ledger.free_bytes)
        if amount > 0:
            amount = min(amount, ledger.headroom_bytes(name))
        if amount > 0:  # the measured bound last: it sums over every model
            amount = min(amount, measured_free_bytes(ledger, self.used))
        if amount <= 0:
            return 0
        try:
            ledger.grow(name, amount)
        except LedgerError as exc:
            self.notes.append(f"grow {name} refused: {exc}")
            return 0
        self.moves.append(QuotaMove(kind, None, name, amount, why))
        return amount


def abort_stale_lends(r: QuotaRound) -> None:
    """Step 1: lends whose donor was not confirmed in ``transfer_timeout_s`` are aborted (reclaims
    and releases escalate instead)."""
    for t in r.ledger.pending:
        if t.kind == "lend" and r.now_s - t.started_s > r.timeout_s:
            r.ledger.abort(t.id)
            gate = r.gate(t.donor, r.book.confirm_after.get(t.donor, 0), t.started_s)
            reason = (
                f"transfer {t.id} {t.kind} {t.donor}->{t.recipient or 'pool'} {format_size(t.amount_bytes)} not "
                f"confirmed in {r.timeout_s:g}s (donor used {format_size(gate.used_bytes)}; {gate.why}): aborted"
            )
            r.moves.append(QuotaMove(MoveKind.ABORT, t.donor, t.recipient or None, t.amount_bytes, reason))


def confirm_donors(r: QuotaRound) -> None:
    """Step 2: donors measured under their grant on every live replica complete their transfers."""
    ledger = r.ledger
    for donor in sorted({t.donor for t in ledger.pending}):
        oldest = min(t.started_s for t in ledger.pending if t.donor == donor)
        gate = r.gate(donor, r.book.confirm_after.get(donor, 0), oldest)
        if not gate.ok:
            continue
        for t in ledger.confirm(donor, gate.used_bytes, gate.measured_s):
            to = f"{t.recipient or 'pool'} +{format_size(t.amount_bytes)}"
            why = f"{donor} used {format_size(gate.used_bytes)} <= grant {format_size(ledger.grant(donor))} "
            r.moves.append(
                QuotaMove(MoveKind.CONFIRM, t.donor, t.recipient or None, t.amount_bytes, f"{why}({gate.why}): {to}")
            )
    pending_donors = {t.donor for t in ledger.pending}
    r.confirm_after = {d: v for d, v in r.book.confirm_after.items() if d in pending_donors}


def escalate_reclaims(r: QuotaRound) -> None:
    """Step 3: a reclaim or release its borrower has not honoured climbs ``RECLAIM_STEPS``, one
    per ``transfer_timeout_s``; the restart step bumps the borrower's restart token."""
    pending = r.ledger.pending
    for borrower in sorted({t.donor for t in pending if t.kind in ESCALATING}):
        mine = [t for t in pending if t.kind in ESCALATING and t.donor == borrower]
        first = min(mine, key=lambda t: t.started_s)
        reached = min(len(RECLAIM_STEPS), int((r.now_s - first.started_s) // r.timeout_s)) if r.timeout_s > 0 else 0
        before = r.book.reclaim_steps.get(borrower, 0)
        r.reclaim_steps[borrower] = max(before, reached)
        gate = r.gate(borrower, r.confirm_after.get(borrower, 0), first.started_s)
        for step in range(before + 1, reached + 1):
            if step >= 3:
                r.tokens[borrower] = r.tokens.get(borrower, 0) + 1
            grant, token = r.ledger.grant(borrower), r.tokens.get(borrower, 0)
            r.moves.append(_escalation(step, borrower, mine, grant, gate, r.now_s, token))


def reclaim_base(r: QuotaRound, by_priority: _Order) -> None:
    """Step 4: an owner under its base whose load has been back for ``reclaim_hold_s`` takes its
    whole base back: from the free pool first, then from borrowers' loans (two-phase)."""
    ledger = r.ledger
    for owner, spec in by_priority:
        short = spec.quota.base - r.holds(owner)
        kind = r.kinds[owner]
        if short < r.dust or r.idle(owner) or r.busy_for(owner) < kind.reclaim_hold(r, owner, spec):
            continue
        if not kind.reclaims(r, owner):
            continue
        load = r.loads[owner]
        why = (
            f"{owner} load back for {r.busy_for(owner):.0f}s (arrival_rate_rps {load.arrival_rate_rps:.1f}, "
            f"queue {load.queue_depth:.0f}): reclaim toward base {format_size(spec.quota.base)}"
        )
        if owner in r.lent:
            why += _lend_regret(r, owner, spec)
        for borrower, amount in ledger.reclaim_plan(owner):
            take = min(amount, short)
            if take <= 0:
                break
            if borrower == "":
                short -= r.grow(owner, take, MoveKind.RECLAIM, why + " from the free pool")
            else:
                r.transfer(borrower, owner, take, MoveKind.RECLAIM, why + f" from {borrower}'s loan")
                short -= take


def _lend_regret(r: QuotaRound, owner: str, spec: ModelSpec) -> str:
    """A loan that had to come back soon doubles the owner's idle hold (one that stayed out halves
    it); the reclaim's reason says so when it changes."""
    ctl, since = spec.control, r.now_s - r.lent.pop(owner)
    old = r.scale.get(owner, 1.0)
    new = min(ctl.lend_backoff_max, old * 2.0) if since < ctl.lend_regret_s else max(1.0, old / 2.0)
    if new == old:
        return ""
    r.scale[owner] = new
    return f"; its loan came back {since:.0f}s after it lent: lends again only after {ctl.idle_hold_s * new:.0f}s idle"


def release_idle_loans(r: QuotaRound) -> None:
    """Step 5: a borrower gone idle hands back its loan above its working set, two-phase (a busy
    borrower keeps its loan until an owner reclaims it: releasing on every dip of its need would
    make the grant flap)."""
    ledger = r.ledger
    for name, spec in r.config.models.items():
        loan = ledger.loan_bytes(name)
        if loan < r.dust or not r.idle(name) or ledger.outgoing_bytes(name):
            continue
        keep = max(spec.quota.base, r.working_set(name))
        excess = min(loan, ledger.grant(name) - keep)
        if excess < r.dust:
            continue
        try:
            ledger.begin_release(name, excess, r.now_s)
        except LedgerError as exc:
            r.notes.append(f"release {name} refused: {exc}")
            continue
        r.new_donors.add(name)
        why = (
            f"{name} needs {format_size(keep)} of its {format_size(keep + excess)}: loan of "
            f"{format_size(excess)} back to the pool once {name} is measured under {format_size(keep)}"
        )
        r.moves.append(QuotaMove(MoveKind.RELEASE, name, None, excess, why))


def lend_to(r: QuotaRound, name: str) -> None:
    """Step 6 for one model: a busy model whose wanted batch does not fit its grant grows from the
    free pool, then borrows from idle models what they hold above their working set, when it is
    held back by its memory now and the loan raises its batch ceiling."""
    if r.idle(name):
        return
    wanted = r.need(name)
    if wanted is None:
        return
    load, kind = r.loads[name], r.kinds[name]
    if load.held_over:  # refusing requests, it holds over its grant: that + its batch
        wanted = min(r.config.models[name].quota.max, load.mem_used_bytes + wanted)
    deficit = wanted - r.holds(name)
    if deficit < r.dust:
        return
    why = kind.wants_why(r, name, wanted)
    deficit -= r.grow(name, deficit, MoveKind.GROW, why + ": from the free pool")
    if deficit < r.dust:
        return
    reason = kind.borrow_reason(r, name, why)
    if reason is None:
        return
    offers = _offers(r, name, deficit)
    if offers and not kind.loan_buys(r, name, offers):
        return  # what the idle models can spare would buy it nothing
    for donor, amount in offers:
        r.transfer(donor, name, amount, MoveKind.LEND, f"{reason}: {_lender_why(r, donor, amount)}")


def _lender_why(r: QuotaRound, donor: str, amount: int) -> str:
    load = r.loads[donor]
    if r.kinds[donor].hands_over(r, donor):
        return f"{donor}'s burst is over (queue {load.queue_depth:.0f}): it hands over {format_size(amount)}"
    quiet_for = r.now_s - (r.inputs.states[donor].quiet_since_s or r.now_s)
    return f"{donor} idle (busy_frac {load.busy_frac:.2f}) for {quiet_for:.0f}s lends {format_size(amount)}"


def _offers(r: QuotaRound, name: str, deficit: int) -> list[tuple[str, int]]:
    """What idle models can spare above their working sets toward ``deficit``, the largest surplus first."""
    ledger = r.ledger
    donors = sorted(
        (n for n in r.config.models if n != name and r.idle(n)),
        key=lambda n: (-(ledger.grant(n) - r.working_set(n)), n),
    )
    offers: list[tuple[str, int]] = []
    for donor in donors:
        surplus = min(ledger.grant(donor) - r.working_set(donor), ledger.headroom_bytes(name))
        amount = min(deficit - sum(a for _, a in offers), surplus)
        if amount >= r.dust:
            offers.append((donor, amount))
    return offers


def lifts_ceiling(r: QuotaRound, name: str, offers: list[tuple[str, int]]) -> bool:
    """Whether the offers raise the batch ``name``'s memory holds (an unknown ceiling counts as raised)."""
    holds, replicas, mm = r.holds(name), r.replicas(name), r.mm(name)
    ceiling = mm.cap_for(holds / replicas)
    lifted = mm.cap_for((holds + sum(a for _, a in offers)) / replicas)
    return ceiling is None or lifted is None or lifted > ceiling


def restore_base(r: QuotaRound, by_priority_name: _Order) -> None:
    """Step 7: owners still under their base take it back from memory nobody asked for this tick."""
    for owner, spec in by_priority_name:
        short = spec.quota.base - r.holds(owner)
        if short >= r.dust and r.ledger.free_bytes >= r.dust:
            why = f"{owner} under its base {format_size(spec.quota.base)}: back from the free pool"
            r.grow(owner, short, MoveKind.RECLAIM, why)


def _escalation(
    step: int, borrower: str, pending: list[Transfer], grant: int, gate: ConfirmGate, now_s: float, token: int
) -> QuotaMove:
    owners = ", ".join(sorted({t.recipient or "pool" for t in pending}))
    amount = sum(t.amount_bytes for t in pending)
    first = min(t.started_s for t in pending)
    action = {
        MoveKind.RECLAIM_CACHE: "release its caches",
        MoveKind.RECLAIM_DRAIN: "pause admission and drain",
        MoveKind.RECLAIM_RESTART: f"restart its replicas (restart_token {token})",
    }[step_kind(step)]
    what = "reclaim" if any(t.kind == "reclaim" for t in pending) else "release"
    reason = (
        f"{what} of {format_size(amount)} for {owners} not confirmed {now_s - first:.0f}s after it began "
        f"({borrower} used {format_size(gate.used_bytes)} against grant {format_size(grant)}; {gate.why}): "
        f"step {step}, {borrower} must {action}"
    )
    return QuotaMove(step_kind(step), borrower, owners, amount, reason)
