"""The demo fleets' files inside the package (gpubroker.demo): the same files as the clone's configs/, every one
named by the wheel's package data, written out by ``gpubroker demo-config`` without replacing a user's file,
and ``--demo`` picking the shipped demo for ``up`` and ``validate``."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gpubroker.cli.demo import config_or_demo
from gpubroker.cli.main import app
from gpubroker.demo import FILES, demo_path, write_demo_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", FILES)
def test_each_shipped_file_is_the_clones_configs_file_and_the_wheel_carries_it(name):
    assert demo_path(name).read_bytes() == (ROOT / "configs" / name).read_bytes()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(name, pattern) for pattern in package_data["gpubroker.demo"]), name


def test_an_unknown_demo_file_names_the_shipped_ones():
    with pytest.raises(ValueError, match="demo.yaml, llm-demo.yaml"):
        demo_path("nosuch.yaml")


def test_writing_the_files_keeps_a_users_edited_config_unless_forced(tmp_path):
    written = write_demo_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == list(FILES)
    (tmp_path / "demo.yaml").write_text("# mine\n")
    (tmp_path / "prometheus.yml").unlink()
    with pytest.raises(FileExistsError, match="demo.yaml") as refused:
        write_demo_files(tmp_path)
    assert "--force" in str(refused.value)
    assert (tmp_path / "demo.yaml").read_text() == "# mine\n" and not (tmp_path / "prometheus.yml").exists()
    write_demo_files(tmp_path, force=True)
    assert (tmp_path / "demo.yaml").read_bytes() == demo_path().read_bytes()


def test_config_or_demo_takes_the_file_or_the_shipped_demo_never_both(tmp_path):
    mine = tmp_path / "fleet.yaml"
    assert config_or_demo(mine, False, default_demo=False) == mine
    assert config_or_demo(None, True, default_demo=False) == demo_path()
    assert config_or_demo(None, False, default_demo=True) == demo_path()  # `gpubroker up` alone
    with pytest.raises(typer.BadParameter, match="not both"):
        config_or_demo(mine, True, default_demo=True)
    with pytest.raises(typer.BadParameter, match="--demo"):
        config_or_demo(None, False, default_demo=False)  # `gpubroker validate` alone


def test_validate_demo_and_demo_config_from_a_folder_without_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    shipped = runner.invoke(app, ["validate", "--demo", "--no-import"])
    assert shipped.exit_code == 0, shipped.output
    assert "valid - config hash" in shipped.output
    assert runner.invoke(app, ["validate"]).exit_code == 2
    out = runner.invoke(app, ["demo-config", "--out", "here"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "here" / "grafana" / "gpubroker.json").is_file()
    again = runner.invoke(app, ["demo-config", "--out", "here"])
    assert again.exit_code == 1
