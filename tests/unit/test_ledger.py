"""Tests for quotas/ledger.py: unit tests per method and refusal, then hypothesis sequences.

Sizes in the unit tests are MiB so messages read like the real thing; the random tests use
small integers so hypothesis shrinks to readable cases. Time is a fake integer clock.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpubroker.quotas.config import parse_config
from gpubroker.quotas.ledger import (
    LedgerError,
    LedgerInvariantError,
    ModelQuota,
    QuotaLedger,
    Transfer,
)

MiB = 1024**2


def make(grants=None, usable=10 * MiB) -> QuotaLedger:
    """Three models, sum(base) = 6MiB of 10MiB usable; grants default to base."""
    quotas = {
        "a": ModelQuota(1 * MiB, 2 * MiB, 5 * MiB),
        "b": ModelQuota(1 * MiB, 2 * MiB, 4 * MiB),
        "c": ModelQuota(0, 2 * MiB, 2 * MiB),
    }
    return QuotaLedger(usable, quotas, grants)


def refused(ledger: QuotaLedger, call, *names: str) -> LedgerError:
    """Assert ``call`` raises LedgerError naming every name, leaving the ledger unchanged."""
    before = ledger.to_dict()
    with pytest.raises(LedgerError) as info:
        call()
    message = str(info.value)
    for name in names:
        assert f"'{name}'" in message, message
    assert ledger.to_dict() == before
    return info.value


# ---------------------------------------------------------------------------------------------
# Construction and reading


def test_grants_default_to_base_and_reads_add_up():
    led = make()
    assert led.usable_bytes == 10 * MiB
    assert led.grants == {"a": 2 * MiB, "b": 2 * MiB, "c": 2 * MiB}
    assert led.grant("a") == 2 * MiB
    assert led.free_bytes == 4 * MiB
    assert led.in_flight_bytes == 0 and led.pending == ()
    assert led.loan_bytes("a") == 0 and led.lent_bytes("a") == 0
    assert set(led.quotas) == {"a", "b", "c"}
    led.check()


def test_grants_property_is_a_copy_and_quotas_read_only():
    led = make()
    led.grants["a"] = 0
    assert led.grant("a") == 2 * MiB
    with pytest.raises(TypeError):
        led.quotas["a"] = ModelQuota(0, 0, 0)  # type: ignore[index]


def test_partial_grants_fill_in_base_and_loan_lent():
    led = make({"a": 4 * MiB, "b": 1 * MiB})
    assert led.grants == {"a": 4 * MiB, "b": 1 * MiB, "c": 2 * MiB}
    assert led.loan_bytes("a") == 2 * MiB and led.lent_bytes("a") == 0
    assert led.lent_bytes("b") == 1 * MiB and led.loan_bytes("b") == 0


@pytest.mark.parametrize(
    "grants, fragment",
    [
        ({"a": 0}, "under its min"),
        ({"c": 3 * MiB}, "exceeds its max"),
        ({"a": 5 * MiB, "b": 4 * MiB, "c": 2 * MiB}, "exceeds usable"),
    ],
)
def test_constructor_refuses_broken_grants(grants, fragment):
    with pytest.raises(LedgerInvariantError) as info:
        make(grants, usable=10 * MiB)
    assert fragment in str(info.value)


def test_constructor_refuses_unknown_grant_and_bad_inputs():
    with pytest.raises(LedgerError, match="'zz'"):
        make({"zz": 1})
    with pytest.raises(LedgerError, match="sum of base"):
        make(usable=5 * MiB)
    with pytest.raises(LedgerError, match="not allowed"):
        QuotaLedger(10, {"": ModelQuota(0, 0, 0)})
    with pytest.raises(LedgerError, match="'x'.*ModelQuota"):
        QuotaLedger(10, {"x": (0, 0, 0)})  # type: ignore[dict-item]
    with pytest.raises(LedgerError, match="negative"):
        QuotaLedger(-1, {})
    with pytest.raises(LedgerError, match="whole number"):
        QuotaLedger(1.5, {})  # type: ignore[arg-type]


def test_model_quota_validates_order_and_types():
    with pytest.raises(LedgerError, match="lower min or raise base"):
        ModelQuota(3, 2, 4)
    with pytest.raises(LedgerError, match="lower base or raise max"):
        ModelQuota(1, 5, 4)
    with pytest.raises(LedgerError, match="negative"):
        ModelQuota(-1, 2, 4)
    with pytest.raises(LedgerError, match="whole number"):
        ModelQuota(True, 2, 4)


def test_unknown_model_in_reads_names_model_and_fix():
    led = make()
    for call in (led.grant, led.loan_bytes, led.lent_bytes, led.incoming_bytes, led.outgoing_bytes, led.reclaim_plan):
        err = refused(led, lambda call=call: call("zz"), "zz")
        assert "known models: a, b, c" in str(err)
        assert err.model == "zz"


def test_from_config_reads_quota_bytes():
    config = parse_config(
        {
            "gpu": {"device": "cpu", "capacity": "8GiB"},
            "models": {
                "mlp": {"model": "mlp", "quota": {"min": "300MiB", "base": "1GiB", "max": "2GiB"}},
                "cnn": {"model": "cnn", "quota": {"min": "400MiB", "base": "1GiB", "max": "3GiB"}},
            },
        }
    )
    led = QuotaLedger.from_config(config, config.usable_bytes())
    assert led.quotas["mlp"] == ModelQuota(300 * MiB, 1024 * MiB, 2048 * MiB)
    assert led.quotas["cnn"].max_bytes == 3 * 1024 * MiB
    assert led.grants == {"mlp": 1024 * MiB, "cnn": 1024 * MiB}
    assert led.usable_bytes == config.usable_bytes()


# ---------------------------------------------------------------------------------------------
# Two-phase transfer


def test_two_phase_walk_through():
    led = make()
    t = led.begin_transfer("a", "b", 1 * MiB, now_s=10)
    assert t == Transfer(id=1, donor="a", recipient="b", amount_bytes=1 * MiB, kind="lend", started_s=10.0)
    # Phase 1: donor lowered at once, recipient unchanged, amount in flight (not free).
    assert led.grant("a") == 1 * MiB
    assert led.grant("b") == 2 * MiB
    assert led.in_flight_bytes == 1 * MiB
    assert led.incoming_bytes("b") == 1 * MiB and led.outgoing_bytes("a") == 1 * MiB
    assert led.free_bytes == 4 * MiB
    assert led.lent_bytes("a") == 1 * MiB
    assert led.pending == (t,)
    led.check()
    # A report above the new grant completes nothing.
    assert led.confirm("a", used_bytes=1 * MiB + 1, now_s=11) == ()
    assert led.grant("b") == 2 * MiB and led.pending == (t,)
    # A report under the new grant completes it: recipient raised.
    assert led.confirm("a", used_bytes=1 * MiB, now_s=12) == (t,)
    assert led.grant("b") == 3 * MiB and led.loan_bytes("b") == 1 * MiB
    assert led.grant("a") == 1 * MiB
    assert led.pending == () and led.in_flight_bytes == 0
    led.check()


def test_confirm_completes_every_transfer_from_donor_but_only_those_begun_by_now():
    led = make()
    t1 = led.begin_transfer("a", "b", MiB // 2, now_s=5)
    t2 = led.begin_transfer("a", "b", MiB // 4, now_s=9)
    other = led.begin_transfer("c", "b", MiB // 4, now_s=5)
    # a report measured at 7 predates t2: only t1 completes.
    assert led.confirm("a", used_bytes=0, now_s=7) == (t1,)
    assert led.pending == (t2, other)
    assert led.confirm("a", used_bytes=0, now_s=9) == (t2,)
    assert led.grant("b") == 2 * MiB + MiB // 2 + MiB // 4
    assert led.pending == (other,)
    led.check()


def test_confirm_with_nothing_pending_and_bad_reports():
    led = make()
    assert led.confirm("a", used_bytes=0, now_s=1) == ()
    refused(led, lambda: led.confirm("a", used_bytes=-1, now_s=1), "a")
    refused(led, lambda: led.confirm("zz", used_bytes=0, now_s=1), "zz")
    with pytest.raises(LedgerError, match="now_s"):
        led.confirm("a", used_bytes=0, now_s=float("nan"))


def test_abort_gives_amount_back_to_donor():
    led = make()
    t = led.begin_transfer("a", "b", 1 * MiB, now_s=1)
    assert led.abort(t.id) == t
    assert led.grants == make().grants
    assert led.pending == ()
    with pytest.raises(LedgerError, match="not pending"):
        led.abort(t.id)
    with pytest.raises(LedgerError, match="not an int"):
        led.abort("1")  # type: ignore[arg-type]
    # ids are never reused
    assert led.begin_transfer("a", "b", 1, now_s=2).id == t.id + 1


def test_begin_transfer_refusals_name_the_model():
    led = make()
    refused(led, lambda: led.begin_transfer("zz", "b", 1, 0), "zz")
    refused(led, lambda: led.begin_transfer("a", "zz", 1, 0), "zz")
    err = refused(led, lambda: led.begin_transfer("a", "a", 1, 0), "a")
    assert "itself" in str(err)
    refused(led, lambda: led.begin_transfer("a", "b", 0, 0), "a")
    refused(led, lambda: led.begin_transfer("a", "b", -5, 0), "a")
    refused(led, lambda: led.begin_transfer("a", "b", 1.0, 0), "a")  # type: ignore[arg-type]
    refused(led, lambda: led.begin_transfer("a", "b", 1, 0, kind="gift"), "a")
    refused(led, lambda: led.begin_transfer("a", "b", 1, float("inf")))
    # donor below its min: a holds 2MiB, min 1MiB
    err = refused(led, lambda: led.begin_transfer("a", "b", 1 * MiB + 1, 0), "a")
    assert "under its min 1.0MiB" in str(err) and "move at most 1.0MiB" in str(err)
    assert "models.a.quota.min" in str(err)
    # recipient above its max: c is at its max already
    err = refused(led, lambda: led.begin_transfer("a", "c", 1, 0), "c")
    assert "exceeds its max" in str(err) or "exceed its max" in str(err)
    assert "models.c.quota.max" in str(err)


def test_recipient_max_counts_in_flight():
    led = make()  # b: grant 2MiB, max 4MiB
    led.begin_transfer("a", "b", 1 * MiB, 0)
    led.begin_transfer("c", "b", 1 * MiB, 0)
    err = refused(led, lambda: led.begin_transfer("c", "b", 1, 0), "b")
    assert "move at most 0B" in str(err)


def test_donor_with_transfer_out_cannot_be_pushed_over_max_by_abort():
    led = make()  # b: grant 2MiB, max 4MiB
    out = led.begin_transfer("b", "a", 1 * MiB, 0)  # b at 1MiB, 1MiB out
    assert led.headroom_bytes("b") == 2 * MiB
    refused(led, lambda: led.grow("b", 2 * MiB + 1), "b")
    led.grow("b", 2 * MiB)
    led.abort(out.id)
    assert led.grant("b") == 4 * MiB
    led.check()


def test_reclaim_kind_takes_only_the_loan():
    led = make({"a": 4 * MiB, "b": 1 * MiB})  # a borrowed 2MiB, b lent 1MiB
    err = refused(led, lambda: led.begin_transfer("a", "b", 2 * MiB + 1, 0, kind="reclaim"), "a")
    assert "only 2.0MiB" in str(err)
    t = led.begin_transfer("a", "b", 1 * MiB, 0, kind="reclaim")
    assert t.kind == "reclaim"
    led.confirm("a", used_bytes=3 * MiB, now_s=1)
    assert led.grant("b") == 2 * MiB and led.grant("a") == 3 * MiB


def test_message_shows_exact_bytes_when_human_form_rounds():
    led = make()
    err = refused(led, lambda: led.begin_transfer("a", "b", 1 * MiB + 1, 0), "a")
    assert "(1048577 bytes)" in str(err)


# ---------------------------------------------------------------------------------------------
# One-phase moves


def test_grow_from_free_pool_and_refusals():
    led = make()
    assert led.grow("a", 1 * MiB) == 3 * MiB
    assert led.free_bytes == 3 * MiB
    err = refused(led, lambda: led.grow("a", 2 * MiB + 1), "a")
    assert "models.a.quota.max" in str(err)
    led.grow("b", 2 * MiB)
    assert led.free_bytes == 1 * MiB
    err = refused(led, lambda: led.grow("a", 1 * MiB + 1), "a")
    assert "only 1.0MiB is free" in str(err)
    refused(led, lambda: led.grow("a", 0), "a")
    refused(led, lambda: led.grow("zz", 1), "zz")


def test_grow_cannot_take_bytes_in_flight():
    led = make(usable=6 * MiB)  # nothing free
    led.begin_transfer("a", "b", 1 * MiB, 0)
    assert led.free_bytes == 0
    refused(led, lambda: led.grow("c", 1), "c")
    refused(led, lambda: led.grow("a", 1), "a")


def test_release_to_pool_not_below_min():
    led = make()
    assert led.release("a", 1 * MiB) == 1 * MiB
    assert led.free_bytes == 5 * MiB
    err = refused(led, lambda: led.release("a", 1), "a")
    assert "release at most 0B" in str(err)
    refused(led, lambda: led.release("a", 0), "a")
    refused(led, lambda: led.release("zz", 1), "zz")
    assert led.release("c", 2 * MiB) == 0  # c's min is 0


# ---------------------------------------------------------------------------------------------
# Reclaim plan


def test_reclaim_plan_uses_free_pool_then_biggest_loans():
    # usable 10: a lent 1 (grant 1), b borrowed 2 (grant 4), c at 2; free = 3
    led = make({"a": 1 * MiB, "b": 4 * MiB})
    assert led.reclaim_plan("a") == [("", 1 * MiB)]
    tight = make({"a": 1 * MiB, "b": 4 * MiB}, usable=7 * MiB)  # free 0
    assert tight.reclaim_plan("a") == [("b", 1 * MiB)]
    assert tight.reclaim_plan("b") == [] and tight.reclaim_plan("c") == []


def test_reclaim_plan_splits_over_loans_biggest_first():
    quotas = {
        "own": ModelQuota(0, 6, 6),
        "x": ModelQuota(0, 1, 10),
        "y": ModelQuota(0, 1, 10),
        "z": ModelQuota(0, 1, 10),
    }
    led = QuotaLedger(10, quotas, {"own": 0, "x": 3, "y": 5, "z": 1})  # free 1
    assert led.reclaim_plan("own") == [("", 1), ("y", 4), ("x", 1)]
    execute_plan(led, "own", now_s=1)
    assert led.grant("own") == 6
    led.check()


def test_reclaim_plan_counts_in_flight_to_owner():
    led = make({"a": 1 * MiB, "b": 4 * MiB}, usable=7 * MiB)
    led.begin_transfer("b", "a", 1 * MiB, 0, kind="reclaim")
    assert led.reclaim_plan("a") == []


# ---------------------------------------------------------------------------------------------
# check()


def test_check_lists_every_broken_invariant():
    d = make().to_dict()
    d["usable_bytes"] = 3 * MiB
    d["grants"]["a"] = 0
    d["pending"] = [
        {"id": 1, "donor": "b", "recipient": "nope", "amount_bytes": 1, "kind": "lend", "started_s": 0.0},
        {"id": 1, "donor": "b", "recipient": "c", "amount_bytes": 1, "kind": "lend", "started_s": 0.0},
    ]
    d["next_id"] = 2
    with pytest.raises(LedgerInvariantError) as info:
        QuotaLedger.from_dict(d)
    text = str(info.value)
    problems = info.value.problems
    assert any("appears twice" in p for p in problems)
    assert any("unknown recipient 'nope'" in p for p in problems)
    assert any("exceeds usable" in p and "sum of grants" in p for p in problems)
    assert any("sum of base quotas" in p for p in problems)
    assert any("'a': grant 0B is under its min" in p for p in problems)
    assert "invariant(s)" in text and isinstance(info.value, LedgerError)


def test_check_catches_over_max_and_stale_next_id():
    d = make().to_dict()
    d["pending"] = [{"id": 7, "donor": "a", "recipient": "c", "amount_bytes": 5, "kind": "lend", "started_s": 0.0}]
    with pytest.raises(LedgerInvariantError) as info:
        QuotaLedger.from_dict(d)
    assert any("'c'" in p and "exceeds its max" in p for p in info.value.problems)
    assert any("next id" in p for p in info.value.problems)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip_through_json():
    led = make()
    led.begin_transfer("a", "b", 1 * MiB, now_s=1.25)
    led.release("c", 1 * MiB)
    d = led.to_dict()
    back = QuotaLedger.from_dict(json.loads(json.dumps(d)))
    assert back == led
    assert back.to_dict() == d
    assert back.pending == led.pending
    # the copy carries on identically: same next id, same completion
    assert back.begin_transfer("b", "a", 1, 2).id == led.begin_transfer("b", "a", 1, 2).id
    assert back.confirm("a", 0, 3) == led.confirm("a", 0, 3)
    assert back == led


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.pop("grants"), "lacks grants"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d["quotas"]["a"].update(min_bytes=10 * MiB), "'a'"),
        (lambda d: d["quotas"]["a"].pop("max_bytes"), "'a'"),
        (lambda d: d["pending"].append({"id": 9}), "malformed"),
        (lambda d: d["grants"].update(a=1.5), "'a'"),
    ],
)
def test_from_dict_refuses_bad_checkpoints(mutate, fragment):
    d = make().to_dict()
    mutate(d)
    with pytest.raises(LedgerError) as info:
        QuotaLedger.from_dict(d)
    assert fragment in str(info.value)


def test_copy_is_independent():
    led = make()
    dup = led.copy()
    assert dup == led and dup is not led
    dup.begin_transfer("a", "b", 1, 0)
    assert led.pending == () and led.grant("a") == 2 * MiB
    assert dup != led


# ---------------------------------------------------------------------------------------------
# Reconfigure


def test_reconfigure_keeps_grants_aborts_pending_and_never_mutates():
    led = make({"a": 4 * MiB, "b": 1 * MiB})
    t = led.begin_transfer("c", "a", 1 * MiB, 0)
    before = led.to_dict()
    new = led.reconfigure(10 * MiB, dict(led.quotas))
    assert led.to_dict() == before
    assert new.pending == ()
    assert new.grants == {"a": 4 * MiB, "b": 1 * MiB, "c": 2 * MiB}  # c got its in-flight amount back
    assert new.next_transfer_id == t.id + 1
    new.check()


def test_reconfigure_clamps_adds_and_drops_models():
    led = make({"a": 5 * MiB, "b": 1 * MiB})
    quotas = {
        "a": ModelQuota(1 * MiB, 2 * MiB, 3 * MiB),  # a clamps down to its new max
        "b": ModelQuota(2 * MiB, 2 * MiB, 4 * MiB),  # b clamps up to its new min
        "d": ModelQuota(0, 3 * MiB, 3 * MiB),  # new: starts at base; c dropped
    }
    new = led.reconfigure(10 * MiB, quotas)
    assert new.grants == {"a": 3 * MiB, "b": 2 * MiB, "d": 3 * MiB}
    new.check()


def test_reconfigure_shrinks_biggest_loans_first_when_usable_falls():
    quotas = {"a": ModelQuota(0, 2, 10), "b": ModelQuota(0, 2, 10), "c": ModelQuota(0, 2, 10)}
    led = QuotaLedger(20, quotas, {"a": 8, "b": 5, "c": 2})
    new = led.reconfigure(11, quotas)
    assert new.grants == {"a": 4, "b": 5, "c": 2}
    new = led.reconfigure(6, quotas)
    assert new.grants == {"a": 2, "b": 2, "c": 2}


def test_reconfigure_refuses_quotas_that_do_not_fit():
    led = make()
    big_min = {"a": ModelQuota(4, 4, 4), "b": ModelQuota(7, 7, 7)}
    err = refused(led, lambda: led.reconfigure(10, big_min), "b")
    assert "sum of quota.min" in str(err) and "raise gpu.capacity" in str(err)
    big_base = {"a": ModelQuota(1, 5, 5), "b": ModelQuota(1, 6, 6)}
    err = refused(led, lambda: led.reconfigure(10, big_base), "b")
    assert "sum of quota.base" in str(err)


# ---------------------------------------------------------------------------------------------
# Random sequences (hypothesis)


def execute_plan(led: QuotaLedger, owner: str, now_s: float) -> None:
    """Carry out reclaim_plan(owner): grow from the pool, reclaim loans in two phases."""
    for borrower, amount in led.reclaim_plan(owner):
        if borrower == "":
            led.grow(owner, amount)
        else:
            led.begin_transfer(borrower, owner, amount, now_s, kind="reclaim")
            assert led.confirm(borrower, led.grant(borrower), now_s)


@st.composite
def fleets(draw, names=("m0", "m1", "m2", "m3")):
    """(usable, quotas) with sum(base) <= usable; small integers."""
    n = draw(st.integers(1, len(names)))
    quotas = {}
    for name in names[:n]:
        lo = draw(st.integers(0, 8))
        base = lo + draw(st.integers(0, 8))
        hi = base + draw(st.integers(0, 12))
        quotas[name] = ModelQuota(lo, base, hi)
    usable = sum(q.base_bytes for q in quotas.values()) + draw(st.integers(0, 12))
    return usable, quotas


def amounts(valid_hi: int):
    """Byte amounts: mostly within (0, valid_hi] when that range exists, sometimes anything."""
    anything = st.integers(-1, 20)
    if valid_hi < 1:
        return anything
    valid = st.integers(1, valid_hi)
    return st.one_of(valid, valid, st.just(valid_hi), anything)


def assert_invariants(led: QuotaLedger) -> None:
    led.check()
    grants = led.grants
    assert sum(grants.values()) + led.in_flight_bytes <= led.usable_bytes
    assert led.free_bytes >= 0
    assert led.in_flight_bytes == sum(t.amount_bytes for t in led.pending)
    for name, q in led.quotas.items():
        assert q.min_bytes <= grants[name] <= q.max_bytes
        assert grants[name] + led.incoming_bytes(name) <= q.max_bytes
    ids = [t.id for t in led.pending]
    assert len(ids) == len(set(ids))


def settle(led: QuotaLedger, data, now_s: float) -> None:
    """Confirm or abort every pending transfer."""
    while led.pending:
        t = led.pending[0]
        if data.draw(st.booleans(), label=f"confirm {t.id}"):
            assert t in led.confirm(t.donor, led.grant(t.donor), now_s)
        else:
            assert led.abort(t.id) == t


class LedgerMachine(RuleBasedStateMachine):
    """Random begin/confirm/abort/grow/release/reclaim/reconfigure moves on one ledger."""

    @initialize(fleet=fleets())
    def start(self, fleet):
        usable, quotas = fleet
        self.led = QuotaLedger(usable, quotas)
        self.now = 0  # fake clock, integer ticks

    def names(self):
        return st.sampled_from(sorted(self.led.quotas))

    def attempt(self, op, *args, **kwargs):
        """Run op; a refusal must leave the ledger exactly as it was."""
        before = self.led.to_dict()
        try:
            return True, op(*args, **kwargs)
        except LedgerError:
            assert self.led.to_dict() == before
            return False, None

    def pair(self, data):
        """(donor, recipient), mostly two different models."""
        donor = data.draw(self.names(), label="donor")
        others = [n for n in sorted(self.led.quotas) if n != donor]
        if others and data.draw(st.integers(0, 4), label="distinct"):
            return donor, data.draw(st.sampled_from(others), label="recipient")
        return donor, data.draw(self.names(), label="recipient")

    @rule(data=st.data())
    def begin(self, data):
        donor, recipient = self.pair(data)
        kind = data.draw(st.sampled_from(["lend", "lend", "reclaim"]), label="kind")
        room = self.led.grant(donor) - self.led.quotas[donor].min_bytes
        if kind == "reclaim":
            room = min(room, self.led.loan_bytes(donor))
        room = min(room, self.led.headroom_bytes(recipient))
        amount = data.draw(amounts(room), label="amount")
        self.now += 1
        before = self.led.grants
        ok, t = self.attempt(self.led.begin_transfer, donor, recipient, amount, self.now, kind)
        if ok:
            after = self.led.grants
            assert after[donor] == before[donor] - amount
            assert after[recipient] == before[recipient]
            assert t in self.led.pending and t.started_s == self.now

    @rule(data=st.data())
    def confirm(self, data):
        donors = sorted({t.donor for t in self.led.pending})
        if donors and data.draw(st.integers(0, 4), label="a donor"):
            donor = data.draw(st.sampled_from(donors), label="donor")
        else:
            donor = data.draw(self.names(), label="donor")
        grant = self.led.grant(donor)
        used = data.draw(st.sampled_from([0, grant, grant + 1]), label="used")
        self.now += 1
        before = self.led.grants
        out = self.led.pending
        done = self.led.confirm(donor, used, self.now)
        if used > grant:
            assert done == ()
        else:
            assert set(done) == {t for t in out if t.donor == donor}
        after = self.led.grants
        for name in after:
            gained = sum(t.amount_bytes for t in done if t.recipient == name)
            assert after[name] == before[name] + gained

    @precondition(lambda self: self.led.pending)
    @rule(data=st.data())
    def abort(self, data):
        t = data.draw(st.sampled_from(self.led.pending), label="transfer")
        before = self.led.grant(t.donor)
        assert self.led.abort(t.id) == t
        assert self.led.grant(t.donor) == before + t.amount_bytes

    @precondition(lambda self: self.now % 4 == 0)  # rarer than the other rules
    @rule(data=st.data())
    def abort_unknown(self, data):
        self.attempt(self.led.abort, self.led.next_transfer_id + data.draw(st.integers(0, 3)))

    @rule(data=st.data())
    def grow(self, data):
        name = data.draw(self.names(), label="name")
        amount = data.draw(amounts(min(self.led.free_bytes, self.led.headroom_bytes(name))), label="amount")
        ok, grant = self.attempt(self.led.grow, name, amount)
        if ok:
            assert grant == self.led.grant(name)

    @rule(data=st.data())
    def release(self, data):
        name = data.draw(self.names(), label="name")
        amount = data.draw(amounts(self.led.grant(name) - self.led.quotas[name].min_bytes), label="amount")
        before = self.led.free_bytes
        ok, _ = self.attempt(self.led.release, name, amount)
        if ok:
            assert self.led.free_bytes == before + amount

    @rule(data=st.data())
    def reclaim_step(self, data):
        """Begin the first move of an owner's reclaim plan (left pending for later rules)."""
        owner = data.draw(self.names(), label="owner")
        plan = self.led.reclaim_plan(owner)
        need = self.led.quotas[owner].base_bytes - self.led.grant(owner) - self.led.incoming_bytes(owner)
        assert sum(a for _, a in plan) <= max(0, need)
        assert all(a > 0 for _, a in plan)
        if plan:
            borrower, amount = plan[0]
            self.now += 1
            if borrower == "":
                self.attempt(self.led.grow, owner, amount)
            else:
                self.attempt(self.led.begin_transfer, borrower, owner, amount, self.now, "reclaim")

    @rule(data=st.data())
    def reclaim_to_base(self, data):
        """On a copy: settle everything, run the plan; the owner reaches base."""
        led = self.led.copy()
        self.now += 1
        settle(led, data, self.now)
        owner = data.draw(self.names(), label="owner")
        base = led.quotas[owner].base_bytes
        was = led.grant(owner)
        execute_plan(led, owner, self.now)
        assert led.grant(owner) == max(was, base)
        assert_invariants(led)

    @rule(fleet=fleets(), data=st.data())
    def reconfigure(self, fleet, data):
        usable, quotas = fleet
        before = self.led.to_dict()
        new = self.led.reconfigure(usable, quotas)
        assert self.led.to_dict() == before
        assert new.pending == () and set(new.grants) == set(quotas)
        assert_invariants(new)
        if data.draw(st.booleans(), label="adopt"):
            self.led = new

    @invariant()
    def holds(self):
        assert_invariants(self.led)
        d = self.led.to_dict()
        assert QuotaLedger.from_dict(json.loads(json.dumps(d))).to_dict() == d


LedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerMachine = LedgerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(fleet=fleets(), data=st.data())
def test_random_sequence_then_every_owner_reaches_base(fleet, data):
    usable, quotas = fleet
    led = QuotaLedger(usable, quotas)
    names = sorted(quotas)
    ops = data.draw(st.lists(st.sampled_from(["begin", "confirm", "abort", "grow", "release"]), max_size=30))
    for now, op in enumerate(ops, start=1):
        before = led.to_dict()
        try:
            name = data.draw(st.sampled_from(names))
            if op == "begin":
                recipient = data.draw(st.sampled_from(names))
                room = min(led.grant(name) - quotas[name].min_bytes, led.headroom_bytes(recipient))
                led.begin_transfer(name, recipient, data.draw(amounts(room)), now)
            elif op == "confirm":
                led.confirm(name, max(0, led.grant(name) + data.draw(st.integers(-1, 1))), now)
            elif op == "abort" and led.pending:
                led.abort(data.draw(st.sampled_from(led.pending)).id)
            elif op == "grow":
                led.grow(name, data.draw(amounts(min(led.free_bytes, led.headroom_bytes(name)))))
            elif op == "release":
                led.release(name, data.draw(amounts(led.grant(name) - quotas[name].min_bytes)))
        except LedgerError:
            assert led.to_dict() == before
        assert_invariants(led)
    settle(led, data, len(ops) + 1)
    for owner in names:
        trial = led.copy()
        execute_plan(trial, owner, len(ops) + 2)
        assert trial.grant(owner) >= quotas[owner].base_bytes
        assert_invariants(trial)


@settings(max_examples=200, deadline=None)
@given(old=fleets(), new=fleets(), data=st.data())
def test_reconfigure_random(old, new, data):
    led = QuotaLedger(*old)
    for name in sorted(led.quotas):  # push some grants away from base
        q = led.quotas[name]
        target = data.draw(st.integers(q.min_bytes, q.max_bytes))
        if target < led.grant(name):
            led.release(name, led.grant(name) - target)
        elif target > led.grant(name) and target - led.grant(name) <= led.free_bytes:
            led.grow(name, target - led.grant(name))
    before = led.to_dict()
    usable, quotas = new
    assume(usable >= 0)
    out = led.reconfigure(usable, quotas)
    assert led.to_dict() == before
    assert_invariants(out)
    for name, q in quotas.items():
        kept = led.grants.get(name, q.base_bytes)
        clamped = min(q.max_bytes, max(q.min_bytes, kept))
        # only loans shrink, and never under base
        assert out.grant(name) == clamped or q.base_bytes <= out.grant(name) < clamped
