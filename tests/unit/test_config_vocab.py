"""gpubroker.quotas.vocab: the config's objectives, batch formations and strategies are StrEnums read from
YAML strings, and written back as the same strings (JSON dump, config hash, validate --json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpubroker.quotas.config import ConfigError, parse_config_text
from gpubroker.quotas.vocab import BatchFormation, Objective, Strategy

ROOT = Path(__file__).resolve().parents[2]
TEXT = """
broker: {batch_formation: eager}
models:
  m:
    model: mlp
    quota: {min: 256MiB, base: 512MiB, max: 1GiB}
    control: {strategy: aimd}
profiles:
  schedule:
    - {name: day, objective: throughput, default: true}
"""


def test_yaml_strings_become_members():
    cfg = parse_config_text(TEXT)
    assert cfg.broker.batch_formation is BatchFormation.EAGER
    assert cfg.models["m"].control.strategy is Strategy.AIMD
    assert cfg.profiles.schedule[0].objective is Objective.THROUGHPUT
    assert cfg.models["m"].control.strategy == "aimd" and f"{cfg.profiles.schedule[0].objective}" == "throughput"


def test_defaults_are_members():
    cfg = parse_config_text(
        TEXT.replace("broker: {batch_formation: eager}\n", "").replace("    control: {strategy: aimd}\n", "")
    )
    assert cfg.broker.batch_formation is BatchFormation.LAZY
    assert cfg.models["m"].control.strategy is Strategy.HYBRID


def test_json_dump_writes_plain_strings():
    cfg = parse_config_text(TEXT)
    dumped = cfg.model_dump(mode="json")
    assert type(dumped["broker"]["batch_formation"]) is str and dumped["broker"]["batch_formation"] == "eager"
    assert type(dumped["models"]["m"]["control"]["strategy"]) is str
    assert json.loads(json.dumps(cfg.model_dump()))["profiles"]["schedule"][0]["objective"] == "throughput"
    assert parse_config_text(json.dumps(dumped)).config_hash() == cfg.config_hash()  # round trip


@pytest.mark.parametrize(
    "field,bad,expected",
    [
        ("strategy: aimd", "strategy: fast", "'hybrid', 'queue', 'aimd', 'model' or 'static'"),
        ("batch_formation: eager", "batch_formation: soon", "'eager' or 'lazy'"),
        ("objective: throughput", "objective: cheap", "'throughput', 'latency' or 'balanced'"),
    ],
)
def test_an_unknown_word_is_refused_with_the_choices(field: str, bad: str, expected: str):
    with pytest.raises(ConfigError) as info:
        parse_config_text(TEXT.replace(field, bad))
    assert expected in str(info.value) and bad.split(": ")[1] in str(info.value)


def test_validate_json_prints_strings(tmp_path: Path):
    path = tmp_path / "fleet.yaml"
    path.write_text(TEXT, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "gpubroker", "validate", str(path), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)["config"]
    assert doc["broker"]["batch_formation"] == "eager" and doc["models"]["m"]["control"]["strategy"] == "aimd"
    assert doc["profiles"]["schedule"][0]["objective"] == "throughput"
