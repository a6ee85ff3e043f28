"""A user's own model code, run from their project directory: what to ship, what collides.

``gpubroker up`` runs from the user's project (``model: acme.models:Scorer`` with ``acme/`` in
the current directory). Three things follow from that, all here:

- ``on_sys_path``: the command imports the user's package as Python would from that directory
  (appended to ``sys.path``, so gpubroker's own packages still win in this process);
- ``check_project`` -> ``ProjectCheck.py_modules``: the user's top-level packages found in the
  project directory, shipped to every replica with Ray's ``runtime_env={"py_modules": [...]}``
  (uploaded once, unpacked on each node: replicas on other nodes import them too; on the node
  ``up`` runs on, Ray also puts the driver's directory on the workers' path). A package that is
  installed (``pip install -e .``) is not shipped: it imports from the environment;
- ``ProjectCheck.errors`` / ``warnings``: a folder of the project named ``gpubroker`` (gpubroker's one
  import name; its ``broker``, ``deployments`` and ``quotas`` live under it, so a project's own
  ``deployments/`` is its own) shadows ours, or ours shadows it: a model path into it cannot work,
  and anything that puts the project first on the path breaks the command. Each message names the
  folder and the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

OUR_PACKAGES = ("gpubroker",)  # the one name the wheel installs
# This installation's gpubroker package: deployments/cluster/ is gpubroker/deployments/cluster (a link in a clone, a
# folder in the wheel), so the unresolved path's parent is the package either way.
_PACKAGE = Path(__file__).parents[2]


@dataclass(frozen=True)
class ProjectCheck:
    """What ``check_project`` found in a project directory for a fleet's model paths."""

    project_dir: Path
    py_modules: tuple[str, ...] = ()  # the user's packages to ship to the replicas (paths)
    errors: tuple[str, ...] = ()  # collisions that break a model: ``up`` and ``validate`` refuse
    warnings: tuple[str, ...] = field(default=())  # collisions that break other ways of running

    def runtime_env(self) -> dict[str, list[str]] | None:
        """Ray's job runtime_env shipping the user's packages, or None when there is nothing to ship."""
        return {"py_modules": list(self.py_modules)} if self.py_modules else None


def user_refs(refs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """model name -> its import path, for the models given as ``pkg.module:Class``."""
    return {name: ref for name, ref in refs if isinstance(ref, str) and ":" in ref}


def top_package(ref: str) -> str:
    return ref.partition(":")[0].split(".")[0]


def local_module(project_dir: Path, name: str) -> Path | None:
    """``project_dir/name/`` (a package) or ``project_dir/name.py``, when there is one."""
    for candidate in (project_dir / name, project_dir / f"{name}.py"):
        if candidate.is_dir() and (candidate / "__init__.py").exists() or candidate.is_file():
            return candidate
        if candidate.is_dir() and any(candidate.glob("*.py")):  # a namespace package
            return candidate
    return None


def _is_ours(path: Path, name: str) -> bool:
    """The folder is this installation's package, or the same package in a gpubroker checkout
    (a clone with its own pyproject naming the project gpubroker: its folders are ours, not a user's)."""
    if name == _PACKAGE.name and path.resolve() == _PACKAGE.resolve():
        return True
    return _is_gpubroker_checkout(path.parent)


def _is_gpubroker_checkout(folder: Path) -> bool:
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return 'name = "gpubroker"' in text


def shadow_message(name: str, path: Path, models: list[str]) -> str:
    """What a project folder named like one of our packages does, and the fix."""
    fix = (
        f"rename your '{path.name}' (e.g. to '{path.parent.name or 'myproject'}_{name}') and the model paths "
        f"that name it, or put your code in a package of another name"
    )
    if models:
        return (
            f"{path} has the name of gpubroker's own package '{name}': in one process Python imports only "
            f"one of them, so model(s) {', '.join(models)} (model: {name}.…) cannot be imported. Fix: {fix}"
        )
    return (
        f"{path} has the name of gpubroker's own package '{name}'. `gpubroker up` does not use it (no model "
        f"path names it), but running gpubroker with this directory first on the path (`python -m gpubroker`, "
        f"PYTHONPATH=.) imports yours instead of gpubroker's and fails. Fix: {fix}"
    )


def check_project(refs: Iterable[tuple[str, str]], project_dir: Path | str | None = None) -> ProjectCheck:
    """The user's packages to ship and the collisions with ours, for (model name, model path)
    pairs run from ``project_dir`` (default: the current directory). Reads the file tree only."""
    project = Path(project_dir or Path.cwd()).resolve()
    by_top: dict[str, list[str]] = {}
    for name, ref in user_refs(refs).items():
        by_top.setdefault(top_package(ref), []).append(name)
    errors: list[str] = []
    warnings: list[str] = []
    for ours in OUR_PACKAGES:
        path = local_module(project, ours)
        if path is None or _is_ours(path, ours):
            continue
        models = by_top.get(ours, [])
        (errors if models else warnings).append(shadow_message(ours, path, models))
    ship = []
    for top in by_top:
        path = local_module(project, top)
        if path is not None and top not in OUR_PACKAGES and not _is_installed_elsewhere(top, path):
            ship.append(str(path))
    return ProjectCheck(project, tuple(ship), tuple(errors), tuple(warnings))


def _is_installed_elsewhere(top: str, path: Path) -> bool:
    """True when ``top`` imports from somewhere other than ``path`` without the project on the
    path (an installed copy): then that copy is what runs, and nothing is shipped."""
    from gpubroker.deployments.models import module_locations

    where = module_locations(top, without=path.parent)
    return where is not None and path.resolve() not in where


def on_sys_path(project_dir: Path | str | None = None) -> Path:
    """Append the project directory to ``sys.path`` (once), so that this process imports the
    user's ``pkg.module:Class`` as the replicas will; gpubroker's own packages stay first."""
    project = Path(project_dir or Path.cwd()).resolve()
    if not any(Path(p or ".").resolve() == project for p in sys.path):
        sys.path.append(str(project))
    return project
