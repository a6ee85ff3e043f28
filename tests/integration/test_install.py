"""Installs without a clone: the README's install lines, run from a built wheel in a fresh venv outside
the clone, then the quickstart's first steps that start no Ray.

The README's ```bash install block is read and run line by line with bash, in a temporary folder
holding a copy of the sources as ``./gpubroker`` (the clone the README names), with a fresh venv's
``bin`` first on PATH. Then, from a project folder outside the clone: ``gpubroker --version`` (the
wheel's version), ``gpubroker validate --demo`` (the demo fleet shipped inside the package, its
model classes imported and built), ``gpubroker demo-config`` (writes ``configs/``) and
``gpubroker validate`` of the written ``configs/demo.yaml`` (the same config hash) and
``configs/cluster-demo.yaml`` (its placement).

Two forms:

- ``make test`` (the test without a marker): installing Ray and torch from scratch takes minutes on
  2 cores, so the README's lines run with two additions: ``pip wheel`` is the test venv's pip with
  ``--no-build-isolation`` (the fresh venv's own setuptools is older than the build needs), and
  ``pip install`` gets ``--no-deps``. The dependencies come from the test venv through a ``.pth``
  file in the fresh venv: it adds the test venv's site-packages as a plain path, so the editable
  install's import hook there (itself a ``.pth``) never runs; the test checks that ``gpubroker``
  is imported from the fresh venv.
- ``slow`` (``make test-install``; ``make chaos``): the README's lines as written, pip resolving
  every dependency as a user's would (build isolation, no ``.pth``). Only torch comes first,
  in place of the README's CPU hint: the PyTorch CPU index is not reachable from this machine, so
  the test venv's torch version (this machine's CPU build, on its disk) is installed before the
  wheel, as the hint's index would give it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

import pytest

import gpubroker

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "gpubroker", "broker", "deployments", "quotas", "configs")


def install_lines(text: str = README) -> list[str]:
    """The install block (the ```bash block whose first line is ``pip wheel``), one command a line."""
    blocks = re.findall(r"```bash\n(pip wheel .*?)```", text, re.S)
    assert len(blocks) == 1, "expected one ```bash block starting `pip wheel` (the install lines)"
    return [line for line in blocks[0].splitlines() if line.strip()]


def test_the_docs_show_the_readmes_install_lines_and_name_this_version():
    ops = install_lines((ROOT / "docs" / "operations.md").read_text(encoding="utf-8"))
    assert ops == [line.partition("  #")[0].rstrip() for line in install_lines()]
    for doc in ("README.md", "docs/operations.md", "docs/llm.md"):
        named = set(re.findall(r"gpubroker-([^-\s]+)-py3-none-any\.whl", (ROOT / doc).read_text(encoding="utf-8")))
        assert named == {gpubroker.__version__}, f"{doc} names the wheel of version(s) {named}"


def _source_copy(dest: Path) -> None:
    """The clone as the README names it (``./gpubroker``), links kept as links: an in-tree build would leave
    build/ in the clone."""
    dest.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=skip)
        elif src.exists():
            shutil.copy2(src, dest / name)


def _fresh_venv(where: Path) -> dict[str, str]:
    """A new venv (with pip) and the environment that puts it first: no PYTHONPATH, no VIRTUAL_ENV of ours."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{where / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
        VIRTUAL_ENV=str(where),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RAY_USAGE_STATS_ENABLED="0",
        COLUMNS="200",
    )
    return env


def _site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _bash(line: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"`{line}` exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return run


def _ci_form(line: str) -> str:
    """A README line as `make test` runs it (the module docstring says why)."""
    if line.startswith("pip wheel "):
        return f"{shlex.quote(sys.executable)} -m pip wheel --no-build-isolation " + line.removeprefix("pip wheel ")
    if line.startswith("pip install "):
        return line.replace("pip install ", "pip install --no-deps ", 1)
    return line


def _run_install_block(work: Path, env: dict[str, str], *, ci: bool, timeout: float) -> dict[str, str]:
    """Runs the README's install lines in ``work``; returns what each printed, by its first two words."""
    printed = {}
    for line in install_lines():
        run = _bash(_ci_form(line) if ci else line, work, env, timeout)
        printed[" ".join(line.split()[:2])] = run.stdout
    return printed


def _quickstart_first_steps(venv: Path, env: dict[str, str], project: Path) -> None:
    """From a project folder outside the clone: the shipped demo validates, `demo-config` writes the same files."""
    project.mkdir()
    where = _bash("python -c 'import gpubroker; print(gpubroker.__file__)'", project, env, 60).stdout.strip()
    assert Path(where).is_relative_to(venv), f"gpubroker imported from {where}, not from the fresh venv {venv}"
    assert not Path(where).is_relative_to(ROOT)
    assert "demo-config" in _bash("gpubroker --help", project, env, 60).stdout
    shipped = json.loads(_bash("gpubroker validate --demo --json", project, env, 300).stdout)
    assert shipped["valid"] and set(shipped["config"]["models"]) == {"minilm", "cnn", "mlp", "prof"}
    assert Path(shipped["source"]).is_relative_to(venv), shipped["source"]
    written = _bash("gpubroker demo-config", project, env, 60).stdout
    assert "configs/demo.yaml" in written and (project / "configs" / "grafana" / "gpubroker.json").is_file()
    copied = json.loads(_bash("gpubroker validate --json configs/demo.yaml", project, env, 300).stdout)
    assert copied["config_hash"] == shipped["config_hash"]
    placed = json.loads(
        _bash("gpubroker validate --json --no-import configs/cluster-demo.yaml", project, env, 60).stdout
    )
    assert placed["valid"] and placed["placement"], "the cluster demo places its replicas"
    again = subprocess.run(
        ["bash", "-c", "gpubroker demo-config"], cwd=project, env=env, capture_output=True, text=True
    )
    assert again.returncode == 1 and "configs/demo.yaml" in again.stderr, "a second demo-config keeps the files"


def _wheel_named_in_readme(work: Path) -> None:
    (wheel,) = (work / "dist").glob("gpubroker-*.whl")
    assert wheel.name == f"gpubroker-{gpubroker.__version__}-py3-none-any.whl"
    assert f'"dist/{wheel.name}[demo]"' in README, f"README's install line must name {wheel.name}"


def test_the_readmes_install_lines_install_the_wheel_in_a_fresh_venv_and_the_demo_validates(tmp_path):
    _source_copy(tmp_path / "gpubroker")
    venv = tmp_path / "venv"
    env = _fresh_venv(venv)
    (_site_packages(venv) / "test-venv-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    printed = _run_install_block(tmp_path, env, ci=True, timeout=300)
    _wheel_named_in_readme(tmp_path)
    assert printed["gpubroker --version"].strip() == f"gpubroker {gpubroker.__version__}"
    _quickstart_first_steps(venv, env, tmp_path / "acme-serving")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_readmes_install_lines_as_written_resolve_every_dependency_in_a_fresh_venv(tmp_path):
    _source_copy(tmp_path / "gpubroker")
    venv = tmp_path / "venv"
    env = _fresh_venv(venv)
    _bash(f"pip install -q torch=={version('torch')}", tmp_path, env, 1200)  # the CPU hint's torch (docstring)
    printed = _run_install_block(tmp_path, env, ci=False, timeout=1800)
    _wheel_named_in_readme(tmp_path)
    assert printed["gpubroker --version"].strip() == f"gpubroker {gpubroker.__version__}"
    ray = _bash("python -c 'import ray; print(ray.__version__)'", tmp_path, env, 120).stdout.strip()
    assert tuple(int(x) for x in ray.split(".")[:2]) >= (2, 58), ray
    _quickstart_first_steps(venv, env, tmp_path / "acme-serving")
