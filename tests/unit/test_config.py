"""Fleet config: the demo passes; each kind of bad config is refused with its field named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpubroker.quotas.config import ConfigError, load_config, parse_config, parse_config_text
from gpubroker.quotas.sizes import format_size, parse_size
from tests.unit.policy_builders import BASE_CONFIG, deep_merge

ROOT = Path(__file__).resolve().parents[2]


def refuse(over: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(deep_merge(BASE_CONFIG, over))
    return [str(i) for i in info.value.issues]


def test_demo_config_is_valid():
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert set(cfg.models) == {"minilm", "cnn", "mlp", "prof"}
    assert cfg.broker.metrics_host == "127.0.0.1" and cfg.broker.http_host == "127.0.0.1"
    assert cfg.models["minilm"].batch.unit == "tokens"
    assert len(cfg.config_hash()) == 12


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")))
def test_every_shipped_fleet_config_is_valid(path):
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "models" not in data:
        pytest.skip("not a fleet config")
    parse_config(data, str(path))


def test_defaults_follow_design():
    cfg = parse_config(BASE_CONFIG)
    ctl = cfg.models["a"].control
    assert (ctl.target_queue, ctl.band_low, ctl.band_high, ctl.window_s) == (10, 6, 15, 30.0)
    assert cfg.gpu.emergency_free_frac == 0.10
    assert parse_config({"models": BASE_CONFIG["models"]}).gpu.reserve_frac == 0.12


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"models": {"a": {"quota": {"min": "4GiB"}}}}, "models.a.quota"),  # min > base
        ({"models": {"a": {"quota": {"base": "7GiB"}}}}, "base (7.0GiB) is above max"),
        ({"models": {"a": {"batch": {"floor": 64, "ceiling": 8}}}}, "models.a.batch"),
        ({"models": {"a": {"wait": {"min_ms": 30, "max_ms": 5}}}}, "models.a.wait"),
        ({"models": {"a": {"quota": {"base": "-1GiB"}}}}, "negative"),
        ({"models": {"a": {"quota": {"base": "3 bananas"}}}}, "unknown unit"),
        ({"models": {"a": {"slo_p95_ms": "fast"}}}, "models.a.slo_p95_ms"),
        ({"models": {"a": {"batchsize": 8}}}, "models.a.batchsize"),
        ({"brokr": {}}, "brokr"),
        ({"models": {"a": {"model": "not a ref!"}}}, "models.a.model"),
        ({"gpu": {"device": "tpu"}}, "gpu.device"),
        ({"gpu": {"reserve_frac": 1.5}}, "gpu.reserve_frac"),
        ({"broker": {"metrics_port": 70000}}, "broker.metrics_port"),
        ({"gpu": {"capacity": "5GiB"}}, "sum of quota.base"),
        ({"models": {"a": {"control": {"band_low": 20}}}}, "models.a.control"),
    ],
)
def test_bad_configs_name_the_field(over, needle):
    issues = refuse(over)
    assert any(needle in text for text in issues), issues


def test_bad_value_and_fix_are_in_the_message():
    issues = refuse({"models": {"a": {"batch": {"floor": 64, "ceiling": 8}}}})
    assert any("64" in t and "8" in t and "lower floor or raise ceiling" in t for t in issues), issues
    issues = refuse({"gpu": {"capacity": "5GiB"}})
    assert any("lower some models' quota.base" in t for t in issues), issues


def test_every_error_is_listed_not_just_the_first():
    issues = refuse(
        {"gpu": {"device": "tpu"}, "models": {"a": {"batch": {"floor": 64, "ceiling": 8}}, "b": {"bogus": 1}}}
    )
    assert len(issues) >= 3


def _profiles(*windows):
    return {"profiles": {"timezone": "UTC", "schedule": list(windows)}}


def test_profile_windows_must_not_overlap():
    issues = refuse(
        _profiles(
            {"name": "peak", "days": "mon-fri", "hours": "08:00-20:00"},
            {"name": "evening", "days": "fri", "hours": "19:00-23:00"},
            {"name": "off", "default": True},
        )
    )
    assert any("overlap on fri at 19:00" in t for t in issues), issues


def test_window_wrapping_midnight_overlaps_next_morning():
    issues = refuse(
        _profiles(
            {"name": "night", "days": "mon", "hours": "22:00-06:00"},
            {"name": "early", "days": "tue", "hours": "05:00-07:00"},
            {"name": "off", "default": True},
        )
    )
    assert any("overlap on tue at 05:00" in t for t in issues), issues


@pytest.mark.parametrize(
    "schedule, needle",
    [
        ([{"name": "a", "days": "mon", "hours": "08:00-09:00"}], "0 default profiles"),
        ([{"name": "a", "default": True}, {"name": "b", "default": True}], "2 default profiles"),
        ([{"name": "a", "days": "funday", "hours": "08:00-09:00"}, {"name": "d", "default": True}], "funday"),
        ([{"name": "a", "days": "mon", "hours": "8-9"}, {"name": "d", "default": True}], "HH:MM-HH:MM"),
        ([{"name": "a", "days": "mon", "hours": "25:00-26:00"}, {"name": "d", "default": True}], "impossible time"),
        ([{"name": "a", "days": "mon"}, {"name": "d", "default": True}], "needs both days and hours"),
    ],
)
def test_bad_profiles(schedule, needle):
    issues = refuse({"profiles": {"schedule": schedule}})
    assert any(needle in t for t in issues), issues
    assert any(t.startswith("profiles") for t in issues), issues


def test_bad_timezone():
    issues = refuse({"profiles": {"timezone": "Mars/Olympus", "schedule": [{"name": "d", "default": True}]}})
    assert any("profiles.timezone" in t for t in issues)


def test_unreadable_and_non_yaml_are_exit_code_2(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError) as info:
        parse_config_text("models: [unclosed\n")
    assert info.value.exit_code == 2 and "line" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config_text("")
    assert info.value.exit_code == 2


def test_sizes_round_trip():
    assert parse_size("24GiB") == 24 * 1024**3
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(1024) == 1024
    assert format_size(1536 * 1024**2) == "1.5GiB"
    cfg = parse_config(BASE_CONFIG)
    dumped = cfg.model_dump(mode="json")
    assert dumped["models"]["a"]["quota"]["base"] == "3.0GiB"
    assert parse_config(dumped).config_hash() == cfg.config_hash()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_cli_validate_exit_codes(tmp_path):
    ok = _cli("validate", "configs/demo.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    data = deep_merge(BASE_CONFIG, {"models": {"a": {"batch": {"floor": 64, "ceiling": 8}}}})
    bad.write_text(yaml.safe_dump(data))
    res = _cli("validate", str(bad))
    assert res.returncode == 1
    assert "models.a.batch" in res.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: {a: [1, 2\n")
    assert _cli("validate", str(broken)).returncode == 2
    assert _cli("validate", str(tmp_path / "nope.yaml")).returncode == 2
    js = _cli("validate", "--json", str(bad))
    assert js.returncode == 1 and json.loads(js.stdout)["valid"] is False


def test_cli_validate_shows_where_a_cluster_fleet_is_placed():
    """A gpus: fleet's summary lists each card with its usable memory, Σ base and models, as
    ``up`` will place them (the README's placement of configs/cluster-demo.yaml)."""
    res = _cli("validate", "configs/cluster-demo.yaml")
    assert res.returncode == 0, res.stderr
    assert "4 card(s) on 2 node(s)" in res.stdout and "device auto" not in res.stdout
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.count("│") == 9}
    assert "800.0MiB" in rows["a0"] and "672.0MiB" in rows["a1"] and "512.0MiB" in rows["b0"]
    assert "minilm" in rows["a0"] and "cnn" in rows["a1"] and "minilm" in rows["b0"] and "cnn" in rows["b1"]
    doc = json.loads(_cli("validate", "--json", "configs/cluster-demo.yaml").stdout)
    cards = {c["id"]: c for c in doc["placement"]["cards"]}
    assert cards["a0"]["models"] == {"minilm": 1, "mlp": 1} and cards["a1"]["models"] == {"cnn": 1, "profiled": 1}
    assert all(c["base_bytes"] <= c["usable_bytes"] for c in cards.values())
    assert doc["placement"]["replicas"]["minilm"] == ["a0", "b0"]
    assert "placement" not in json.loads(_cli("validate", "--json", "configs/demo.yaml").stdout)


PROFILED = """\
gpu: {device: cpu, capacity: 8GiB}
models:
  p:
    model: profiled
    profile: {a_ms: 20, c_ms: 0.5, weights_bytes: 1.5GiB, bytes_per_item: 1500KB}
    quota: {min: 2GiB, base: 3GiB, max: 4GiB}
"""


def test_a_profiled_model_serves_its_profile_and_a_dump_reads_back_the_same():
    """The profile's figures become the emulation's options (sizes in bytes), so the replica
    emulates what simulate does; a dumped config validates to the same one."""
    cfg = parse_config_text(PROFILED, units_required=True)
    spec = cfg.models["p"]
    assert spec.options == {
        "a_ms": 20.0,
        "c_ms": 0.5,
        "token_ms": 0.0,
        "weights_bytes": 1610612736,
        "bytes_per_item": 1_500_000,
    }
    assert spec.profile.bytes_per_item == 1_500_000
    assert parse_config(cfg.model_dump(mode="json")) == cfg
    from gpubroker.deployments.models.profiled import ProfiledAdapter

    assert ProfiledAdapter(**spec.options).declared_memory() == (1610612736, 1_500_000.0)


def test_options_that_contradict_the_profile_are_refused_in_a_file():
    text = PROFILED.replace("    profile:", "    options: {a_ms: 5}\n    profile:")
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, units_required=True)
    assert any("models.p.options.a_ms" in str(i) and "remove it from options" in str(i) for i in info.value.issues)


def test_code_may_still_pass_integer_bytes_a_file_may_not():
    doc = deep_merge(
        BASE_CONFIG, {"models": {"a": {"quota": {"min": 1024**3, "base": 2 * 1024**3, "max": 3 * 1024**3}}}}
    )
    assert parse_config(doc).models["a"].quota.base == 2 * 1024**3
    with pytest.raises(ConfigError) as info:
        parse_config(doc, units_required=True)
    assert any(i.path == "models.a.quota.base" and "has no unit" in i.message for i in info.value.issues)


def test_a_profile_without_any_cost_is_refused():
    text = PROFILED.replace("a_ms: 20, c_ms: 0.5", "a_ms: 0, c_ms: 0")
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, units_required=True)
    assert any(i.path == "models.p.profile" and "give the batch some cost" in i.message for i in info.value.issues)


@pytest.mark.parametrize(
    ("typo", "path", "meant"),
    [
        (("quota:", "quata:"), "models.minilm.quata", "quota"),
        (("slo_p95_ms", "slo_p59_ms"), "models.minilm.slo_p59_ms", "slo_p95_ms"),
        (("control_interval_s", "control_intervl_s"), "broker.control_intervl_s", "control_interval_s"),
    ],
)
def test_a_misspelt_key_names_the_one_meant(typo, path, meant):
    text = (Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text()
    assert typo[0] in text
    with pytest.raises(ConfigError) as info:
        parse_config_text(text.replace(*typo, 1))
    (issue,) = [i for i in info.value.issues if i.path == path]
    assert f"did you mean '{meant}'?" in issue.message, issue.message


def test_an_unknown_key_with_nothing_close_says_to_remove_it():
    text = (Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text()
    with pytest.raises(ConfigError) as info:
        parse_config_text(text.replace("broker:", "broker:\n  zzzqqq: 1", 1))
    (issue,) = info.value.issues
    assert "did you mean" not in issue.message and "remove it" in issue.message
