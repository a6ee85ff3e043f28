"""gpubroker.cli.fleet draws gpubroker.deployments.cluster.fleet's UpEvents as rich bars; the lifecycle library needs no UI (no Ray here)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from gpubroker.cli import fleet as cli_fleet
from gpubroker.deployments.cluster import fleet, fleet_client
from gpubroker.deployments.cluster.fleet import FleetError, Note, UpEvent, UpStage


def _bars(monkeypatch) -> tuple[cli_fleet.UpBars, Progress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    monkeypatch.setattr(cli_fleet, "console", console)
    progress = Progress(console=console)
    return cli_fleet.UpBars(progress), progress, out


def test_each_stage_gets_one_bar_that_follows_its_events(monkeypatch):
    bars, progress, _ = _bars(monkeypatch)
    for event in (
        UpEvent(UpStage.RAY, "Starting Ray", 0, 1),
        UpEvent(UpStage.RAY, "Ray at 127.0.0.1:6379", 1, 1),
        UpEvent(UpStage.MODELS, "Loading models", 0, 2),
        UpEvent(UpStage.MODELS, done=1, total=2),  # no label: the last one stays
        UpEvent(UpStage.MODELS, "Models loaded", 2, 2),
        UpEvent(UpStage.REQUESTS, "First requests", 0, 2),
        UpEvent(UpStage.REQUESTS, done=1, total=2),
    ):
        bars(event)
    tasks = {t.description: (t.completed, t.total) for t in progress.tasks}
    assert tasks == {"Ray at 127.0.0.1:6379": (1, 1), "Models loaded": (2, 2), "First requests": (1, 2)}


def test_a_failure_says_where_the_state_is_and_how_to_clean_up(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_STATE_DIR", str(tmp_path))
    bars, progress, out = _bars(monkeypatch)
    bars(UpEvent(UpStage.FAILED, "Serve app DEPLOY_FAILED: boom"))
    text = out.getvalue()
    assert "up failed" in text and "boom" in text and str(tmp_path) in text and "gpubroker down" in text
    assert not progress.tasks  # a failure is a message, not a bar


def test_down_without_a_fleet_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    said: list[tuple[str, Note]] = []
    with pytest.raises(FleetError, match="no fleet is running"):
        fleet.down_fleet(None, lambda line, note: said.append((line, note)))
    assert said == []


def test_the_state_file_round_trips(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUBROKER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert fleet_client.read_state() is None
    fleet_client.write_state({"address": "127.0.0.1:1234", "started_ray": True})
    assert fleet_client.read_state() == {"address": "127.0.0.1:1234", "started_ray": True}
    assert fleet_client.resolve_address(None) == "127.0.0.1:1234"
    fleet_client.clear_state()
    assert fleet_client.read_state() is None and fleet_client.resolve_address(None) is None


def _up_output(monkeypatch, state: dict) -> str:
    from gpubroker.quotas.config import parse_config

    out = io.StringIO()
    monkeypatch.setattr(cli_fleet, "console", Console(file=out, width=200, force_terminal=False))
    monkeypatch.setattr(fleet, "up_fleet", lambda *a, **k: state)  # no Ray: what up_fleet returned
    cfg = parse_config(
        {
            "broker": {"direct_ingress": True},
            "gpu": {"device": "cpu", "capacity": "1GiB"},
            "models": {"m": {"model": "mlp", "quota": {"min": "32MiB", "base": "64MiB", "max": "128MiB"}}},
        },
        "t",
    )
    cli_fleet.up_with_progress(cfg, "", "t.yaml")
    return out.getvalue()


def test_up_prints_each_models_direct_urls_or_why_there_are_none(monkeypatch):
    base = {"up_s": 3.0, "http_url": "http://127.0.0.1:8000"}
    text = _up_output(monkeypatch, {**base, "direct_urls": {"m": ["http://127.0.0.1:30001/v1/models/m/infer"]}})
    assert "m direct: http://127.0.0.1:30001/v1/models/m/infer" in text and "warning" not in text
    text = _up_output(monkeypatch, {**base, "direct_urls": {"m": []}})
    assert "warning" in text and "RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in text
    text = _up_output(monkeypatch, {**base, "direct_urls": {"m": []}, "direct_error": "could not list: boom"})
    assert "could not list: boom" in text
    assert "direct" not in _up_output(monkeypatch, base)  # the switch off: no such line


def test_up_and_apply_read_a_file_as_validate_does(monkeypatch, tmp_path):
    """A size without a unit is refused before anything starts or anything running is touched."""
    from typer.testing import CliRunner

    from gpubroker.cli.main import app

    monkeypatch.setattr(fleet_client, "apply_config", lambda *a, **k: pytest.fail("apply reached the broker"))
    monkeypatch.setattr(fleet, "up_fleet", lambda *a, **k: pytest.fail("up started a fleet"))
    bad = tmp_path / "fleet.yaml"
    bad.write_text(
        "gpu: {device: cpu, capacity: 8GiB}\nmodels:\n  a:\n    model: mlp\n    quota: {min: 1, base: 2, max: 4}\n"
    )
    for command in ("apply", "up"):
        r = CliRunner().invoke(app, [command, str(bad)])
        assert r.exit_code == 1 and "models.a.quota.base" in r.output and "has no unit" in r.output, (command, r.output)


STATUS = {
    "config_hash": "abc123",
    "profile": "offpeak",
    "models": {
        "minilm": {"grant_bytes": 2, "base_bytes": 1, "used_bytes": 1, "max_batch_size": 8, "queue_depth": 0},
        "mlp": {"grant_bytes": 1, "base_bytes": 1, "used_bytes": 1, "max_batch_size": 4, "queue_depth": 3},
    },
}


def test_decisions_of_an_unknown_model_is_an_error_that_names_the_closest(monkeypatch):
    from typer.testing import CliRunner

    from gpubroker.cli.main import app

    asked: list[str | None] = []
    monkeypatch.setattr(fleet_client, "fetch_status", lambda address: STATUS)
    monkeypatch.setattr(fleet_client, "fetch_decisions", lambda address, model, since: asked.append(model) or [])
    result = CliRunner().invoke(app, ["decisions", "--model", "minlm"])
    assert result.exit_code == 1, result.output
    flat = " ".join(result.output.split())  # rich wraps at the runner's width
    assert "no model 'minlm'" in flat and "did you mean 'minilm'?" in flat
    assert asked == []  # refused before asking for its log
    ok = CliRunner().invoke(app, ["decisions", "--model", "minilm"])
    assert ok.exit_code == 0 and asked == ["minilm"]


def test_status_and_its_watch_draw_the_same_tables(monkeypatch):
    from gpubroker.cli import live, views

    out = io.StringIO()
    monkeypatch.setattr(cli_fleet, "console", Console(file=out, width=200, force_terminal=False))
    monkeypatch.setattr(fleet_client, "fetch_status", lambda address: STATUS)
    cli_fleet.status(as_json=False, address=None, watch=False, interval=1.0)
    printed = out.getvalue()
    watched = io.StringIO()
    calls = []

    def fetch():
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return STATUS

    live.watch_status(fetch, interval_s=0.01, console=Console(file=watched, width=200, force_terminal=False))
    for column in views.STATUS_COLUMNS:
        assert column in printed and column in watched.getvalue(), column
    for line in printed.strip().splitlines():
        assert line in watched.getvalue(), line  # every line of status, as the watch drew it


def test_every_decision_line_names_its_model():
    from gpubroker.cli.views import describe_decision

    engine = {
        "seq": 7,
        "time_s": 0.0,
        "kind": "engine",
        "model": "chat",
        "rule": "busy_grow",
        "trigger": "waiting",
        "trigger_value": 12,
        "reason": "queue over the running sequences",
        "old": {"max_num_seqs": 8, "kv_cache_blocks": 8},
        "new": {"max_num_seqs": 16, "kv_cache_blocks": 8},
    }
    line = describe_decision(engine)
    assert line.startswith("#7 ") and "chat: engine busy_grow max_num_seqs 8->16" in line and "[waiting=12]" in line
    other = describe_decision({"seq": 8, "time_s": 0.0, "kind": "violation", "model": "mlp", "reason": "over grant"})
    assert "mlp: [violation] over grant" in other


def test_an_llm_row_shows_ttft_and_tpot_against_their_slos_not_a_batch_slo():
    from gpubroker.cli.views import status_table

    engine = {"max_num_seqs": 16, "ttft_p95_ms": 250.0, "tpot_p95_ms": 80.0, "ttft_slo_ms": 1000, "tpot_slo_ms": 50}
    st = {
        "models": {
            "chat": {
                "grant_bytes": 1,
                "base_bytes": 1,
                "used_bytes": 1,
                "max_batch_size": 4,
                "slo_p95_ms": 100,
                "attainment": 0.5,
                "queue_depth": 0,
                "engine": engine,
            },
        }
    }
    out = io.StringIO()
    Console(file=out, width=220, force_terminal=False).print(status_table(st))
    row = next(line for line in out.getvalue().splitlines() if "chat" in line)
    assert "16 seqs" in row and "ttft 250 tpot 80" in row and "1000/50" in row
    assert "50%" not in row and " 100 " not in row  # no batch SLO or attainment for an engine
