"""A user's project directory (``gpubroker.deployments.cluster.user_code``): the packages shipped to the replicas,
a folder named like one of gpubroker's packages refused or warned about with the fix."""

from __future__ import annotations

import sys
from pathlib import Path

from gpubroker.deployments.cluster.user_code import check_project


def _package(root: Path, name: str) -> Path:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "models.py").write_text("class M:\n    def predict(self, items):\n        return items\n")
    return root / name


def test_the_users_package_is_shipped_and_builtins_are_not(tmp_path):
    acme = _package(tmp_path, "acme_p3_unit")
    check = check_project([("scorer", "acme_p3_unit.models:M"), ("mlp", "mlp")], tmp_path)
    assert check.py_modules == (str(acme),) and not check.errors and not check.warnings
    assert check.runtime_env() == {"py_modules": [str(acme)]}


def test_nothing_to_ship_is_no_runtime_env(tmp_path):
    check = check_project([("mlp", "mlp"), ("cnn", "cnn")], tmp_path)
    assert check.py_modules == () and check.runtime_env() is None


def test_a_project_deployments_package_is_the_users_own(tmp_path, monkeypatch):
    """gpubroker installs one import name, so a Ray Serve project's own deployments/ and broker/ are shipped
    like any of the user's packages, neither shadowing ours nor shadowed."""
    repo = Path(__file__).resolve().parents[2]  # on pytest's path, its folders would import as `deployments`
    monkeypatch.setattr("sys.path", [p for p in sys.path if Path(p or ".").resolve() != repo])
    deployments = _package(tmp_path, "deployments")
    broker = _package(tmp_path, "broker")
    check = check_project([("scorer", "deployments.models:M"), ("ranker", "broker.models:M")], tmp_path)
    assert not check.errors and not check.warnings
    assert set(check.py_modules) == {str(deployments), str(broker)}


def test_a_project_gpubroker_folder_named_in_a_model_path_is_an_error_with_the_fix(tmp_path):
    _package(tmp_path, "gpubroker")
    check = check_project([("scorer", "gpubroker.models:M")], tmp_path)
    assert len(check.errors) == 1 and check.py_modules == ()
    msg = check.errors[0]
    assert str(tmp_path / "gpubroker") in msg and "model(s) scorer" in msg and "rename" in msg, msg


def test_a_project_folder_named_like_ours_but_unused_is_a_warning(tmp_path):
    _package(tmp_path, "gpubroker")
    _package(tmp_path, "acme_p3_unit2")
    check = check_project([("scorer", "acme_p3_unit2.models:M")], tmp_path)
    assert not check.errors and len(check.warnings) == 1
    assert "'gpubroker'" in check.warnings[0] and "python -m gpubroker" in check.warnings[0]


def test_our_own_checkout_is_not_a_shadow():
    root = Path(__file__).resolve().parents[2]
    check = check_project([("mlp", "mlp")], root)
    assert not check.errors and not check.warnings


def test_another_gpubroker_checkout_is_not_a_shadow_but_a_user_project_named_so_is(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("broker", "deployments", "quotas", "gpubroker"):
        _package(clone, name)
    (clone / "pyproject.toml").write_text('[project]\nname = "gpubroker"\n')
    assert not check_project([("mlp", "mlp")], clone).warnings  # a clone with a non-editable install
    (clone / "pyproject.toml").write_text('[project]\nname = "acme-serving"\n')
    assert len(check_project([("mlp", "mlp")], clone).warnings) == 1  # only gpubroker/ is a name of ours
