"""The idle models' cache (``broker.control.idle_memo``) changes no answer: the same ticks with it and
without it give the same tick results, settings replies, decision log and status, on one card
and on several, with either batch formation, and the simulator's results are the same too."""

from __future__ import annotations

import json

import pytest

from bench.scale import _Cores, synthetic_config, synthetic_doc
from broker.control.idle_memo import IdleMemo
from gpubroker.sim.engine import run_sim


def _run(doc: dict, seconds: float) -> tuple[list[str], int]:
    cores = _Cores(doc, seed=3)
    out: list[str] = []
    report, tick = cores.broker.report, cores.broker.tick

    def reporting(r):
        reply = report(r)
        out.append(json.dumps(reply, sort_keys=True, default=str))
        return reply

    def ticking():
        res = tick()
        out.append(json.dumps(res, sort_keys=True, default=str))
        status = cores.broker.status()
        for view in [status, *status.get("cards", [])]:
            view.pop("last_tick_ms", None)
        out.append(json.dumps(status, sort_keys=True, default=str))
        return res

    cores.broker.report, cores.broker.tick = reporting, ticking
    cores.run(seconds)
    out.append(json.dumps(cores.broker.decisions(), sort_keys=True, default=str))
    core_list = list(getattr(cores.broker, "cores", {}).values()) or [cores.broker]
    return out, sum(c._memo.hits for c in core_list)


@pytest.mark.parametrize("cards,formation", [(1, "lazy"), (4, "eager"), (4, "lazy")])
def test_ticks_are_the_same_with_and_without_the_memo(cards, formation, monkeypatch):
    doc = synthetic_doc(24, cards=cards)
    doc["broker"]["batch_formation"] = formation
    with_memo, hits = _run(doc, 100.0)
    monkeypatch.setattr(IdleMemo, "get", lambda *args, **kwargs: None)  # every step decided in full
    without, none = _run(doc, 100.0)
    assert none == 0 and hits > 100  # the cache did answer, and often
    assert len(with_memo) == len(without)
    for i, (a, b) in enumerate(zip(with_memo, without)):
        assert a == b, f"output {i} differs"


def test_the_simulator_gives_the_same_results_with_and_without_the_memo(monkeypatch):
    cfg = synthetic_config(12)
    rates = {name: (4.0 if i % 3 == 0 else 0.05) for i, name in enumerate(cfg.models)}  # a few busy, most idle

    def result():
        res = run_sim(cfg, "broker", rates, 240.0, arrivals="trace", seed=2)
        return json.dumps({n: vars(m) for n, m in res.models.items()}, sort_keys=True, default=str)

    hits = []
    real_get = IdleMemo.get

    def counting(self, *args):
        got = real_get(self, *args)
        hits.append(got is not None)
        return got

    monkeypatch.setattr(IdleMemo, "get", counting)
    cached = result()
    monkeypatch.setattr(IdleMemo, "get", lambda *args, **kwargs: None)
    assert cached == result()
    assert sum(hits) > 100
