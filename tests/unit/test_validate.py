"""`gpubroker validate` refuses what `up` would hit, each problem with its field named (exit 1);
`--explain` shows the card's budget; the CLI keeps the habits of other commands."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpubroker import __version__
from gpubroker.cli.main import app
from gpubroker.sizing import REPLICA_RUNTIME_BYTES

runner = CliRunner()

GOOD = """\
gpu: {device: cpu, capacity: 8GiB}
models:
  a:
    model: mlp
    quota: {min: 64MiB, base: 128MiB, max: 256MiB}
"""


def validate(tmp_path: Path, text: str, *args: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return runner.invoke(app, ["validate", str(path), *args])


def flat(output: str) -> str:
    return " ".join(output.split())


def refused(result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    text = flat(result.output)
    for needle in needles:
        assert needle in text, text
    return text


def test_a_good_config_is_valid_with_every_class_built(tmp_path):
    r = validate(tmp_path, GOOD)
    assert r.exit_code == 0, r.output
    assert "1 model class(es) imported and built" in flat(r.output)


def test_two_models_of_one_name_are_refused_with_both_lines(tmp_path):
    text = GOOD + "  a:\n    model: cnn\n    quota: {min: 64MiB, base: 128MiB, max: 256MiB}\n"
    refused(validate(tmp_path, text, "--no-import"), "models.a", "written twice (lines 3 and 6)")


def test_a_size_without_a_unit_asks_for_one(tmp_path):
    text = GOOD.replace("{min: 64MiB, base: 128MiB, max: 256MiB}", "{min: 1, base: 2, max: 4}")
    out = refused(validate(tmp_path, text, "--no-import"), "models.a.quota.min", "models.a.quota.max")
    assert "has no unit" in out and "'2GiB' (2147483648 bytes)" in out
    text = GOOD.replace("base: 128MiB", "base: 1.5G")
    refused(validate(tmp_path, text, "--no-import"), "models.a.quota.base", "'1.5GiB'", "'1.5GB'")


def test_gb_and_gib_are_both_accepted_and_shown_as_bytes(tmp_path):
    text = GOOD.replace("max: 256MiB", "max: 1.5GB").replace("capacity: 8GiB", "capacity: 1.5GiB")
    r = validate(tmp_path, text, "--no-import", "--explain")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "1,500,000,000 bytes" in out  # 1.5GB = 1.5 x 10^9, which binary units round: bytes beside
    doc = json.loads(validate(tmp_path, text, "--no-import", "--explain", "--json").output)
    assert doc["budget"]["capacity_bytes"] == 1_610_612_736  # 1.5GiB = 1.5 x 2^30
    assert doc["budget"]["models"][0]["max_bytes"] == 1_500_000_000


def test_an_unknown_day_name_is_refused(tmp_path):
    text = GOOD + textwrap.dedent("""\
        profiles:
          schedule:
            - {name: peak, days: monkey-frisbee, hours: "08:00-20:00"}
            - {name: rest, default: true}
        """)
    refused(validate(tmp_path, text, "--no-import"), "profiles.schedule.0.days", "'monkey-frisbee'", "mon-fri")


def test_the_metrics_port_may_not_be_the_http_port(tmp_path):
    text = "broker: {metrics_port: 8000, http_port: 8000}\n" + GOOD
    refused(validate(tmp_path, text, "--no-import"), "broker.metrics_port", "8000", "pick another metrics_port")


def test_a_port_in_the_direct_ingress_range_clashes(tmp_path):
    text = "broker: {direct_ingress: true, metrics_port: 30010}\n" + GOOD
    refused(validate(tmp_path, text, "--no-import"), "broker.metrics_port", "30000-31000")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory with its own package, as `up` runs from it."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "__init__.py").write_text("")
    (tmp_path / "acme" / "models.py").write_text(
        textwrap.dedent("""\
        class Scorer:
            def __init__(self, scale: float = 1.0):
                print("loading weights...", end="")  # chatter on stdout does not hide the result
                self.scale = scale

            def predict(self, items):
                return [self.scale for _ in items]
        """)
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_user_class_in_the_project_imports_and_builds(project):
    r = validate(project, GOOD.replace("model: mlp", "model: acme.models:Scorer\n    options: {scale: 2.0}"))
    assert r.exit_code == 0, r.output


def test_a_module_that_does_not_exist_is_refused(project):
    r = validate(project, GOOD.replace("model: mlp", "model: acme.nothere:Scorer"))
    refused(r, "models.a.model", "acme.nothere", "not found")
    r = validate(project, GOOD.replace("model: mlp", "model: acme.nothere:Scorer"), "--no-import")
    assert r.exit_code == 0, r.output  # the file alone is valid


def test_a_class_that_does_not_exist_is_refused(project):
    r = validate(project, GOOD.replace("model: mlp", "model: acme.models:Ranker"))
    refused(r, "models.a.model", "no class 'Ranker'", "Scorer")


def test_an_option_the_class_does_not_take_is_refused(project):
    r = validate(project, GOOD.replace("model: mlp", "model: acme.models:Scorer\n    options: {scael: 2.0}"))
    refused(r, "models.a.options.scael", "takes: scale", "remove it")


def test_profile_figures_under_options_point_to_the_profile_key(tmp_path):
    r = validate(tmp_path, GOOD.replace("model: mlp", "model: mlp\n    options: {a_ms: 5}"))
    refused(r, "models.a.options.a_ms", "in_dim", "profile:")
    r = validate(tmp_path, GOOD.replace("model: mlp", "model: mlp\n    profile: {a_ms: 5, c_ms: 0.5}"))
    assert r.exit_code == 0, r.output


def test_explain_shows_the_card_budget(tmp_path):
    text = GOOD.replace("device: cpu", "device: cuda:0").replace("capacity: 8GiB", "capacity: 8GiB, reserve_frac: 0.1")
    r = validate(tmp_path, text, "--no-import", "--explain")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    for needle in ("capacity", "reserve (0.1 of capacity)", "CUDA context: 1 process(es) x 512.0MiB", "usable"):
        assert needle in out, out
    assert "a: min / base / max" in out and "64.0MiB / 128.0MiB / 256.0MiB" in out
    doc = json.loads(validate(tmp_path, text, "--no-import", "--explain", "--json").output)
    b = doc["budget"]
    assert b["usable_bytes"] == int(8 * 1024**3 * 0.9) - 512 * 1024**2
    assert b["models"][0]["base_bytes"] == 128 * 1024**2


def test_help_version_and_plain_flags():
    for args in (["-h"], ["validate", "-h"], ["simulate", "-h"], ["calibrate", "-h"], ["up", "-h"], ["logs", "-h"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and "Usage:" in r.output, (args, r.output)
        assert "<bool>" not in r.output, r.output  # a flag takes no value
    assert "--install-completion" in runner.invoke(app, ["-h"]).output
    assert runner.invoke(app, ["bench", "-h"]).exit_code != 0  # the benchmarks are python -m bench, from a clone
    from bench.cli import app as bench_app

    assert "Usage: python -m bench" in runner.invoke(bench_app, ["-h"], prog_name="python -m bench").output
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"gpubroker {__version__}"


def test_json_is_a_plain_flag(tmp_path):
    r = validate(tmp_path, GOOD, "--no-import", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["valid"] is True
    r = validate(tmp_path, GOOD, "--no-import", "--json", "true")
    assert r.exit_code == 2  # a flag: "true" is an extra argument
    r = validate(tmp_path, "broker: {metrics_port: 8000}\n" + GOOD, "--no-import", "--json")
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["issues"][0]["path"] == "broker.metrics_port"


def test_explain_shows_the_quota_a_profile_suggests(tmp_path):
    """b* = (C/2 - a)/c within the ceiling: (100/2 - 5)/0.5 = 90 -> 64; memory 64MiB + 1MiB per item
    beside Ray Serve's runtime on host memory (48MiB), a tenth kept free: (48 + 64 + 2)/0.9 -> 127MiB,
    (48 + 64 + 64)/0.9 -> 196MiB."""
    text = GOOD.replace(
        "model: mlp",
        "model: mlp\n    slo_p95_ms: 100\n    profile: {a_ms: 5, c_ms: 0.5, weights_bytes: 64MiB, bytes_per_item: 1MiB}",
    )
    doc = json.loads(validate(tmp_path, text, "--no-import", "--explain", "--json").output)
    q = doc["budget"]["models"][0]["suggested"]
    assert (q["batch_at_slo"], q["batch_alone"]) == (64, 64)
    assert (q["min_bytes"], q["base_bytes"], q["max_bytes"]) == (127 * 1024**2, 196 * 1024**2, 196 * 1024**2)
    assert q["runtime_bytes"] == REPLICA_RUNTIME_BYTES and q["free_frac"] == 0.1
    out = flat(validate(tmp_path, text, "--no-import", "--explain").output)
    assert "profile suggests" in out and "127.0MiB / 196.0MiB / 196.0MiB" in out  # the table may wrap the rest


def test_a_quota_under_what_a_replica_process_holds_is_warned_with_the_size_to_use(tmp_path):
    """On host memory a replica's grant holds Ray Serve's runtime beside the model: 48MiB / 0.9 -> 54MiB."""
    small = GOOD.replace("quota: {min: 64MiB, base: 128MiB, max: 256MiB}", "quota: {min: 1MiB, base: 1MiB, max: 2MiB}")
    out = flat(validate(tmp_path, small, "--no-import").output)
    assert "models.a.quota.max: 2.0MiB per replica is under what a replica process holds" in out, out
    assert "at least 54.0MiB per replica" in out and "gpubroker calibrate CONFIG a" in out, out
    assert "quota.max" not in flat(validate(tmp_path, GOOD, "--no-import").output)
