"""The LLM kind's ``bounds`` hands an engine's rules the grant in flight to it (pure: engine reports
as dicts, no engine; the ledger's ``incoming_bytes`` of the model, after the tick's quota plan)."""

from __future__ import annotations

from pathlib import Path

from gpubroker.broker.control.kind_llm import LlmKind
from gpubroker.broker.control.llm_rules import EngineRecord, LlmRule
from gpubroker.broker.control.model_step import TickView
from gpubroker.broker.control.policy import initial_state, quotas_of
from gpubroker.broker.control.types import EngineView, FleetSnapshot, GpuLoad
from gpubroker.broker.wire import EngineReport
from gpubroker.quotas.config import parse_config_text
from gpubroker.quotas.ledger import QuotaLedger

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm-demo.yaml"
MiB = 1024**2
BLOCK = 256 * 1024  # the tiny Llama's 128-token block


def _report(**over) -> EngineReport:
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
    return EngineReport(**r)


def _bounds(engine: EngineRecord | None, now_s: float, chat_grant: int, incoming: int):
    """The kind's bounds for ``chat`` with ``chat_grant`` and ``incoming`` on its way (from code)."""
    cfg = parse_config_text(CONFIG.read_text(encoding="utf-8"), "t")
    usable = 48 * MiB
    ledger = QuotaLedger(usable, quotas_of(cfg), grants={"chat": chat_grant, "code": 12 * MiB + incoming})
    if incoming:
        ledger.begin_transfer("code", "chat", incoming, now_s, "lend")
    snap = FleetSnapshot(now_s, GpuLoad(64 * MiB, usable, 0, 0.5), engines={"chat": EngineView(_report(), 1)})
    view = TickView.of(snap, cfg, initial_state(cfg, usable))
    return LlmKind(engine).bounds(view, "chat", cfg.models["chat"], ledger)


def _decide(incoming: dict[str, int]) -> tuple[str, int, str]:
    first, _, _ = _bounds(None, 100.0, 9 * MiB // 2, 0)  # start: the 8 blocks 4.5 MiB holds
    _, _, logged = _bounds(first, 105.0, 6 * MiB, incoming.get("chat", 0))
    assert logged is not None
    entry = logged[0]
    return entry["rule"], entry["new"]["kv_blocks"], entry["reason"]


def test_an_engine_with_grant_in_flight_keeps_its_cache_until_it_lands():
    rule, blocks, reason = _decide({"chat": 4 * MiB, "code": 0})
    assert rule == LlmRule.BUSY_GROW and blocks == 8 and "then 30" in reason  # 14 now, 30 once it lands


def test_without_grant_in_flight_the_same_engine_grows_to_its_grant():
    rule, blocks, _ = _decide({})
    assert rule == LlmRule.BUSY_GROW and blocks == (6 * MiB - 2 * MiB) // BLOCK - 2 == 14
