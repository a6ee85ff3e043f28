"""kind: llm in the fleet config, engine options, and the OpenAI body parsing (no Serve)."""

from __future__ import annotations

import pytest

from gpubroker.quotas.config import ConfigError, load_config, parse_config_text


def fleet(model_lines: str) -> str:
    return (
        "gpu: {device: cpu, capacity: 1GiB}\nmodels:\n  m:\n"
        + "".join(f"    {line}\n" for line in model_lines.split(";"))
        + "    quota: {min: 64MiB, base: 128MiB, max: 256MiB}\n"
    )


def test_llm_demo_config_parses_with_its_objectives():
    cfg = load_config("configs/llm-demo.yaml")
    chat = cfg.models["chat"]
    assert chat.kind == "llm" and chat.model == "tiny-llama"
    assert (chat.llm.expected_peak_concurrency, chat.llm.ttft_slo_ms, chat.llm.tpot_slo_ms) == (16, 3000.0, 300.0)


@pytest.mark.parametrize(
    "lines, fragment",
    [
        ("kind: llm;model: mlp", "with kind: llm write model: tiny-llama"),
        ("model: tiny-llama", "add kind: llm"),
    ],
)
def test_kind_and_model_must_agree(lines, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config_text(fleet(lines))
    assert fragment in str(err.value)


def test_batch_models_default_to_kind_batch():
    assert parse_config_text(fleet("model: mlp")).models["m"].kind == "batch"


def test_engine_options_refuse_unknown_keys_naming_them():
    from gpubroker.deployments.llm.server import engine_options

    opts = engine_options({"model_dir": "/models/x", "kv_cache_blocks": 16, "kv_cache_blocks_max": 32})
    assert opts.model_dir == "/models/x" and opts.kv_cache_blocks == 16 and opts.device == "cpu"
    with pytest.raises(ValueError, match="kv_blocks"):
        engine_options({"model_dir": "/models/x", "kv_blocks": 3})
    with pytest.raises(ValueError, match="kv_cache_blocks=999"):
        engine_options({"model_dir": "/models/x", "kv_cache_blocks": 999})
    with pytest.raises(ValueError, match=r"\['num_layers'\] shape the built-in tiny model"):
        engine_options({"model_dir": "/models/x", "num_layers": 3})
    with pytest.raises(ValueError, match="kv_cache_blocks_min=2 must be in \\[5,"):
        engine_options({"model_dir": "/models/x", "max_model_len": 512, "kv_cache_blocks_min": 2})
    with pytest.raises(ValueError, match="in_process='yes' must be true, false or null"):
        engine_options({"model_dir": "/models/x", "in_process": "yes"})
    assert engine_options({"model_dir": "/models/x", "in_process": False}).in_process is False


def test_openai_bodies_fill_defaults_and_name_the_bad_field():
    pytest.importorskip("fastapi")
    from gpubroker.deployments.llm.openai_api import parse_body

    body, err = parse_body("completion", {"model": "m", "prompt": "hi"})
    assert err is None and body["max_tokens"] == 16 and body["stream"] is False
    body, err = parse_body(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5}
    )
    assert err is None and body["max_tokens"] == 5
    for raw, field in (
        ({"model": "m", "prompt": "hi", "n": 2}, "n"),
        ({"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ):
        _, err = parse_body("chat" if "messages" in raw else "completion", raw)
        assert err is not None and err.status_code == 400
        import json

        assert json.loads(err.body)["error"]["param"] == field
