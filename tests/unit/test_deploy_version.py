"""A deployment's Serve version follows the code its replicas run (``gpubroker.deployments.app.code_digest``):
redeploying unchanged code keeps the replicas; an edited user model module is a new version."""

from __future__ import annotations

import sys

from gpubroker.deployments.app import code_digest, deployment_version


def test_user_model_edit_changes_the_version(tmp_path, monkeypatch):
    mod = tmp_path / "my_edit_model.py"
    mod.write_text("class M:\n    def predict(self, items):\n        return items\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = "my_edit_model:M"
    first = code_digest(ref)
    assert first == code_digest(ref)  # same code, same digest
    v1 = deployment_version(dict, "m", 1, {"num_cpus": 0.1}, ("m", "cfg"), first)
    mod.write_text("class M:\n    def predict(self, items):\n        return [x for x in items]\n")
    second = code_digest(ref)
    assert second != first
    assert deployment_version(dict, "m", 1, {"num_cpus": 0.1}, ("m", "cfg"), second) != v1
    assert "my_edit_model" not in sys.modules  # found, not imported


def test_builtin_and_unresolvable_models_still_get_a_version():
    assert code_digest("profiled") == code_digest("profiled")  # built-ins: gpubroker's own code
    assert code_digest("no_such_pkg_xyz:M") == code_digest("no_such_pkg_xyz:M") != code_digest("profiled")
