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
        ("kind: llm;model: mlp", "with kind: llm write model: tiny-llama, a local"),
        ("model: tiny-llama", "add kind: llm"),
    ],
)
def test_kind_and_model_must_agree(lines, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config_text(fleet(lines))
    assert fragment in str(err.value)


def test_batch_models_default_to_kind_batch():
    assert parse_config_text(fleet("model: mlp")).models["m"].kind == "batch"


def model_dir(tmp_path, config: dict | None = None):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config or {"max_position_embeddings": 4096}))
    return str(tmp_path)


def test_old_options_map_to_the_same_engine_and_refuse_in_the_names_written(tmp_path):
    from gpubroker.deployments.llm.engine_config import engine_options

    d = model_dir(tmp_path)
    opts = engine_options({"model_dir": d, "max_model_len": 512, "kv_cache_blocks": 16, "kv_cache_blocks_max": 32})
    assert opts.model_dir == d and opts.kv_cache_blocks == 16 and opts.kv_cache_blocks_max == 32
    assert (opts.device, opts.block_tokens, opts.kv_cache_blocks_min) == ("cpu", 128, 5)
    with pytest.raises(
        ValueError, match=r"options.kv_blocks: not a gpubroker engine option; did you mean 'kv_cache_blocks_min'"
    ):
        engine_options({"model_dir": d, "kv_blocks": 3})
    with pytest.raises(
        ValueError, match=r"engine_kwargs.num_gpu_blocks_override=999 must be in \[options.kv_cache_blocks_min=5"
    ):
        engine_options({"model_dir": d, "max_model_len": 512, "kv_cache_blocks": 999, "kv_cache_blocks_max": 32})
    with pytest.raises(ValueError, match="options.num_layers: shapes the built-in tiny-llama"):
        engine_options({"model_dir": d, "num_layers": 3})
    with pytest.raises(ValueError, match=r"options.kv_cache_blocks_min=2 must be in \[5,"):
        engine_options({"model_dir": d, "max_model_len": 512, "kv_cache_blocks_min": 2})
    with pytest.raises(ValueError, match="in_process='yes' must be true, false or null"):
        engine_options({"model_dir": d, "max_model_len": 512, "in_process": "yes"})
    assert engine_options({"model_dir": d, "max_model_len": 512, "in_process": False}).in_process is False


def test_engine_kwargs_are_vllms_names_and_the_broker_moves_three_within_them(tmp_path):
    """max_num_seqs and max_num_batched_tokens are the largest the broker sets (admission starts at
    half the expected peak), num_gpu_blocks_override the cache at start; the rest pass through."""
    from gpubroker.deployments.llm.engine_config import engine_options
    from gpubroker.quotas.llm_spec import LlmSpec

    kwargs = {
        "max_model_len": 256,
        "block_size": 64,
        "max_num_seqs": 24,
        "max_num_batched_tokens": 1024,
        "num_gpu_blocks_override": 12,
        "dtype": "bfloat16",
        "max_loras": 2,
    }
    o = engine_options({"kv_cache_blocks_max": 40}, kwargs, model_dir(tmp_path), LlmSpec(expected_peak_concurrency=10))
    assert (o.max_model_len, o.block_tokens, o.kv_cache_blocks, o.kv_cache_blocks_max) == (256, 64, 12, 40)
    assert (o.max_num_seqs, o.max_num_seqs_max) == (5, 24)  # starts at half the peak, vLLM's value the largest
    assert (o.max_batched_tokens, o.max_batched_tokens_max) == (1024, 1024)
    assert o.kv_cache_blocks_min == 256 // 64 + 1  # one whole context and vLLM's null block
    assert o.engine_kwargs == kwargs
    # unset: the model's own context (vLLM's default), not gpubroker's
    assert engine_options({}, {}, model_dir(tmp_path)).max_model_len == 4096
    with pytest.raises(ValueError, match="engine_kwargs.max_num_seqs: 0 must be a whole number >= 1"):
        engine_options({}, {"max_num_seqs": 0}, model_dir(tmp_path))
    with pytest.raises(ValueError, match="engine_kwargs.model: set by gpubroker"):
        engine_options({}, {"model": "x"}, model_dir(tmp_path))
    with pytest.raises(
        ValueError, match="options.block_tokens: deprecated, and engine_kwargs.block_size is written too"
    ):
        engine_options({"block_tokens": 128}, {"block_size": 64}, model_dir(tmp_path))


def test_vllm_gets_the_users_arguments_over_the_cpu_defaults_and_the_broker_bounds_over_both(tmp_path):
    from dataclasses import replace

    from gpubroker.deployments.llm.engine_config import engine_options
    from gpubroker.deployments.llm.vllm_engine import vllm_kwargs

    o = engine_options({}, {"max_model_len": 256, "dtype": "bfloat16", "seed": 7}, model_dir(tmp_path))
    on_cpu = vllm_kwargs(o, 9, 300)
    assert on_cpu["enforce_eager"] is True and on_cpu["dtype"] == "bfloat16" and on_cpu["seed"] == 7
    assert (on_cpu["num_gpu_blocks_override"], on_cpu["max_num_batched_tokens"], on_cpu["max_num_seqs"]) == (9, 300, 64)
    on_cuda = vllm_kwargs(replace(o, device="cuda"), 9, 300)
    assert "enforce_eager" not in on_cuda and on_cuda["enable_sleep_mode"] is True  # CPU's needs stay on CPU
    eager_off = engine_options({}, {"max_model_len": 256, "enforce_eager": False}, model_dir(tmp_path))
    assert vllm_kwargs(eager_off, 9, 300)["enforce_eager"] is False
    assert "dtype" not in vllm_kwargs(replace(o, engine_kwargs={}), 9, 300)  # vLLM's auto, a non-built-in model


def test_kv_bytes_follow_the_dtype_vllm_will_run():
    from gpubroker.deployments.llm.vllm_engine import kv_dtype_bytes

    assert kv_dtype_bytes({"dtype": "float32"}, {"torch_dtype": "bfloat16"}) == 4
    assert kv_dtype_bytes({}, {"torch_dtype": "float32"}) == 2  # vLLM's auto halves a float32 checkpoint
    assert kv_dtype_bytes({}, {"torch_dtype": "bfloat16"}) == 2
    assert kv_dtype_bytes({"dtype": "float32", "kv_cache_dtype": "fp8"}, {}) == 1


def test_a_model_is_a_directory_or_a_model_id_in_the_local_cache(tmp_path, monkeypatch):
    from gpubroker.deployments.llm.model_source import ModelNotFound, resolve_model

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snap = cache / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123\n")
    assert resolve_model("acme/tiny", base=tmp_path) == snap
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model("local", base=tmp_path) == local
    with pytest.raises(ModelNotFound, match=r"looked in .*models--acme--other.snapshots.main"):
        resolve_model("acme/other", base=tmp_path)
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model("./nowhere", base=tmp_path)


@pytest.mark.parametrize(
    "model, ok",
    [("build/tiny-llama", True), ("meta-llama/Llama-3.2-1B-Instruct", True), ("/models/x", True), ("a.b:C", False)],
)
def test_kind_llm_takes_a_directory_or_a_model_id(model, ok):
    text = fleet(f"kind: llm;model: '{model}'")
    if ok:
        assert parse_config_text(text).models["m"].model == model
    else:
        with pytest.raises(ConfigError, match="not an LLM"):
            parse_config_text(text)


def test_the_schema_refuses_engine_kwargs_on_batch_and_unknown_options_on_llm():
    with pytest.raises(ConfigError, match="engine_kwargs: vLLM's arguments, for kind: llm only"):
        parse_config_text(fleet("model: mlp;engine_kwargs: {dtype: float16}"))
    with pytest.raises(ConfigError) as err:
        parse_config_text(fleet("kind: llm;model: tiny-llama;options: {dtype: bfloat16}"))
    assert "models.m.options.dtype" in str(err.value) and "engine_kwargs" in str(err.value)
    cfg = parse_config_text(fleet("kind: llm;model: tiny-llama;engine_kwargs: {dtype: bfloat16}"))
    assert cfg.models["m"].engine_kwargs == {"dtype": "bfloat16"}


def test_validate_warns_for_old_keys_and_checks_names_against_vllm(monkeypatch):
    from gpubroker import validate

    text = fleet("kind: llm;model: tiny-llama;engine_kwargs: {dtyp: bfloat16};options: {block_tokens: 128}")
    cfg = parse_config_text(text)
    monkeypatch.setattr(validate, "vllm_argument_names", lambda timeout_s: ("0.32.0", ["block_size", "dtype"]))
    got = validate.check_llms(cfg)
    assert [str(i) for i in got.issues] == [
        "models.m.engine_kwargs.dtyp (got 'bfloat16'): not an engine argument of vLLM 0.32.0 "
        "(vllm.engine.arg_utils.EngineArgs); did you mean 'dtype'?"
    ]
    assert got.warnings == [
        "models.m.options.block_tokens is deprecated and read for one more release: write engine_kwargs.block_size instead"
    ]
    monkeypatch.setattr(validate, "vllm_argument_names", lambda timeout_s: "vLLM is not installed in this Python (x)")
    got = validate.check_llms(cfg)
    assert not got.issues and "not checked against vLLM's arguments: vLLM is not installed" in got.warnings[-1]


def test_without_vllm_validate_says_the_names_went_unchecked():
    from gpubroker.validate import vllm_argument_names

    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here: tests/unit/test_llm_engine_kwargs.py checks the real list")
    assert "vLLM is not installed in this Python" in str(vllm_argument_names())


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
        ({"model": "m", "prompt": "hi", "n": 129}, "n"),
        ({"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ):
        _, err = parse_body("chat" if "messages" in raw else "completion", raw)
        assert err is not None and err.status_code == 400
        import json

        assert json.loads(err.body)["error"]["param"] == field
