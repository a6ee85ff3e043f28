"""Ray token auth for the Ray that ``gpubroker up`` starts: on by default.

Ray 2.60 (``ray/_private/authentication``) reads ``RAY_AUTH_MODE`` (``token`` or
``disabled``) and finds the token in ``RAY_AUTH_TOKEN``, else the file named by
``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. ``ray start --head`` turns token auth on
only when a token already exists and the mode is unset; a driver given an explicit address
never turns it on by itself. So ``ensure_token_auth`` decides once, for the head, the driver and
every process they start:

- the user chose a mode (``RAY_AUTH_MODE`` set): kept as it is (``disabled`` is their call);
- otherwise ``token``: the user's own token (``RAY_AUTH_TOKEN`` or the token file) when there
  is one, else a new one written to the token file (256 random bits, mode 0600).

``join_hint`` is the line that tells how another node joins.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


class TokenSource(StrEnum):
    ENV = "env"  # RAY_AUTH_TOKEN
    FILE = "file"  # the user's token file (RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)
    GENERATED = "generated"  # written by gpubroker up to the token file
    NONE = "none"  # auth disabled by the user


@dataclass(frozen=True)
class AuthSetup:
    mode: str  # "token" or what the user set RAY_AUTH_MODE to
    source: TokenSource  # where the token comes from
    token_path: Path | None  # the token file in use (None with RAY_AUTH_TOKEN or auth off)

    @property
    def enabled(self) -> bool:
        return self.mode.lower() == "token"


def token_path(env: Mapping[str, str] | None = None) -> Path:
    got = os.environ if env is None else env
    return Path(got[TOKEN_PATH_ENV]).expanduser() if got.get(TOKEN_PATH_ENV) else Path.home() / ".ray" / "auth_token"


def _has_token(path: Path) -> bool:
    try:
        return bool(path.read_text(encoding="utf-8").strip())
    except OSError:
        return False


def write_new_token(path: Path) -> None:
    """A fresh token (256 random bits, hex) in ``path``, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(32))


def ensure_token_auth(env: dict[str, str]) -> AuthSetup:
    """Decide the auth mode for a local head started with ``env`` (updated in place) and for this
    process (``os.environ``, and Ray's cached config when Ray is imported)."""
    chosen = env.get(AUTH_MODE_ENV) or os.environ.get(AUTH_MODE_ENV)
    if chosen:
        env[AUTH_MODE_ENV] = chosen
        os.environ.setdefault(AUTH_MODE_ENV, chosen)
        if chosen.lower() != "token":
            return AuthSetup(chosen, TokenSource.NONE, None)
    seen = {**os.environ, **env}
    if seen.get(TOKEN_ENV):
        setup = AuthSetup("token", TokenSource.ENV, None)
    else:
        path = token_path(seen)
        if _has_token(path):
            setup = AuthSetup("token", TokenSource.FILE, path)
        else:
            write_new_token(path)
            setup = AuthSetup("token", TokenSource.GENERATED, path)
    env[AUTH_MODE_ENV] = "token"
    os.environ[AUTH_MODE_ENV] = "token"
    _refresh_ray_config()
    return setup


def adopt_auth_mode(mode: str) -> str:
    """A driver connecting to a Ray that ``gpubroker up`` started: use its mode unless the user set
    one (RAY_AUTH_MODE), and make this process's Ray see it. Returns the mode in force."""
    os.environ.setdefault(AUTH_MODE_ENV, mode)
    _refresh_ray_config()
    return os.environ[AUTH_MODE_ENV]


def _refresh_ray_config() -> None:
    """Ray caches its config per process; re-read it so this driver sees token mode too."""
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # compiled: not in Ray's stubs

        Config.initialize("")
    except Exception:  # noqa: BLE001 - Ray not importable here: the env var is enough for children
        pass


def join_hint(address: str, setup: AuthSetup) -> str:
    """How another node joins the cluster at ``address``."""
    if not setup.enabled:
        return f"other nodes join with: ray start --address {address} (token auth is OFF: {AUTH_MODE_ENV}={setup.mode})"
    where = (
        f"the same {TOKEN_ENV}"
        if setup.source == TokenSource.ENV
        else f"the token in {setup.token_path} (copy it, or RAY_AUTH_TOKEN=$(ray get-auth-token))"
    )
    return f"other nodes join with: {AUTH_MODE_ENV}=token ray start --address {address}  (using {where})"
