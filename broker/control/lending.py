"""Quota moves for one tick: lend from idle models to memory-bound busy ones, reclaim base.

Design note. The ledger (``quotas.ledger``) guarantees the arithmetic (sum of grants within
usable at every step, min <= grant <= max, two-phase transfers). This module decides *which*
moves to make, and when a move may complete, in this order, each tick:

1. abort lends whose donor has not been confirmed within ``broker.transfer_timeout_s`` (the
   donor gets the amount back). Reclaims and releases are never aborted: they escalate (3);
2. confirm (``confirm_gate``): a donor's pending transfers complete only on a report from
   *every* live replica of the donor (at least ``replicas`` of them, each reported within the
   window's ``stale_after_s``) that arrived after the transfer began, each running the
   settings version that carries the lowered grant, with their measured memory summed at or
   under that grant. No report, no confirmation: a silent donor, or a broker restarted before
   the reports arrive, confirms nothing;
3. escalate a reclaim (or a release) its borrower has not honoured: the reclaim itself lowered
   the borrower's grant and so its cap (step 0); after each further ``transfer_timeout_s`` (T)
   without a confirmation the next step, each a logged move of its own kind
   (``RECLAIM_STEPS``): release caches (``ModelSettings.release_cache``), pause admission and
   drain (``drain``), restart the replicas (``restart_token`` bumps, once: the old process
   keeps failing its health check and each replacement starts on the new token, so a second
   bump while Serve is still replacing it would only kill a healthy replacement). **Bound**: the owner has its base back within
   ``3 T + restart + stale_after_s + control_interval_s`` of the reclaim, where ``restart``
   is the time Serve takes to replace a replica that fails its health check and the new one
   to report (its old replica's last report drops out of the window after ``stale_after_s``);
   measured 16 s on CPU with the fleet's ``health_check_period_s`` of 5 s
   (``tests/integration/test_reclaim_restart.py``), so about 110 s with the default T of 30 s.
   Memory from the free pool comes back at once;
4. reclaim: an owner under its base whose load has been back for ``reclaim_hold_s``
   (hysteresis) takes its whole base back (base is guaranteed, whatever it needs right now),
   from the free pool first, then from borrowers' loans (two-phase);
5. release: a borrower gone idle hands its loan (grant above base) back to the pool (never
   below its observed working set); a busy borrower keeps it until an owner reclaims. A
   borrower is idle only if its arrivals would keep it under ``idle_util_frac`` at the batch its
   base holds as well (its latency fit): at the bigger batches a loan buys, the same requests may
   keep it under that share, and a loan given back then leaves it behind, borrowing it again. A
   release is two-phase too: the grant drops now, the pool gets the bytes at its confirm;
6. lend: a busy model whose wanted batch does not fit its grant grows from the free pool, then
   borrows from models idle (busy share under ``idle_util_frac``, no backlog) for
   ``idle_hold_s``, which give what they hold above their working set, highest priority first.
   A move must buy more than it costs: the borrower must be held back by its memory now
   (``pressed``: its window's biggest batch at the ceiling its grant holds, and a backlog or a
   recent P95 over its SLO; with lazy formation every model *wants* a large cap), the loan must
   raise its batch ceiling, and a lender keeps, up to its base, the memory for what its own
   demand at the window's peak needs (``peak_batch``: all of its biggest batch if it missed its
   SLO in the window, else the smallest batch whose scaled P99 stays within ``LEND_TAIL_FRAC``
   of its SLO). Measured on ``bench lending``'s independent load (every model bursting, gamma
   CV 4): lenders lowered to the floor batch missed their next burst before the reclaim
   landed, and loans of memory a borrower could not use bought nothing;
7. restore: an owner still under its base takes it back from the free pool (memory nobody
   asked for this tick); if it is idle it will lend it again when someone needs it.

Every grow from the pool is limited to ``quotas.holding.measured_free_bytes`` as well as the
ledger's free bytes, so the sum of max(grant + in flight from it, measured use) over models
stays within usable. A model's need is ``replicas x grant_for(wanted cap)`` from its
calibrated memory model; an uncalibrated model neither borrows nor is sized (it keeps its
base). ``plan_quota`` never changes its arguments: it returns a ``QuotaPlan``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from broker.control.batch_inputs import cap_top
from broker.control.lending_need import peak_batch, pressed
from broker.control.memory_model import MemoryModel
from broker.control.state import BatchWant, ModelState
from broker.control.types import FleetSnapshot, ModelLoad, QuotaMove
from broker.control.vocab import MoveKind
from quotas.config import FleetConfig, ModelSpec
from quotas.holding import measured_free_bytes
from quotas.ledger import LedgerError, QuotaLedger, Transfer
from quotas.sizes import format_size

ESCALATING = ("reclaim", "release")  # transfer kinds that escalate instead of aborting


# Escalation of a reclaim (or release) the borrower has not honoured, in order (QuotaMove.kind):
# after T release caches, after 2 T pause admission and drain, after 3 T restart (once).
RECLAIM_STEPS = (MoveKind.RECLAIM_CACHE, MoveKind.RECLAIM_DRAIN, MoveKind.RECLAIM_RESTART)


def step_kind(step: int) -> MoveKind:
    """The move kind of escalation step ``step`` (1, 2 or 3)."""
    return RECLAIM_STEPS[min(step, len(RECLAIM_STEPS)) - 1]


@dataclass(frozen=True)
class QuotaPlan:
    """What ``plan_quota`` decided for one tick; its inputs are left as they were."""

    ledger: QuotaLedger  # the ledger after this tick's moves (a copy; the caller's is untouched)
    moves: tuple[QuotaMove, ...]  # ledger steps taken, in order (for the decision log)
    confirm_after: Mapping[str, int]  # donor -> settings version it must run before its transfers complete
    notes: tuple[str, ...]  # refusals and other remarks
    new_donors: frozenset[str]  # models whose grant dropped this tick (the caller records their new version)
    reclaim_steps: Mapping[str, int]  # borrower -> escalation step reached (1 cache, 2 drain, 3 restart)
    restart_tokens: Mapping[str, int]  # model -> restart token (only ever rises)
    lend_scale: Mapping[str, float] = field(default_factory=dict)  # model -> idle-hold multiplier (lend regret)
    lent_at: Mapping[str, float] = field(default_factory=dict)  # model -> when it last lent (this loan spell)


@dataclass(frozen=True)
class ConfirmGate:
    """Whether a donor's reports may confirm its transfers, and why (``confirm_gate``)."""

    ok: bool
    used_bytes: int  # measured use summed over the live replicas
    measured_s: float  # the oldest of their latest reports: transfers begun before it may complete
    why: str


def min_move_bytes(ledger: QuotaLedger) -> int:
    """Moves smaller than this are dust: not worth a transfer."""
    return max(4 * 1024**2, ledger.usable_bytes // 256)


def confirm_gate(load: ModelLoad, replicas: int, version: int, started_s: float) -> ConfirmGate:
    """A donor confirms only on reports from every live replica (at least ``replicas``), each
    received after ``started_s`` and running settings ``version`` or later.

    ``used_bytes`` is what the donor may hold once confirmed: each replica is held to its share
    of the grant (grant / ``replicas``: deployments.enforce), so one replica above its share while
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


def plan_quota(
    snapshot: FleetSnapshot,
    config: FleetConfig,
    ledger: QuotaLedger,
    states: Mapping[str, ModelState],
    wants: Mapping[str, BatchWant],
    confirm_after: Mapping[str, int],
    now_s: float,
    reclaim_steps: Mapping[str, int] | None = None,
    restart_tokens: Mapping[str, int] | None = None,
    need_bytes: Mapping[str, int] | None = None,
    lend_scale: Mapping[str, float] | None = None,
    lent_at: Mapping[str, float] | None = None,
    memory_models: Mapping[str, MemoryModel] | None = None,
) -> QuotaPlan:
    """One tick of quota moves (module docstring); returns a ``QuotaPlan``, changes nothing it is given.
    ``memory_models``: each model's ``MemoryModel.from_load`` of this snapshot, when the caller has them."""
    ledger = ledger.copy()
    scale = dict(lend_scale or {})
    lent = dict(lent_at or {})
    moves: list[QuotaMove] = []
    notes: list[str] = []
    new_donors: set[str] = set()
    tokens = dict(restart_tokens or {})
    timeout_s = config.broker.transfer_timeout_s
    dust = min_move_bytes(ledger)
    loads = {n: snapshot.models.get(n) or ModelLoad(name=n, replicas=0) for n in config.models}
    used = {n: load.mem_used_bytes for n, load in loads.items()}

    # 1. abort stale lends (reclaims and releases escalate instead)
    for t in ledger.pending:
        if t.kind == "lend" and now_s - t.started_s > timeout_s:
            ledger.abort(t.id)
            gate = confirm_gate(
                loads[t.donor], config.models[t.donor].replicas, confirm_after.get(t.donor, 0), t.started_s
            )
            reason = (
                f"transfer {t.id} {t.kind} {t.donor}->{t.recipient or 'pool'} {format_size(t.amount_bytes)} not "
                f"confirmed in {timeout_s:g}s (donor used {format_size(gate.used_bytes)}; {gate.why}): aborted"
            )
            moves.append(QuotaMove(MoveKind.ABORT, t.donor, t.recipient or None, t.amount_bytes, reason))

    # 2. confirm donors measured under their grant on every live replica
    for donor in sorted({t.donor for t in ledger.pending}):
        oldest = min(t.started_s for t in ledger.pending if t.donor == donor)
        gate = confirm_gate(loads[donor], config.models[donor].replicas, confirm_after.get(donor, 0), oldest)
        if not gate.ok:
            continue
        for t in ledger.confirm(donor, gate.used_bytes, gate.measured_s):
            to = (
                f"{t.recipient} +{format_size(t.amount_bytes)}"
                if t.recipient
                else f"pool +{format_size(t.amount_bytes)}"
            )
            moves.append(
                QuotaMove(
                    MoveKind.CONFIRM,
                    t.donor,
                    t.recipient or None,
                    t.amount_bytes,
                    f"{donor} used {format_size(gate.used_bytes)} <= grant {format_size(ledger.grant(donor))} "
                    f"({gate.why}): {to}",
                )
            )
    pending_donors = {t.donor for t in ledger.pending}
    after = {d: v for d, v in confirm_after.items() if d in pending_donors}

    # 3. escalate reclaims and releases their borrowers have not honoured
    steps: dict[str, int] = {}
    for borrower in sorted({t.donor for t in ledger.pending if t.kind in ESCALATING}):
        mine = [t for t in ledger.pending if t.kind in ESCALATING and t.donor == borrower]
        first = min(mine, key=lambda t: t.started_s)
        reached = min(len(RECLAIM_STEPS), int((now_s - first.started_s) // timeout_s)) if timeout_s > 0 else 0
        before = (reclaim_steps or {}).get(borrower, 0)
        steps[borrower] = max(before, reached)
        gate = confirm_gate(loads[borrower], config.models[borrower].replicas, after.get(borrower, 0), first.started_s)
        for step in range(before + 1, reached + 1):
            if step >= 3:
                tokens[borrower] = tokens.get(borrower, 0) + 1
            moves.append(
                _escalation(step, borrower, mine, ledger.grant(borrower), gate, now_s, tokens.get(borrower, 0))
            )

    memory: dict[str, MemoryModel] = dict(memory_models or {})

    def mm(name: str) -> MemoryModel:  # one per model per tick: the steps below ask it several times
        if name not in memory:
            memory[name] = MemoryModel.from_load(loads[name])
        return memory[name]

    def replicas(name: str) -> int:
        return max(1, loads[name].replicas or config.models[name].replicas)

    def need(name: str) -> int | None:
        if need_bytes is not None and name in need_bytes:  # an LLM engine's wanted grant (broker.control.llm_window)
            q = config.models[name].quota
            return min(q.max, max(q.min, int(need_bytes[name])))
        model = mm(name)
        if not model.calibrated:
            return None
        q = config.models[name].quota
        return min(q.max, max(q.min, replicas(name) * model.grant_for(wants[name].cap)))

    def working_set(name: str) -> int:
        # What an idle lender keeps: its memory in use now (latest reports, not the window's peak
        # memory: a burst that ended 20 s ago, served on borrowed memory, must not pin it for the
        # next model's burst) times the margin, its min, the memory for a floor batch, and up to
        # its base what its own demand at the window's peak needs (peak_batch). A lender still
        # above a lowered grant is not confirmed until it is measured under it (two-phase).
        spec = config.models[name]
        ws = max(int(loads[name].mem_used_bytes * spec.control.working_set_margin), spec.quota.min)
        if mm(name).calibrated:
            ws = max(ws, replicas(name) * mm(name).grant_for(spec.batch.floor))
            # never below what its own demand at the window's peak needs (up to its base)
            peak = replicas(name) * mm(name).grant_for(peak_batch(loads[name], spec, states[name].latency_fit))
            ws = max(ws, min(spec.quota.base, peak))
        return ws

    def idle(name: str) -> bool:
        # a model whose loans keep coming back soon after it lends waits longer before it lends again
        st = states[name]
        hold = config.models[name].control.idle_hold_s * scale.get(name, 1.0)
        if st.quiet_since_s is None or now_s - st.quiet_since_s < hold:
            return False
        return not ledger.loan_bytes(name) or not busy_at_base(name)

    def busy_at_base(name: str) -> bool:
        # A loan can make its borrower look idle: at the bigger batches it buys, the same requests
        # keep the replicas busy under idle_util_frac. Released or lent on, the memory leaves it at
        # the batch its base holds, busy again and behind (or missing its SLO on clumps of
        # requests), and it borrows the memory back: grants flap. So a borrower is idle only if its
        # arrivals would keep it under idle_util_frac at its base's batch too (its latency fit).
        load, spec, fit = loads[name], config.models[name], states[name].latency_fit
        if fit is None or load.arrival_rate_rps <= 0:
            return False
        base_cap = cap_top(spec.batch, mm(name).cap_for(spec.quota.base / replicas(name)))
        units_per_s = load.arrival_rate_rps * max(load.cost_per_request, 1.0) / replicas(name)
        return units_per_s / fit.saturated_rate(base_cap) >= spec.control.idle_util_frac

    def busy_for(name: str) -> float:
        st = states[name]
        return 0.0 if st.loaded_since_s is None else now_s - st.loaded_since_s

    def transfer(donor: str, recipient: str, amount: int, kind: str, why: str) -> None:
        try:
            t = ledger.begin_transfer(donor, recipient, amount, now_s, kind)
        except LedgerError as exc:
            notes.append(f"{kind} {donor}->{recipient} refused: {exc}")
            return
        new_donors.add(donor)
        if kind == MoveKind.LEND:
            lent[donor] = now_s
        moves.append(QuotaMove(kind, donor, recipient, t.amount_bytes, why))

    def grow(name: str, amount: int, kind: str, why: str | Callable[[], str]) -> int:
        """``why``: the move's reason, or a function that writes it (called only when there is a move)."""
        amount = min(amount, ledger.free_bytes)
        if amount > 0:
            amount = min(amount, ledger.headroom_bytes(name))
        if amount > 0:  # the measured bound last: it sums over every model
            amount = min(amount, measured_free_bytes(ledger, used))
        if amount <= 0:
            return 0
        try:
            ledger.grow(name, amount)
        except LedgerError as exc:
            notes.append(f"grow {name} refused: {exc}")
            return 0
        moves.append(QuotaMove(kind, None, name, amount, why if isinstance(why, str) else why()))
        return amount

    # 4. reclaim base for owners whose load is back
    by_priority, by_priority_name = _orders(config)
    for owner, spec in by_priority:
        short = spec.quota.base - ledger.grant(owner) - ledger.incoming_bytes(owner)
        if short < dust or idle(owner) or busy_for(owner) < spec.control.reclaim_hold_s:
            continue
        load = loads[owner]
        why = (
            f"{owner} load back for {busy_for(owner):.0f}s (arrival_rate_rps {load.arrival_rate_rps:.1f}, "
            f"queue {load.queue_depth:.0f}): reclaim toward base {format_size(spec.quota.base)}"
        )
        if owner in lent:  # lend regret: a loan that had to come back soon doubles the owner's idle hold
            ctl, since = spec.control, now_s - lent.pop(owner)
            old = scale.get(owner, 1.0)
            new = min(ctl.lend_backoff_max, old * 2.0) if since < ctl.lend_regret_s else max(1.0, old / 2.0)
            if new != old:
                scale[owner] = new
                why += (
                    f"; its loan came back {since:.0f}s after it lent: lends again only after "
                    f"{ctl.idle_hold_s * new:.0f}s idle"
                )
        for borrower, amount in ledger.reclaim_plan(owner):
            take = min(amount, short)
            if take <= 0:
                break
            if borrower == "":
                short -= grow(owner, take, MoveKind.RECLAIM, why + " from the free pool")
            else:
                transfer(borrower, owner, take, MoveKind.RECLAIM, why + f" from {borrower}'s loan")
                short -= take

    # 5. release loans of borrowers gone idle, two-phase (a busy borrower keeps its loan until an
    #    owner reclaims it: releasing on every dip of its need would make the grant flap)
    for name, spec in config.models.items():
        loan = ledger.loan_bytes(name)
        if loan < dust or not idle(name) or ledger.outgoing_bytes(name):
            continue
        keep = max(spec.quota.base, working_set(name))
        excess = min(loan, ledger.grant(name) - keep)
        if excess >= dust:
            try:
                ledger.begin_release(name, excess, now_s)
            except LedgerError as exc:
                notes.append(f"release {name} refused: {exc}")
                continue
            new_donors.add(name)
            moves.append(
                QuotaMove(
                    MoveKind.RELEASE,
                    name,
                    None,
                    excess,
                    f"{name} needs {format_size(keep)} of its {format_size(keep + excess)}: loan of "
                    f"{format_size(excess)} back to the pool once {name} is measured under {format_size(keep)}",
                )
            )

    # 6. lend to memory-bound busy models
    for name, _spec in by_priority_name:
        wanted = need(name)
        if wanted is None or idle(name):
            continue
        if held := loads[name].held_over:  # refusing requests, it holds over its grant: that + its batch
            wanted = min(config.models[name].quota.max, loads[name].mem_used_bytes + wanted)
        deficit = wanted - ledger.grant(name) - ledger.incoming_bytes(name)
        if deficit < dust:
            continue
        want = wants[name]

        def wants_why(
            name: str = name, want: BatchWant = want, wanted: int = wanted, grant: int = ledger.grant(name)
        ) -> str:  # written only when a move needs it
            if name in (need_bytes or {}):
                return f"{name} engine wants {format_size(wanted)}, grant {format_size(grant)}"
            return (
                f"{name} wants batch {want.cap} ({want.trigger} {want.value:.1f}) needing {format_size(wanted)}, "
                f"grant {format_size(grant)}"
            )

        deficit -= grow(name, deficit, MoveKind.GROW, lambda: wants_why() + ": from the free pool")
        if deficit < dust:
            continue
        if name not in (need_bytes or {}):
            holds = ledger.grant(name) + ledger.incoming_bytes(name)
            ceiling = mm(name).cap_for(holds / replicas(name))
            if pressed(loads[name], config.models[name], ceiling, explain=False) is not None:
                continue  # not logged: with lazy formation this is most ticks of most models
            why = wants_why() + (
                f", refusing requests: it holds {format_size(loads[name].mem_used_bytes)}, over its grant"
                if loads[name].held_over
                else f", behind at its memory ceiling {ceiling} (queue {loads[name].queue_depth:.0f}, recent P95 "
                f"{loads[name].recent_p95_ms or 0.0:.0f} ms)"
            )
        else:
            why = wants_why()
        donors = sorted(
            (n for n in config.models if n != name and idle(n)),
            key=lambda n: (-(ledger.grant(n) - working_set(n)), n),
        )
        offers: list[tuple[str, int]] = []
        for donor in donors:
            surplus = min(ledger.grant(donor) - working_set(donor), ledger.headroom_bytes(name))
            amount = min(deficit - sum(a for _, a in offers), surplus)
            if amount >= dust:
                offers.append((donor, amount))
        if name not in (need_bytes or {}) and offers and not held:
            holds = ledger.grant(name) + ledger.incoming_bytes(name)
            ceiling = mm(name).cap_for(holds / replicas(name))
            lifted = mm(name).cap_for((holds + sum(a for _, a in offers)) / replicas(name))
            if ceiling is not None and lifted is not None and lifted <= ceiling:
                continue  # what the idle models can spare would not raise its batch: a move that buys nothing
        for donor, amount in offers:
            transfer(
                donor,
                name,
                amount,
                MoveKind.LEND,
                why + f": {donor} idle (busy_frac {loads[donor].busy_frac:.2f}) for "
                f"{now_s - (states[donor].quiet_since_s or now_s):.0f}s lends {format_size(amount)}",
            )
    # 7. top owners under base back up from memory nobody needs this tick
    for owner, spec in by_priority_name:
        short = spec.quota.base - ledger.grant(owner) - ledger.incoming_bytes(owner)
        if short >= dust and ledger.free_bytes >= dust:
            grow(
                owner,
                short,
                MoveKind.RECLAIM,
                f"{owner} under its base {format_size(spec.quota.base)}: back from the free pool",
            )
    return QuotaPlan(
        ledger=ledger,
        moves=tuple(moves),
        confirm_after=after,
        notes=tuple(notes),
        new_donors=frozenset(new_donors),
        reclaim_steps=steps,
        restart_tokens=tokens,
        lend_scale=scale,
        lent_at=lent,
    )


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
