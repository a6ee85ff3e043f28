"""bench/output_hashes.py: the same run hashes the same; a different answer hashes differently."""

from __future__ import annotations

from bench import output_hashes


def test_the_same_run_gives_the_same_hashes_and_another_seed_others():
    first = output_hashes.scale_hashes(2, 6, 20.0)
    assert output_hashes.scale_hashes(2, 6, 20.0) == first
    other = output_hashes.scale_hashes(2, 6, 20.0, seed=4)  # other reports: other replies and log
    assert other[0] != first[0] and other[1] != first[1]


def test_the_simulator_hash_leaves_out_the_wall_time():
    assert output_hashes.sim_hash(models=4, seconds=20.0) == output_hashes.sim_hash(models=4, seconds=20.0)


def test_the_llm_run_lends_grows_reclaims_and_hands_over_and_hashes_the_same_twice():
    """The LLM-path hash covers the engine carve-outs of the lending steps: an idle engine lends,
    a busy one grows from the pool, an owner reclaims from a borrower, a borrower hands over."""
    broker, _ = output_hashes.llm_run()
    reasons = [(e["move"], e["reason"]) for e in broker.decisions() if e["kind"] == "move"]
    kinds = {m for m, _ in reasons}
    assert {"lend", "grow", "reclaim", "release", "confirm"} <= kinds
    assert any(m == "lend" and "hands over" in why for m, why in reasons)
    assert any(m == "lend" and "idle" in why for m, why in reasons)
    assert any(m == "reclaim" and "load back" in why for m, why in reasons)
    assert any(e["kind"] == "engine" for e in broker.decisions())
    assert output_hashes.llm_hashes() == output_hashes.llm_hashes()
