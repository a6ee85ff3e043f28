"""Why a Serve deployment failed (``gpubroker.deployments.serve.failures``): the cause comes from the failed
deployment's own message (Serve's app message only says "Failed to update the deployments"), and
``gpubroker logs`` finds a model's replica logs by its app."""

from __future__ import annotations

from pathlib import Path

from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview
from typer.testing import CliRunner

from gpubroker.cli.main import app
from gpubroker.deployments.cluster import fleet_client
from gpubroker.deployments.serve.failures import failure_cause, replica_logs

TRACE = "\n".join(
    ["Traceback (most recent call last):"]
    + [f'  File "/x/frame{i}.py", line {i}, in f{i}' for i in range(20)]
    + ["FileNotFoundError: [Errno 2] No such file or directory: 'sentiment-v2.pt'"]
)


def _dep(status: DeploymentStatus, message: str = "") -> DeploymentStatusOverview:
    return DeploymentStatusOverview(status, DeploymentStatusTrigger.CONFIG_UPDATE_STARTED, {}, message)


def test_the_cause_is_the_failed_deployments_own_last_lines():
    apps = {
        "gpubroker-broken": ApplicationStatusOverview(
            ApplicationStatus.DEPLOY_FAILED,
            "Failed to update the deployments ['broken'].",
            0.0,
            {"broken": _dep(DeploymentStatus.DEPLOY_FAILED, TRACE)},
        ),
        "gpubroker-fine": ApplicationStatusOverview(
            ApplicationStatus.RUNNING, "", 0.0, {"fine": _dep(DeploymentStatus.HEALTHY)}
        ),
        "gpubroker-later": None,
    }
    cause = failure_cause(apps)
    assert cause.startswith("broken (DEPLOY_FAILED):")
    assert "FileNotFoundError" in cause and "sentiment-v2.pt" in cause
    assert "frame10" not in cause and "fine" not in cause  # the last lines only, the failed only


def test_an_app_failed_without_a_failed_deployment_gives_its_own_message():
    apps = {"a": ApplicationStatusOverview(ApplicationStatus.DEPLOY_FAILED, "import error: no module acme", 0.0, {})}
    assert failure_cause(apps) == "a (DEPLOY_FAILED): import error: no module acme"


def test_logs_shows_the_models_replica_logs_and_refuses_an_unknown_model(tmp_path, monkeypatch):
    serve_logs = tmp_path / "ray" / "session_latest" / "logs" / "serve"
    serve_logs.mkdir(parents=True)
    mine = serve_logs / "replica_gpubroker-mlp_mlp_abc123.log"
    mine.write_text("".join(f"line {i}\n" for i in range(100)))
    (serve_logs / "replica_gpubroker-cnn_cnn_def456.log").write_text("other model\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert replica_logs("gpubroker-mlp", "mlp") == [mine]
    monkeypatch.setattr(fleet_client, "read_state", lambda: None)  # no state file: any name is looked up
    shown = CliRunner().invoke(app, ["logs", "mlp", "-n", "5"])
    assert shown.exit_code == 0, shown.output
    assert "line 99" in shown.output and "line 95" in shown.output and "line 94" not in shown.output
    assert "other model" not in shown.output
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    monkeypatch.setattr(fleet_client, "read_state", lambda: {"config_text": demo.read_text()})
    shown = CliRunner().invoke(app, ["logs", "minilm", "-n", "5"])
    assert shown.exit_code == 1 and "no replica log of 'minilm'" in _flat(shown.output)  # known, no log here
    wrong = CliRunner().invoke(app, ["logs", "minlm"])
    assert wrong.exit_code == 1 and "did you mean 'minilm'?" in _flat(wrong.output)


def _flat(text: str) -> str:
    """The CLI's output with rich's line wrapping undone."""
    return " ".join(text.split())
