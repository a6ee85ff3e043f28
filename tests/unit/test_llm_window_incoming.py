"""``LlmControl.step`` hands each engine's rules the grant in flight to it (pure: engine reports as
dicts, no engine; the broker core passes its ledger's ``incoming_bytes`` per model)."""

from __future__ import annotations

from pathlib import Path

from gpubroker.broker.control.llm_rules import LlmRule
from gpubroker.broker.control.llm_window import LlmControl
from gpubroker.quotas.config import parse_config_text

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"
MiB = 1024**2
BLOCK = 256 * 1024  # the tiny Llama's 128-token block


def _report(**over) -> dict:
    r = {
        "kv_block_bytes": BLOCK,
        "kv_block_tokens": 128,
        "seq_tokens": 128,
        "max_model_len": 512,
        "max_num_seqs_max": 32,
        "max_batched_tokens_max": 1024,
        "kv_cache_blocks_min": 5,
        "kv_cache_blocks_max": 32,
        "weights_bytes": 2 * MiB,
        "running": 8,
        "waiting": 12,
        "kv_blocks_total": 8,
        "kv_blocks_reserved": 8,
        "idle_for_s": 0.0,
    }
    r.update(over)
    return r


def _decide(incoming: dict[str, int]) -> tuple[str, int, str]:
    ctl = LlmControl(parse_config_text(CONFIG.read_text(encoding="utf-8"), "t"))
    ctl.window.add("chat", "chat-1", _report(), 100.0)
    ctl.step(100.0, 0.5, {"chat": 9 * MiB // 2, "code": 12 * MiB})  # start: the 8 blocks 4.5 MiB holds
    ctl.window.add("chat", "chat-1", _report(), 105.0)
    entries = ctl.step(105.0, 0.5, {"chat": 6 * MiB, "code": 12 * MiB}, incoming=incoming)
    entry = entries[-1][0]
    return entry["rule"], entry["new"]["kv_blocks"], entry["reason"]


def test_an_engine_with_grant_in_flight_keeps_its_cache_until_it_lands():
    rule, blocks, reason = _decide({"chat": 4 * MiB, "code": 0})
    assert rule == LlmRule.BUSY_GROW and blocks == 8 and "then 30" in reason  # 14 now, 30 once it lands


def test_without_grant_in_flight_the_same_engine_grows_to_its_grant():
    rule, blocks, _ = _decide({})
    assert rule == LlmRule.BUSY_GROW and blocks == (6 * MiB - 2 * MiB) // BLOCK - 2 == 14
