"""QuotaLedger releases (begin_release) and QuotaLedger.reconfigure(now_s): memory goes back to the pool
only once measured, and a new config lowers before anything rises."""

from __future__ import annotations

import json

import pytest

from gpubroker.quotas.holding import held_bytes, holding_problems, measured_free_bytes
from gpubroker.quotas.ledger import LedgerError, ModelQuota, QuotaLedger
from tests.unit.test_ledger import MiB, make, refused


def test_release_is_in_flight_until_confirmed():
    led = make({"a": 4 * MiB})
    free = led.free_bytes
    t = led.begin_release("a", 2 * MiB, 5.0)
    assert (t.kind, t.recipient, t.amount_bytes) == ("release", "", 2 * MiB)
    assert led.grant("a") == 2 * MiB and led.free_bytes == free  # not free yet
    assert led.outgoing_bytes("a") == 2 * MiB and led.in_flight_bytes == 2 * MiB
    led.check()
    assert led.confirm("a", 3 * MiB, 6.0) == ()  # still holds more than its grant
    assert led.confirm("a", 1 * MiB, 4.0) == ()  # measured before the release began
    assert led.confirm("a", 1 * MiB, 6.0) == (t,)
    assert led.free_bytes == free + 2 * MiB and led.grant("a") == 2 * MiB
    assert all(g == led.grant(n) for n, g in led.grants.items())


def test_release_refusals_name_model_and_fix():
    led = make()
    err = refused(led, lambda: led.begin_release("a", 2 * MiB, 0.0), "a")
    assert "under its min" in str(err) and "move at most 1.0MiB" in str(err)
    refused(led, lambda: led.begin_release("a", 0, 0.0), "a")
    refused(led, lambda: led.begin_release("zz", 1, 0.0), "zz")
    with pytest.raises(LedgerError, match="begin_release"):
        led.begin_transfer("a", "b", 1, 0.0, kind="release")


def test_aborted_release_goes_back_and_checkpoint_round_trips():
    led = make({"a": 4 * MiB})
    t = led.begin_release("a", 1 * MiB, 1.0)
    d = json.loads(json.dumps(led.to_dict()))
    back = QuotaLedger.from_dict(d)
    assert back == led and back.pending == (t,)
    led.abort(t.id)
    assert led.grant("a") == 4 * MiB and not led.pending


def test_checkpoint_with_a_release_to_a_model_is_refused():
    d = make({"a": 4 * MiB}).to_dict()
    d["pending"] = [{"id": 1, "donor": "a", "recipient": "b", "amount_bytes": 1, "kind": "release", "started_s": 0.0}]
    d["next_id"] = 2
    with pytest.raises(LedgerError, match="releases go to the pool"):
        QuotaLedger.from_dict(d)


def test_reconfigure_with_now_lowers_first():
    led = make({"a": 5 * MiB, "b": 1 * MiB})  # a borrowed 3 MiB, b lent 1 MiB
    quotas = dict(led.quotas)
    quotas["a"] = ModelQuota(1 * MiB, 2 * MiB, 3 * MiB)  # a's max now under its grant
    out = led.reconfigure(led.usable_bytes, quotas, now_s=9.0)
    assert out.grant("a") == 3 * MiB and out.grant("b") == 1 * MiB
    assert [(t.donor, t.recipient, t.kind, t.amount_bytes, t.started_s) for t in out.pending] == [
        ("a", "", "release", 2 * MiB, 9.0)
    ]
    assert out.free_bytes == led.free_bytes  # the lowered 2 MiB is not free until a is measured
    one_step = led.reconfigure(led.usable_bytes, quotas)
    assert one_step.grant("a") == 3 * MiB and not one_step.pending
    assert out.next_transfer_id > led.next_transfer_id


def test_reconfigure_with_now_refuses_a_usable_under_what_is_held():
    led = make({"a": 5 * MiB, "b": 3 * MiB})  # 10 MiB usable, 10 MiB granted
    with pytest.raises(LedgerError, match="under what models may still hold"):
        led.reconfigure(8 * MiB, dict(led.quotas), now_s=1.0)
    assert led.reconfigure(8 * MiB, dict(led.quotas)).grant("a") < 5 * MiB  # one step still cuts loans


def test_holding_counts_in_flight_and_measured_use():
    led = make({"a": 4 * MiB})  # free 10 - 8 = 2 MiB
    led.begin_release("a", 2 * MiB, 0.0)
    assert held_bytes(led, {})["a"] == 4 * MiB
    assert measured_free_bytes(led, {}) == led.free_bytes == 2 * MiB
    assert measured_free_bytes(led, {"b": 3 * MiB}) == 1 * MiB  # b measured over its 2 MiB grant
    assert holding_problems(led, {"b": 3 * MiB}) == []
    problems = holding_problems(led, {"b": 5 * MiB})
    assert len(problems) == 1 and "over usable 10.0MiB by 1.0MiB" in problems[0] and "b 5.0MiB" in problems[0]
