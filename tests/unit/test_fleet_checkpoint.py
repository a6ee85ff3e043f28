"""A many-card fleet's checkpoint (``gpubroker.broker.checkpoint.CardCheckpoints``, ``DecisionJournal``):
every card's state in one file written once a tick, the shared decision log journaled once.

No Ray: the two-card fleet of ``tests/unit/test_fleet_core.py`` on a fake clock. A restart is a
new ``FleetBroker`` on the same checkpoint path, as Ray's restart of the actor is.
"""

from __future__ import annotations

import json

from gpubroker.broker import checkpoint as ckpt_mod
from gpubroker.broker.checkpoint import Checkpoint, DecisionJournal, save_checkpoint
from gpubroker.broker.fleet_core import FleetBroker
from tests.unit.test_fleet_core import CAL, CONFIG, MIB, Clock, _report


def _fleet(path, clock):
    fb = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    running, seq = {}, {}
    for model, cards in fb.placement.replicas.items():
        for cid in set(cards):
            w, per = CAL[model]
            cal = {"weights_bytes": w, "bytes_per_unit": per, "cost_unit": "requests"}
            running[(model, cid)] = fb.register(model, f"{model}@{cid}", cal, cid).to_dict()
            seq[(model, cid)] = 0
    return fb, running, seq


def _burst(fb, running, seq, clock, ticks):
    for _ in range(ticks):
        clock.t += 0.5
        _report(fb, running, seq, clock, busy={("hot", "a0")})
        clock.t += 0.5
        fb.tick()


def test_one_write_a_tick_holds_every_card_and_a_restart_resumes_each(tmp_path, monkeypatch):
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)
    writes: list[str] = []
    real = ckpt_mod._write_text_atomic

    def counting(target, blob):
        writes.append(target.name)
        real(target, blob)

    monkeypatch.setattr(ckpt_mod, "_write_text_atomic", counting)
    _burst(fb, running, seq, clock, 20)
    assert writes.count("fc.checkpoint.cards.json") == 20  # one write a tick for both cards
    assert not [w for w in writes if w.endswith((".a0.json", ".b0.json"))]  # no file per card
    saved = json.loads((tmp_path / "fc.checkpoint.cards.json").read_text())["cards"]
    assert set(saved) == {"a0", "b0"}
    assert all(card["decisions"] == [] for card in saved.values())  # the log is the journal's
    lent = fb.cores["a0"].status()["models"]["hot"]["grant_bytes"]
    assert lent > 128 * MIB  # the burst borrowed on a0, so there is a ledger worth resuming

    again = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    for cid in ("a0", "b0"):
        assert again.cores[cid].restored
        assert again.cores[cid]._state.ledger.to_dict() == saved[cid]["policy_state"]["ledger"]  # noqa: SLF001
    assert again.cores["a0"].status()["models"]["hot"]["grant_bytes"] == lent


def test_the_shared_log_is_journaled_once_and_restored_without_duplicates(tmp_path):
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)
    _burst(fb, running, seq, clock, 12)
    journal = tmp_path / "fc.checkpoint.decisions.jsonl"
    lines = journal.read_text().splitlines()
    assert json.loads(lines[0])["launch_hash"] == fb.config_hash
    journaled = [json.loads(line)["seq"] for line in lines[1:]]
    assert journaled == [e["seq"] for e in fb.log.entries]  # each entry once, in order
    before = fb.decisions()

    again = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    after = again.decisions()
    assert after[: len(before)] == before  # the old entries, then the restart's own
    assert len({e["seq"] for e in after}) == len(after)
    assert again.log.seq > fb.log.seq


def test_a_journal_appends_only_the_new_entries_and_compacts_at_four_times_its_keep(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = DecisionJournal(path, "h1", keep=3)
    log = [{"seq": i, "kind": "note"} for i in range(1, 30)]
    journal.append(log[:2], log[:2])  # no file yet: header + what the tail keeps
    assert len(path.read_text().splitlines()) == 3
    for i in range(2, 12):
        journal.append(log[i : i + 1], log[: i + 1])
    rows = path.read_text().splitlines()[1:]
    assert [json.loads(r)["seq"] for r in rows] == list(range(1, 13))  # 12 = 4 x keep: appended
    journal.append(log[12:13], log[:13])  # the 13th: rewritten to the newest 3
    assert [json.loads(r)["seq"] for r in path.read_text().splitlines()[1:]] == [11, 12, 13]
    entries, last = DecisionJournal(path, "h1", keep=3).load()
    assert [e["seq"] for e in entries] == [11, 12, 13] and last == 13
    assert DecisionJournal(path, "another config", keep=3).load() == ([], 0)


def test_a_torn_last_line_is_skipped_and_the_next_append_rewrites(tmp_path):
    path = tmp_path / "j.jsonl"
    first = DecisionJournal(path, "h1", keep=10)
    first.append([{"seq": 1}, {"seq": 2}], [{"seq": 1}, {"seq": 2}])
    with path.open("a") as fh:
        fh.write('{"seq": 3, "kind": "no')  # killed mid-append
    journal = DecisionJournal(path, "h1", keep=10)
    entries, last = journal.load()
    assert [e["seq"] for e in entries] == [1, 2] and last == 2
    journal.append([{"seq": 3}], [{"seq": 1}, {"seq": 2}, {"seq": 3}])
    rows = [json.loads(r) for r in path.read_text().splitlines()[1:]]  # every line parses again
    assert [r["seq"] for r in rows] == [1, 2, 3]


def test_an_unreadable_journal_is_reported_and_a_new_one_started(tmp_path):
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    (tmp_path / "fc.checkpoint.decisions.jsonl").write_text("not json\n")
    fb, running, seq = _fleet(path, clock)
    assert any("unreadable" in e["reason"] and "new decision journal" in e["reason"] for e in fb.decisions())
    _burst(fb, running, seq, clock, 2)
    head = json.loads((tmp_path / "fc.checkpoint.decisions.jsonl").read_text().splitlines()[0])
    assert head["launch_hash"] == fb.config_hash


def test_a_card_the_fleet_file_lacks_resumes_from_its_own_older_file(tmp_path):
    """A broker before the one-file checkpoint wrote one file per card: an upgrade resumes them."""
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)
    _burst(fb, running, seq, clock, 15)
    saved = json.loads((tmp_path / "fc.checkpoint.cards.json").read_text())["cards"]
    (tmp_path / "fc.checkpoint.cards.json").unlink()
    for cid, data in saved.items():
        save_checkpoint(tmp_path / f"fc.checkpoint.{cid}.json", Checkpoint.from_dict(data))
    again = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    assert all(again.cores[cid].restored for cid in ("a0", "b0"))
    assert again.cores["a0"]._state.ledger.to_dict() == saved["a0"]["policy_state"]["ledger"]  # noqa: SLF001


def test_a_fleet_killed_mid_write_keeps_the_last_whole_file_and_resumes_from_it(tmp_path, monkeypatch):
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)
    _burst(fb, running, seq, clock, 10)
    cards_file = tmp_path / "fc.checkpoint.cards.json"
    good = cards_file.read_text()
    real_replace = ckpt_mod.os.replace

    def die(src, dst):  # the process dies between writing the temp file and the rename
        raise KeyboardInterrupt("killed mid-checkpoint")

    monkeypatch.setattr(ckpt_mod.os, "replace", die)
    try:
        _burst(fb, running, seq, clock, 1)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the tick's write was not attempted")
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    assert cards_file.read_text() == good
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "temp file left behind"
    saved = json.loads(good)["cards"]
    again = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    for cid in ("a0", "b0"):
        assert again.cores[cid].restored
        assert again.cores[cid]._state.ledger.to_dict() == saved[cid]["policy_state"]["ledger"]  # noqa: SLF001


def test_an_unreadable_cards_file_starts_every_card_fresh_and_is_replaced(tmp_path):
    """Not one card from the broken file and another from an older file of its own: all fresh."""
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)
    _burst(fb, running, seq, clock, 5)
    saved = json.loads((tmp_path / "fc.checkpoint.cards.json").read_text())["cards"]
    save_checkpoint(tmp_path / "fc.checkpoint.b0.json", Checkpoint.from_dict(saved["b0"]))  # an older broker's
    (tmp_path / "fc.checkpoint.cards.json").write_text('{"format_version": 1, "cards": {"a0": ')  # torn
    again = FleetBroker(CONFIG, clock=clock, checkpoint_path=path)
    assert not any(core.restored for core in again.cores.values())
    assert sum("unreadable" in e["reason"] for e in again.decisions() if e["kind"] == "restore") == 2
    assert set(json.loads((tmp_path / "fc.checkpoint.cards.json").read_text())["cards"]) == {"a0", "b0"}


def test_the_fleet_write_after_each_tick_is_a_metric(tmp_path):
    """Cards' ticks no longer contain the checkpoint write; the fleet times it once a tick."""
    path, clock = tmp_path / "fc.checkpoint.json", Clock()
    fb, running, seq = _fleet(path, clock)  # metrics=None: BrokerMetrics on a private registry
    _burst(fb, running, seq, clock, 6)
    count = fb.metrics.registry.get_sample_value("gpubroker_checkpoint_write_seconds_count")
    total = fb.metrics.registry.get_sample_value("gpubroker_checkpoint_write_seconds_sum")
    assert count == 6 and total > 0.0
