"""`gpubroker calibrate CONFIG MODEL` measures a real torch model in process and writes its
profile where `simulate` reads it, the rest of the file as written."""

from __future__ import annotations

import json
import re
import textwrap

from typer.testing import CliRunner

from gpubroker.cli.calibrate import with_profile
from gpubroker.cli.main import app
from gpubroker.quotas.config import load_config
from gpubroker.quotas.sizes import format_size, parse_size
from gpubroker.sim.profile import profile_for
from gpubroker.sizing import REPLICA_RUNTIME_BYTES

runner = CliRunner()

FLEET = """\
gpu: {device: cpu, capacity: 8GiB}
models:
  small:                     # a comment the write keeps
    model: mlp
    options: {in_dim: 64, hidden: 256, out_dim: 10}
    quota: {min: 64MiB, base: 128MiB, max: 256MiB}
    slo_p95_ms: 200
"""
MLP_PARAM_BYTES = (64 * 256 + 256 + 256 * 10 + 10) * 4  # float32 weights and biases


def test_calibrate_writes_the_measured_profile_into_a_copy(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    r = runner.invoke(app, ["calibrate", str(config), "small", "--sizes", "1,4,16", "--repeats", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    copy = tmp_path / "fleet.calibrated.yaml"
    assert out["wrote"] == str(copy) and config.read_text() == FLEET  # the original untouched
    measured = out["measured"]
    assert measured["weights_bytes"] == MLP_PARAM_BYTES and measured["memory_method"] == "hooks"
    assert measured["bytes_per_item"] > 0 and [p[0] for p in measured["latency_points"]] == [1.0, 4.0, 16.0]
    assert "# a comment the write keeps" in copy.read_text()
    cfg = load_config(copy)  # sizes with units, as validate wants them
    prof = profile_for("small", cfg.models["small"])
    assert prof.profiled and prof.weights_bytes == MLP_PARAM_BYTES
    assert prof.a_ms == measured["a_ms"] and prof.c_ms == measured["c_ms"]
    quota = out["quota"]
    assert quota["min_bytes"] <= quota["base_bytes"] <= quota["max_bytes"] and quota["slo_p95_ms"] == 200
    # beside the model: the process's own growth, measured here, and Ray Serve's runtime (issue 54 item 5)
    assert measured["process_bytes"] == quota["process_bytes"] >= 0
    assert quota["runtime_bytes"] == REPLICA_RUNTIME_BYTES and quota["free_frac"] == 0.1
    held = quota["process_bytes"] + quota["runtime_bytes"] + MLP_PARAM_BYTES + measured["bytes_per_item"] * 2
    assert quota["min_bytes"] >= held / 0.9  # floor 2 (the default), a tenth kept free


def test_calibrate_prints_the_quota_with_its_parts(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    r = runner.invoke(
        app, ["calibrate", str(config), "small", "--sizes", "1,2", "--repeats", "1", "--runtime", "40MiB"]
    )
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "+ 40.0MiB (Ray Serve's replica runtime, --runtime)" in out, out
    assert (
        "each = (" in out
        and f"+ 40.0MiB runtime + {format_size(MLP_PARAM_BYTES)} weights + " in out
        and "(1 - 0.1 kept free)" in out
    ), out
    found = re.search(r"quota: \{min: (\S+), base: (\S+), max: (\S+)\}", out)
    assert found and parse_size(found.group(1)) >= (40 * 1024**2 + MLP_PARAM_BYTES) / 0.9, out


def test_calibrate_refuses_a_runtime_that_is_not_a_size(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    r = runner.invoke(app, ["calibrate", str(config), "small", "--runtime", "lots"])
    assert r.exit_code == 1 and "--runtime 'lots'" in " ".join(r.output.split())


def test_calibrate_write_replaces_the_profile_in_place(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    for _ in range(2):
        r = runner.invoke(app, ["calibrate", str(config), "small", "--sizes", "1,2", "--repeats", "1", "--write"])
        assert r.exit_code == 0, r.output
    text = config.read_text()
    assert text.count("profile:") == 1 and "suggested for P95 <= 200 ms" in " ".join(r.output.split())
    assert load_config(config).models["small"].profile is not None


def test_calibrate_names_an_unknown_model(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    r = runner.invoke(app, ["calibrate", str(config), "big"])
    assert r.exit_code == 1 and "model 'big' is not in it" in " ".join(r.output.split())


def test_with_profile_replaces_a_block_profile_and_keeps_the_rest():
    text = textwrap.dedent("""\
        models:
          m:
            model: profiled
            profile:
              a_ms: 1
              c_ms: 2
            quota: {min: 1GiB, base: 1GiB, max: 1GiB}
          n:
            model: mlp
        """)
    out = with_profile(text, "m", "profile: {a_ms: 3, c_ms: 4}")
    assert out.splitlines()[1:5] == [
        "  m:",
        "    profile: {a_ms: 3, c_ms: 4}",
        "    model: profiled",
        "    quota: {min: 1GiB, base: 1GiB, max: 1GiB}",
    ]
    assert "  n:\n    model: mlp" in out
