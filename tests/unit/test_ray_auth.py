"""gpubroker.deployments.cluster.ray_auth: `gpubroker up` starts Ray with token auth unless the user chose a mode."""

from __future__ import annotations

import stat

import pytest

from gpubroker.deployments.cluster.ray_auth import TokenSource, ensure_token_auth, join_hint


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(var, "")  # recorded, so the test's own settings are undone afterwards
        monkeypatch.delenv(var)
    # this process's Ray config stays as it was (other tests here run Ray)
    monkeypatch.setattr("gpubroker.deployments.cluster.ray_auth._refresh_ray_config", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_no_token_anywhere_generates_one_owner_only_and_turns_auth_on(clean_env):
    env: dict[str, str] = {}
    setup = ensure_token_auth(env)
    path = clean_env / ".ray" / "auth_token"
    assert setup.enabled and setup.source == TokenSource.GENERATED and setup.token_path == path
    assert len(path.read_text()) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert env["RAY_AUTH_MODE"] == "token"
    assert "RAY_AUTH_MODE=token ray start --address 127.0.0.1:6379" in join_hint("127.0.0.1:6379", setup)


def test_the_users_own_token_file_is_used_and_kept(clean_env, monkeypatch):
    mine = clean_env / "tok"
    mine.write_text("abc123")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(mine))
    setup = ensure_token_auth({})
    assert setup.source == TokenSource.FILE and setup.token_path == mine and mine.read_text() == "abc123"
    assert not (clean_env / ".ray" / "auth_token").exists()


def test_token_in_the_environment_is_used(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "xyz")
    setup = ensure_token_auth({})
    assert setup.source == TokenSource.ENV and setup.enabled
    assert not (clean_env / ".ray").exists()


def test_a_mode_the_user_chose_is_respected(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env: dict[str, str] = {}
    setup = ensure_token_auth(env)
    assert not setup.enabled and env["RAY_AUTH_MODE"] == "disabled" and setup.source == TokenSource.NONE
    assert "token auth is OFF" in join_hint("127.0.0.1:1", setup)
    assert not (clean_env / ".ray").exists()
