"""Quota moves for one tick: lend from idle models to memory-bound busy ones, reclaim base.

Design note. The ledger (``quotas.ledger``) guarantees the arithmetic (sum of grants within
usable at every step, min <= grant <= max, two-phase transfers). This module decides *which*
moves to make, in this order, each tick:

1. abort transfers whose donor has not got under its new grant within
   ``broker.transfer_timeout_s`` (the donor gets the amount back);
2. confirm: a donor that runs the settings carrying its lowered grant (its reported settings
   version) and reports memory under that grant completes its pending transfers;
3. reclaim: an owner under its base whose load has been back for ``reclaim_hold_s``
   (hysteresis) takes its whole base back (base is guaranteed, whatever it needs right now), from the free pool first, then from borrowers' loans
   (two-phase);
4. release: a borrower gone idle hands its loan (grant above base) back to the free pool
   (never below its observed working set); a busy borrower keeps it until an owner reclaims;
5. lend: a busy model whose wanted batch does not fit its grant grows from the free pool, then
   borrows from models idle (busy share under ``idle_util_frac``, no backlog) for
   ``idle_hold_s``, which give what they hold above their working
   set (peak memory x 1.1, the memory for a floor batch, and ``min``), highest priority first.

6. restore: an owner still under its base takes it back from the free pool (memory nobody
   asked for this tick); if it is idle it will lend it again when someone needs it.

A model's need is ``replicas x grant_for(wanted cap)`` from its calibrated memory model; an
uncalibrated model neither borrows nor is sized (it keeps its base).
"""

from __future__ import annotations

from typing import Mapping

from broker.memory_model import MemoryModel
from broker.state import BatchWant, ModelState
from broker.types import FleetSnapshot, ModelLoad, QuotaMove
from quotas.config import FleetConfig
from quotas.ledger import LedgerError, QuotaLedger
from quotas.sizes import format_size


WORKING_SET_MARGIN = 1.1


def min_move_bytes(ledger: QuotaLedger) -> int:
    """Moves smaller than this are dust: not worth a transfer."""
    return max(4 * 1024**2, ledger.usable_bytes // 256)


def plan_quota(
    snapshot: FleetSnapshot,
    config: FleetConfig,
    ledger: QuotaLedger,
    states: Mapping[str, "ModelState"],
    wants: Mapping[str, "BatchWant"],
    confirm_after: dict[str, int],
    now_s: float,
) -> tuple[list[QuotaMove], dict[str, int], list[str], set[str]]:
    """Mutates ``ledger`` (the caller's copy). Returns (moves, confirm_after, notes, new donors)."""
    moves: list[QuotaMove] = []
    notes: list[str] = []
    new_donors: set[str] = set()
    dust = min_move_bytes(ledger)
    loads = {n: snapshot.models.get(n) or ModelLoad(name=n, replicas=0) for n in config.models}

    # 1. abort stale transfers
    for t in ledger.pending:
        if now_s - t.started_s > config.broker.transfer_timeout_s:
            ledger.abort(t.id)
            reason = (f"transfer {t.id} {t.donor}->{t.recipient} {format_size(t.amount_bytes)} not confirmed in "
                      f"{config.broker.transfer_timeout_s:g}s (donor used {format_size(loads[t.donor].mem_used_bytes)}): aborted")
            moves.append(QuotaMove("abort", t.donor, t.recipient, t.amount_bytes, reason))

    # 2. confirm donors now under their grant, running the settings that carry it
    for donor in sorted({t.donor for t in ledger.pending}):
        load = loads[donor]
        if load.replicas > 0 and load.settings_version < confirm_after.get(donor, 0):
            continue
        for t in ledger.confirm(donor, load.mem_used_bytes, now_s):
            moves.append(QuotaMove("confirm", t.donor, t.recipient, t.amount_bytes,
                                   f"{donor} used {format_size(load.mem_used_bytes)} <= grant {format_size(ledger.grant(donor))}: "
                                   f"{t.recipient} +{format_size(t.amount_bytes)}"))
    pending_donors = {t.donor for t in ledger.pending}
    confirm_after = {d: v for d, v in confirm_after.items() if d in pending_donors}

    def mm(name: str) -> MemoryModel:
        return MemoryModel.from_load(loads[name])

    def replicas(name: str) -> int:
        return max(1, loads[name].replicas or config.models[name].replicas)

    def need(name: str) -> int | None:
        model = mm(name)
        if not model.calibrated:
            return None
        q = config.models[name].quota
        return min(q.max, max(q.min, replicas(name) * model.grant_for(wants[name].cap)))

    def working_set(name: str) -> int:
        spec = config.models[name]
        ws = max(int(loads[name].mem_peak_bytes * WORKING_SET_MARGIN), spec.quota.min)
        if mm(name).calibrated:
            ws = max(ws, replicas(name) * mm(name).grant_for(spec.batch.floor))
        return ws

    def idle(name: str) -> bool:
        st = states[name]
        return st.quiet_since_s is not None and now_s - st.quiet_since_s >= config.models[name].control.idle_hold_s

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
        moves.append(QuotaMove(kind, donor, recipient, t.amount_bytes, why))

    def grow(name: str, amount: int, kind: str, why: str) -> int:
        amount = min(amount, ledger.free_bytes, ledger.headroom_bytes(name))
        if amount <= 0:
            return 0
        try:
            ledger.grow(name, amount)
        except LedgerError as exc:
            notes.append(f"grow {name} refused: {exc}")
            return 0
        moves.append(QuotaMove(kind, None, name, amount, why))
        return amount

    # 3. reclaim base for owners whose load is back
    for owner, spec in sorted(config.models.items(), key=lambda kv: -kv[1].priority):
        short = spec.quota.base - ledger.grant(owner) - ledger.incoming_bytes(owner)
        if short < dust or idle(owner) or busy_for(owner) < spec.control.reclaim_hold_s:
            continue
        load = loads[owner]
        why = (f"{owner} load back for {busy_for(owner):.0f}s (arrival_rate_rps {load.arrival_rate_rps:.1f}, "
               f"queue {load.queue_depth:.0f}): reclaim toward base {format_size(spec.quota.base)}")
        for borrower, amount in ledger.reclaim_plan(owner):
            take = min(amount, short)
            if take <= 0:
                break
            if borrower == "":
                short -= grow(owner, take, "reclaim", why + " from the free pool")
            else:
                transfer(borrower, owner, take, "reclaim", why + f" from {borrower}'s loan")
                short -= take

    # 4. release loans of borrowers gone idle (a busy borrower keeps its loan until an owner
    #    reclaims it: releasing on every dip of its need would make the grant flap)
    for name, spec in config.models.items():
        loan = ledger.loan_bytes(name)
        if loan < dust or not idle(name):
            continue
        keep = max(spec.quota.base, working_set(name))
        excess = min(loan, ledger.grant(name) - keep)
        if excess >= dust:
            try:
                ledger.release(name, excess)
            except LedgerError as exc:
                notes.append(f"release {name} refused: {exc}")
                continue
            moves.append(QuotaMove("release", name, None, excess,
                                   f"{name} needs {format_size(keep)} of its {format_size(keep + excess)}: loan of {format_size(excess)} back to the pool"))

    # 5. lend to memory-bound busy models
    order = sorted(config.models, key=lambda n: (-config.models[n].priority, n))
    for name in order:
        wanted = need(name)
        if wanted is None or idle(name):
            continue
        deficit = wanted - ledger.grant(name) - ledger.incoming_bytes(name)
        if deficit < dust:
            continue
        want = wants[name]
        why = (f"{name} wants batch {want.cap} ({want.trigger} {want.value:.1f}) needing {format_size(wanted)}, "
               f"grant {format_size(ledger.grant(name))}")
        deficit -= grow(name, deficit, "grow", why + ": from the free pool")
        if deficit < dust:
            continue
        donors = sorted(
            (n for n in config.models if n != name and idle(n)),
            key=lambda n: (-(ledger.grant(n) - working_set(n)), n),
        )
        for donor in donors:
            surplus = min(ledger.grant(donor) - working_set(donor), ledger.headroom_bytes(name))
            amount = min(deficit, surplus)
            if amount < dust:
                continue
            transfer(donor, name, amount, "lend",
                     why + f": {donor} idle (busy_frac {loads[donor].busy_frac:.2f}) for {now_s - (states[donor].quiet_since_s or now_s):.0f}s lends {format_size(amount)}")
            deficit -= amount
            if deficit < dust:
                break
    # 6. top owners under base back up from memory nobody needs this tick
    for owner, spec in sorted(config.models.items(), key=lambda kv: (-kv[1].priority, kv[0])):
        short = spec.quota.base - ledger.grant(owner) - ledger.incoming_bytes(owner)
        if short >= dust and ledger.free_bytes >= dust:
            grow(owner, short, "reclaim", f"{owner} under its base {format_size(spec.quota.base)}: back from the free pool")
    return moves, confirm_after, notes, new_donors
