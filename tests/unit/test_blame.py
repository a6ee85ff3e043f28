"""Blame goes to the violator (issue 37): a card-level memory emergency while one model reports
more than its grant + slack pauses that model only; its neighbour within its grant keeps serving
(no emergency rule, admission open). With no model over its grant, the emergency is as before."""

from __future__ import annotations

from tests.unit.policy_builders import Driver, GiB, MiB, gpu, load, make_config

BUSY = {"queue_depth": 20, "arrival_rate_rps": 50}


def test_the_model_over_its_grant_is_paused_and_its_neighbour_keeps_serving():
    d = Driver(make_config(models={"a": {"batch": {"initial": 16}}, "b": {"batch": {"initial": 16}}}))
    grant_a = d.state.ledger.grant("a")
    loads = {
        "a": load(
            "a", mem_used_bytes=grant_a + 2 * GiB, **BUSY
        ),  # over its grant by 2 GiB (a model that lifted its limit)
        "b": load("b", mem_used_bytes=1 * GiB, **BUSY),  # within its 3 GiB
    }
    for _ in range(5):  # longer than the bounded pause (3 intervals): the violator stays paused
        dec = d.step(loads, gpu_load=gpu(free_frac=0.01))
        a, b = dec.models["a"], dec.models["b"]
        assert a.admit is False and a.rule == "emergency" and "over its grant + slack" in a.reason, a.reason
        assert b.admit is True and b.rule != "emergency", b.reason
    assert d.cap("b") >= 16  # not halved either


def test_a_model_over_its_grant_by_less_than_the_slack_is_not_blamed():
    d = Driver(make_config(models={"a": {"batch": {"initial": 16}}, "b": {"batch": {"initial": 16}}}))
    grant_a = d.state.ledger.grant("a")
    loads = {"a": load("a", mem_used_bytes=grant_a + 32 * MiB, **BUSY), "b": load("b", mem_used_bytes=GiB, **BUSY)}
    dec = d.step(loads, gpu_load=gpu(free_frac=0.01))
    assert dec.models["a"].admit is False and dec.models["b"].admit is False  # nobody over grant + slack: as before


def test_without_a_violator_the_emergency_pauses_as_before():
    d = Driver(make_config(models={"a": {"batch": {"initial": 16}}, "b": {"batch": {"initial": 16}}}))
    loads = {"a": load("a", mem_used_bytes=64 * MiB, **BUSY), "b": load("b", mem_used_bytes=64 * MiB, **BUSY)}
    dec = d.step(loads, gpu_load=gpu(free_frac=0.01))
    assert all(m.admit is False and m.rule == "emergency" for m in dec.models.values())
    assert d.cap("a") == 8 and d.cap("b") == 8
