"""Re-placement after a card loss or join in ``FleetBroker`` (``gpubroker.broker.control.replacement``), on a fake clock.

Two nodes x two cards. ``spread`` has a replica on a0 and on b0, ``solo`` is on a0, ``west`` may
only run on node-b's cards (b0). When b0 falls silent with re-placement on (b1, empty, is taken as gone with its node): spread's lost replica
goes to a1 (a new card for it, a new core there), west fits nowhere and is reported unplaced with
its reason, a0's core is untouched, Σ base per card stays within usable. When node-b's cards are
seen again, west is placed back on b0 and nothing else moves.
"""

from __future__ import annotations

from gpubroker.broker.control.replacement import replace_fleet
from gpubroker.broker.fleet_core import DEAD_AFTER_S, FleetBroker
from gpubroker.broker.wire import ModelSettings, StatsReport
from gpubroker.quotas.config import parse_config_text

MIB = 1024**2

CONFIG = """
broker: {name: fr, namespace: fr, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}
gpu: {reserve_frac: 0.0}
gpus:
  - {id: a0, node: node-a, index: 0, capacity: 512MiB, device: cpu}
  - {id: a1, node: node-a, index: 1, capacity: 512MiB, device: cpu}
  - {id: b0, node: node-b, index: 0, capacity: 512MiB, device: cpu}
  - {id: b1, node: node-b, index: 1, capacity: 512MiB, device: cpu}
models:
  spread:
    model: profiled
    quota: {min: 64MiB, base: 128MiB, max: 256MiB}
    slo_p95_ms: 1500
    replicas: 2
  solo:
    model: profiled
    quota: {min: 32MiB, base: 96MiB, max: 160MiB}
    slo_p95_ms: 1500
  west:
    model: profiled
    quota: {min: 64MiB, base: 160MiB, max: 200MiB}
    slo_p95_ms: 1500
    placement: {cards: [b0, b1]}
"""
CAL = {"weights_bytes": 16 * MIB, "bytes_per_unit": MIB, "cost_unit": "requests"}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _report(fb: FleetBroker, clock: Clock, model: str, card: str, seq: int) -> ModelSettings:
    return fb.report(
        StatsReport(
            model=model,
            replica_id=f"{model}@{card}",
            seq=seq,
            now_s=clock.t,
            interval_s=0.5,
            mem_used_bytes=20 * MIB,
            mem_peak_bytes=20 * MIB,
            card_id=card,
        )
    )


def _fleet(replacing: bool = True):
    clock = Clock()
    fb = FleetBroker(CONFIG, clock=clock)
    if replacing:
        fb.enable_replacement()
    for model, cards in fb.placement.replicas.items():
        for cid in set(cards):
            fb.register(model, f"{model}@{cid}", CAL, cid)
    return clock, fb


def _run(fb: FleetBroker, clock: Clock, seconds: int, silent: frozenset[str]) -> None:
    for i in range(seconds):
        clock.t += 1.0
        for model, cards in fb.placement.replicas.items():
            for cid in set(cards):
                if cid not in silent and cid in fb.cores:
                    _report(fb, clock, model, cid, i)
        fb.tick()
        _within_usable(fb)


def _within_usable(fb: FleetBroker) -> None:
    for card in fb.status()["cards"]:
        assert card["granted_bytes"] <= card["usable_bytes"], card
    for plan in fb.placement.cards:
        assert plan.base_bytes <= plan.usable_bytes, plan.to_dict()


def test_deploy_time_placement_is_as_the_module_note_says():
    _, fb = _fleet()
    assert fb.placement.replicas == {"solo": ("a0",), "spread": ("a0", "b0"), "west": ("b0",)}
    assert set(fb.cores) == {"a0", "b0"} and fb.placement_version == 0


def test_a_lost_card_s_replicas_are_re_placed_and_what_fits_nowhere_is_reported():
    clock, fb = _fleet()
    a0 = fb.cores["a0"]
    _run(fb, clock, int(DEAD_AFTER_S) + 3, silent=frozenset({"b0"}))
    assert fb.lost == {"b0", "b1"} and fb.placement_version == 1  # b1, empty, is taken as gone with its node
    assert fb.placement.replicas["spread"] == ("a0", "a1")  # a new card for it on the live node
    assert fb.placement.replicas["west"] == () and fb.placement.unplaced == {"west": 1}
    assert fb.cores["a0"] is a0  # a0's models did not change: its core (and ledger) stays
    assert set(fb.cores) == {"a0", "a1"}
    assert fb.cores["a1"].config.models.keys() == {"spread"}
    st = fb.status()
    assert st["unplaced"]["west"]["replicas"] == 1
    assert "no live card matches its placement" in st["unplaced"]["west"]["reason"]
    assert {c["id"]: c["live"] for c in st["cards"]} == {"a0": True, "a1": True, "b0": False, "b1": False}
    placed = [d for d in fb.decisions() if d["kind"] == "placement"]
    assert {d["model"] for d in placed} == {"spread", "west"}
    west = next(d for d in placed if d["model"] == "west")
    assert west["unplaced"] == 1 and "b0" in west["reason"] and "west" in west["reason"]
    # the moved replica registers on its new card's core with its base
    settings = fb.register("spread", "spread@a1-new", CAL, "a1")
    assert settings.grant_bytes == 128 * MIB
    _run(fb, clock, 3, silent=frozenset({"b0"}))
    a1 = next(c for c in fb.status()["cards"] if c["id"] == "a1")
    assert a1["models"]["spread"]["grant_bytes"] == 128 * MIB and a1["granted_bytes"] <= a1["usable_bytes"]


def test_without_replacement_a_loss_only_freezes_the_card():
    clock, fb = _fleet(replacing=False)
    _run(fb, clock, int(DEAD_AFTER_S) + 3, silent=frozenset({"b0"}))
    assert "b0" in fb.lost and fb.placement_version == 0
    assert fb.placement.replicas["west"] == ("b0",) and "b0" in fb.cores


def test_a_node_that_joins_takes_the_unplaced_replicas_and_nothing_else_moves():
    clock, fb = _fleet()
    fb.observe_cards({"a0", "a1", "b0", "b1"})
    assert fb.observe_cards({"a0", "a1"})  # node-b left the cluster: lost at once, re-placed
    assert fb.lost == {"b0", "b1"} and fb.placement.unplaced == {"west": 1}
    version = fb.placement_version
    assert fb.observe_cards({"a0", "a1", "b0", "b1"})  # it joins again
    assert fb.placement_version == version + 1 and not fb.lost
    assert fb.placement.replicas == {"solo": ("a0",), "spread": ("a0", "a1"), "west": ("b0",)}
    assert not fb.placement.unplaced and fb.status()["unplaced"] == {}
    assert set(fb.cores) == {"a0", "a1", "b0"}
    assert not fb.observe_cards({"a0", "a1", "b0", "b1"})  # nothing new: no re-placement


def test_a_replica_that_joins_its_own_group_rebuilds_that_card_with_its_calibration():
    text = CONFIG.replace(
        "{id: a1, node: node-a, index: 1, capacity: 512MiB", "{id: a1, node: node-a, index: 1, capacity: 96MiB"
    )
    clock, fb = _fleet()
    cfg = parse_config_text(text)
    rep = replace_fleet(FleetBroker(text, clock=clock).placement, cfg, {"b0", "b1"})
    # a1 (96MiB) cannot hold spread's base: its lost replica joins its group on a0
    assert rep.placement.replicas["spread"] == ("a0", "a0") and "a0" in rep.cards_changed
    assert rep.models_changed == ("spread", "west")
    fb2 = FleetBroker(text, clock=clock)
    fb2.enable_replacement()
    fb2.register("solo", "solo-1", CAL, "a0")
    fb2.observe_cards({"a0", "a1", "b0", "b1"})
    fb2.observe_cards({"a0", "a1"})
    core = fb2.cores["a0"]
    assert core.config.models["spread"].replicas == 2  # the card config counts both replicas
    assert core.status()["models"]["solo"]["calibrated"]  # replayed on the rebuilt core
    for plan in fb2.placement.cards:
        assert plan.base_bytes <= plan.usable_bytes


def test_a_restarted_broker_runs_the_placement_it_had_re_placed_to(tmp_path):
    path = tmp_path / "fr.checkpoint.json"
    fb = FleetBroker(CONFIG, clock=Clock(), checkpoint_path=path)
    fb.enable_replacement()
    fb.observe_cards({"a0", "a1", "b0", "b1"})
    fb.observe_cards({"a0", "a1"})
    again = FleetBroker(CONFIG, clock=Clock(), checkpoint_path=path)  # what Ray's restart of the actor does
    assert again.placement.replicas == fb.placement.replicas and again.placement.unplaced == {"west": 1}
    assert again.lost == {"b0", "b1"} and again.placement_version == fb.placement_version == 1
    assert set(again.cores) == {"a0", "a1"}
    other = CONFIG.replace("slo_p95_ms: 1500", "slo_p95_ms: 1400")  # another launch config: placed afresh
    fresh = FleetBroker(other, clock=Clock(), checkpoint_path=path)
    assert fresh.placement.replicas["west"] == ("b0",) and fresh.placement_version == 0


def test_card_health_says_silent_before_lost():
    """A card whose replicas stopped reporting is silent after five report intervals (at least
    2 s) and lost after DEAD_AFTER_S; a card that reports is neither; a card never reported on
    (a1, empty) is not silent."""
    clock, fb = _fleet(replacing=False)
    _run(fb, clock, 2, silent=frozenset())
    assert fb.card_health() == {"lost": [], "silent": []}
    _run(fb, clock, 3, silent=frozenset({"b0"}))  # report_interval_s 0.5: silent after 2.5 s
    assert fb.card_health() == {"lost": [], "silent": ["b0"]}
    _run(fb, clock, int(DEAD_AFTER_S), silent=frozenset({"b0"}))
    assert fb.card_health() == {"lost": ["b0", "b1"], "silent": []}
    _run(fb, clock, 1, silent=frozenset())  # b0 reports again: live, not silent
    assert fb.card_health() == {"lost": ["b1"], "silent": []}
