"""An engine's rule state lives in the policy state and survives a restart; a checkpoint written
while it had its own ``llm_state`` section restores the same way."""

from __future__ import annotations

import json
from pathlib import Path

from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import StatsReport
from tests.unit.test_llm_window_incoming import _report

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"


def _core_after_a_tick(ckpt: Path) -> BrokerCore:
    now = [1000.0]
    core = BrokerCore(CONFIG.read_text(encoding="utf-8"), clock=lambda: now[0], checkpoint=ckpt)
    core.report(StatsReport(model="chat", replica_id="chat-1", seq=1, now_s=now[0], interval_s=0.5, engine=_report()))
    now[0] += 1
    core.tick()
    return core


def _old_format(path: Path) -> None:
    """Rewrite a checkpoint as one with the engines in their own section (states, decisions, last_rule)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    engines = doc["policy_state"].pop("engines")
    doc["llm_state"] = {
        "states": {n: e["state"] for n, e in engines.items()},
        "decisions": {n: e["decision"] for n, e in engines.items()},
        "last_rule": {n: e["last_rule"] for n, e in engines.items()},
    }
    path.write_text(json.dumps(doc), encoding="utf-8")


def test_an_engines_bounds_survive_a_restart_in_either_checkpoint_format(tmp_path):
    ckpt = tmp_path / "broker.json"
    bounds = _core_after_a_tick(ckpt).settings("chat").engine
    assert bounds is not None
    for rewrite in (lambda p: None, _old_format):
        rewrite(ckpt)
        restarted = BrokerCore(CONFIG.read_text(encoding="utf-8"), clock=lambda: 1001.0, checkpoint=ckpt)
        assert restarted.restored
        assert restarted.settings("chat").engine == bounds
        # the rule state itself (the settings table alone comes back from its own section)
        assert restarted.status()["models"]["chat"]["engine"]["max_num_seqs"] == bounds.max_num_seqs
